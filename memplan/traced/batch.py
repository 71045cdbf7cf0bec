"""The largest batch that fits, from two traces instead of one per candidate.

With the sequence length fixed, the same ops run at every batch size and each allocation's size
is affine in the batch (a tensor has at most one dimension that grows with it; weights and
optimizer states do not). Two traces of one step structure, at batches b and b + 1, give every
event's size at any batch; the search then walks that stream, and a last trace at the answer
confirms it. Batch 1 can take other paths (a size-1 dimension makes some copies views), so the
pair is taken at batch 2 or more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memplan.estimators.timeline import round_block
from memplan.schema import TrainSetup
from memplan.traced.estimate import TracedEstimate

# The advisor's search ceiling (about a million sequences).
MAX_BATCH_SEARCHED = 2**20


@dataclass(frozen=True)
class AffineStream:
    """Every event of a traced run with its size as base + slope * (batch - batch0)."""

    batch0: int
    signs: tuple[int, ...]
    base: tuple[int, ...]
    slope: tuple[int, ...]

    @classmethod
    def of(cls, low: TracedEstimate, batch: int, high: TracedEstimate) -> AffineStream | None:
        """The stream of `low` (at `batch`) and `high` (at batch + 1); None when their events
        differ in anything but size."""
        a, b = low.events.events, high.events.events
        if len(a) != len(b):
            return None
        for x, y in zip(a, b, strict=True):
            if (x.action, x.tensor, x.category, x.phase, x.label) != (
                y.action,
                y.tensor,
                y.category,
                y.phase,
                y.label,
            ):
                return None
        return cls(
            batch0=batch,
            signs=tuple(1 if e.action == "alloc" else -1 for e in a),
            base=tuple(e.nbytes for e in a),
            slope=tuple(y.nbytes - x.nbytes for x, y in zip(a, b, strict=True)),
        )

    def peak(self, batch: int) -> int:
        """The highest allocated bytes (allocator blocks) of the run at this batch."""
        step = batch - self.batch0
        allocated = top = 0
        for sign, base, slope in zip(self.signs, self.base, self.slope, strict=True):
            allocated += sign * round_block(base + slope * step)
            if allocated > top:
                top = allocated
        return top


def largest_traced_batch(
    trace: Callable[[TrainSetup], TracedEstimate],
    setup: TrainSetup,
    traced: TracedEstimate,
    limit_bytes: int,
    ceiling: int = MAX_BATCH_SEARCHED,
) -> tuple[int | None, str | None]:
    """The largest batch whose traced peak is at most `limit_bytes` (0 if not even batch 1,
    `ceiling` when that fits), and a note when the search could not be made or confirmed.
    `traced` is the trace of `setup` itself."""
    low = setup.batch if setup.batch >= 2 else 2

    def at(batch: int) -> TracedEstimate:
        return traced if batch == setup.batch else trace(setup.model_copy(update={"batch": batch}))

    try:
        stream = AffineStream.of(at(low), low, at(low + 1))
    except Exception as exc:  # noqa: BLE001 - the search is an extra; the estimate stands
        return None, f"the largest batch was not searched: {str(exc).splitlines()[0][:160]}"
    if stream is None:
        return None, (
            "the largest batch was not searched: the traced step allocates differently at "
            f"batch {low} and {low + 1}"
        )

    try:
        return _search(at, stream, limit_bytes, ceiling, low)
    except Exception as exc:  # noqa: BLE001 - a trace at another batch failed
        return None, f"the largest batch was not searched: {str(exc).splitlines()[0][:160]}"


def _search(
    at: Callable[[int], TracedEstimate],
    stream: AffineStream,
    limit_bytes: int,
    ceiling: int,
    low: int,
) -> tuple[int | None, str | None]:
    def fits(batch: int) -> bool:
        if batch < 2:
            return at(1).estimate.peak_bytes <= limit_bytes
        return stream.peak(batch) <= limit_bytes

    if not fits(1):
        return 0, None
    good = 1
    while True:
        high = min(2 * good, ceiling)
        if high == good:
            return ceiling, None
        if not fits(high):
            break
        good = high
    while high - good > 1:
        middle = (good + high) // 2
        good, high = (middle, high) if fits(middle) else (good, middle)
    if good >= 2 and good not in (low, low + 1):
        confirmed = at(good).estimate.peak_bytes
        if confirmed != stream.peak(good):
            return None, (
                f"the largest batch was not confirmed: the trace at batch {good} gives "
                f"{confirmed / 2**30:.2f} GiB, the search {stream.peak(good) / 2**30:.2f} GiB"
            )
    return good, None
