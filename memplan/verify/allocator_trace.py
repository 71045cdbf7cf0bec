"""The measured memory timeline of one training step, from the allocator's history
(`torch.cuda.memory._record_memory_history` + `_snapshot()`). Pure Python: the child records,
this module reads the snapshot's trace.

Phases are told apart by marker allocations: before each phase the child allocates and frees a
block of a size no tensor of the step has (512 bytes x a prime from 1021 on), so the boundaries
sit in the trace itself, exact, with no clock to align."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memplan.schema import MemoryEvent


def _primes_from(start: int, count: int) -> list[int]:
    primes: list[int] = []
    n = start
    while len(primes) < count:
        if n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)):
            primes.append(n)
        n += 1
    return primes


def marker_sizes(count: int) -> list[int]:
    """Byte sizes of `count` phase markers: 512 x the primes from 1021 on, all distinct (one
    marker per phase whatever the number of micro-batches); multiples of 512 so the allocator
    does not round, with a prime factor above 1000 that the tensors of a step do not have."""
    return [512 * p for p in _primes_from(1021, count)]


def events_from_trace(
    trace: Iterable[dict], *, baseline_bytes: int, phases: Sequence[str]
) -> list[MemoryEvent]:
    """Allocated bytes after every alloc / free of the trace, starting from `baseline_bytes`.

    `phases[i]` starts at the allocation of a block of `marker_sizes(len(phases))[i]` bytes; the
    markers themselves are left out. The allocator's `allocated_bytes` counts a block from its
    `alloc` to its `free_requested` (not `free_completed`, which may wait for other streams), and
    so does this."""
    sizes = marker_sizes(len(phases))
    next_marker = 0
    marker_addrs: set[int] = set()
    phase = "before"
    allocated = baseline_bytes
    events: list[MemoryEvent] = []
    for entry in trace:
        action = entry.get("action")
        size = int(entry.get("size", 0))
        addr = entry.get("addr")
        if action == "alloc":
            if next_marker < len(sizes) and size == sizes[next_marker]:
                phase = phases[next_marker]
                next_marker += 1
                marker_addrs.add(addr)
                continue
            allocated += size
        elif action == "free_requested":
            if addr in marker_addrs:
                marker_addrs.discard(addr)
                continue
            allocated -= size
        else:
            continue
        events.append(MemoryEvent(index=len(events), phase=phase, allocated_bytes=allocated))
    return events


def downsample(events: Sequence[MemoryEvent], max_points: int = 4000) -> list[MemoryEvent]:
    """At most about `max_points` events that keep the shape: the lowest and the highest event of
    each consecutive chunk, in order (so the overall peak is always kept)."""
    if len(events) <= max_points:
        return list(events)
    chunk = -(-len(events) // (max_points // 2))
    kept: list[MemoryEvent] = []
    for start in range(0, len(events), chunk):
        part = events[start : start + chunk]
        low = min(part, key=lambda e: e.allocated_bytes)
        high = max(part, key=lambda e: e.allocated_bytes)
        kept.extend(sorted({low.index: low, high.index: high}.values(), key=lambda e: e.index))
    return kept
