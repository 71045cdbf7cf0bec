"""`with memplan.track(plan) as t: <any training loop>`: the loop's measured peak
(torch.cuda.max_memory_allocated, as in the protocol) next to the plan's prediction.

The peak counter is reset on entry, so everything already allocated (the weights) counts, as in
the protocol's absolute figure; the loop must not reset it itself."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, Protocol

from memplan.errors import MemplanError
from memplan.schema import GIB, Advice, MemoryEstimate, Plan, TrackResult


class MemoryReader(Protocol):
    def reset_peak(self) -> None: ...
    def peak_allocated(self) -> int: ...
    def peak_reserved(self) -> int: ...


class CudaMemoryReader:
    """The caching allocator's counters of one CUDA device."""

    def __init__(self, device: Any = None) -> None:
        import torch

        if not torch.cuda.is_available():
            raise MemplanError("memplan.track measures GPU memory and no CUDA GPU is available")
        self._torch = torch
        self._device = device

    def reset_peak(self) -> None:
        self._torch.cuda.synchronize(self._device)
        self._torch.cuda.reset_peak_memory_stats(self._device)

    def peak_allocated(self) -> int:
        self._torch.cuda.synchronize(self._device)
        return self._torch.cuda.max_memory_allocated(self._device)

    def peak_reserved(self) -> int:
        return self._torch.cuda.max_memory_reserved(self._device)


def predicted_peak(plan: Plan | Advice | MemoryEstimate | int | None) -> int | None:
    if plan is None or isinstance(plan, int):
        return plan
    if isinstance(plan, Advice):
        return plan.peak_bytes
    if isinstance(plan, MemoryEstimate):
        return plan.peak_bytes
    if isinstance(plan, Plan):
        return plan.predicted_peak_bytes
    raise MemplanError(
        "memplan.track takes a Plan, an Advice, a MemoryEstimate or a byte count, "
        f"not {type(plan).__name__}"
    )


def _is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


# Tracker blocks open in this process.
_open_trackers = 0


class Tracker:
    """The context manager `memplan.track` returns; `result` is set on exit."""

    def __init__(
        self,
        plan: Plan | Advice | MemoryEstimate | int | None = None,
        *,
        reader: MemoryReader | None = None,
        quiet: bool = False,
        device: Any = None,
    ) -> None:
        self.predicted_peak_bytes = predicted_peak(plan)
        self._reader = reader
        self._device = device
        self._quiet = quiet
        self._start: float | None = None
        self.result: TrackResult | None = None

    def __enter__(self) -> Tracker:
        global _open_trackers
        if _open_trackers:
            # An inner block's reset of the one peak counter would erase the outer block's peak.
            raise MemplanError(
                "memplan.track blocks cannot be nested: the GPU has one peak counter"
            )
        if self._reader is None:
            self._reader = CudaMemoryReader(self._device)
        self._reader.reset_peak()
        self._start = time.perf_counter()
        _open_trackers += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _open_trackers
        _open_trackers -= 1
        assert self._reader is not None and self._start is not None
        status = "ok" if exc is None else ("oom" if _is_oom(exc) else "error")
        try:
            peak, reserved = self._reader.peak_allocated(), self._reader.peak_reserved()
        except Exception:
            if exc is None:
                raise
            # The block's own error (a sticky CUDA fault fails the synchronize too) is the one
            # the caller must see.
            peak = reserved = None
        self.result = TrackResult(
            status=status,
            predicted_peak_bytes=self.predicted_peak_bytes,
            measured_peak_bytes=peak,
            reserved_bytes=reserved,
            seconds=time.perf_counter() - self._start,
        )
        if not self._quiet:
            print(self.summary(), file=sys.stderr)

    @property
    def measured_peak_bytes(self) -> int | None:
        return self.result.measured_peak_bytes if self.result else None

    @property
    def error_pct(self) -> float | None:
        return self.result.error_pct if self.result else None

    def summary(self) -> str:
        r = self.result
        if r is None:
            return "memplan.track: nothing measured yet"
        if r.measured_peak_bytes is None:
            return f"memplan.track: the block failed ({r.status}) and the peak could not be read"
        measured = f"{r.measured_peak_bytes / GIB:.2f} GiB"
        if r.status == "oom":
            measured = f"out of memory above {measured}"
        text = f"memplan.track: measured peak {measured}"
        if r.predicted_peak_bytes is not None:
            text += f", predicted {r.predicted_peak_bytes / GIB:.2f} GiB"
            if r.status == "ok" and r.error_pct is not None:
                text += f" ({r.error_pct:+.1f}%)"
        return text


def track(
    plan: Plan | Advice | MemoryEstimate | int | None = None,
    *,
    reader: MemoryReader | None = None,
    quiet: bool = False,
    device: Any = None,
) -> Tracker:
    """Measure the peak of the code inside `with` against the prediction of `plan` (an Advice,
    a Plan with predicted_peak_bytes, a MemoryEstimate or bytes). Exceptions pass through; an
    out-of-memory error is recorded as status "oom" first."""
    return Tracker(plan, reader=reader, quiet=quiet, device=device)
