"""Where the analytic allocated peak lies at the edge of the capacity, the fit verdict and the
largest batch come from the traced step's event stream (memplan/traced/verdict.py) when torch
and transformers are installed and the setup is one the trace follows; the analytic verdict
stands elsewhere, and where they are not installed. docs/fit_verdict.md gives the figures."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from memplan.schema import Gpu, MemoryEstimate, ModelSpec, TrainSetup

# The boundary zone: from this share of the capacity up to the capacity.
EDGE_LOW = 0.85
NOTE = "verdict from the traced step (the analytic peak is at the edge of the capacity)"


def traceable() -> bool:
    """torch and transformers installed (the traced step needs both)."""
    return all(importlib.util.find_spec(name) for name in ("torch", "transformers"))


def at_edge(result: MemoryEstimate, gpu: Gpu) -> bool:
    """Whether the allocated peak fits and it, or the analytic replay's reserved peak, lies in
    the boundary zone (fragmentation may decide a step whose allocated peak lies below it)."""
    if result.peak_bytes > gpu.capacity:
        return False
    reserved = result.reserved.reserved_bytes if result.reserved else 0
    return max(result.peak_bytes, reserved) >= EDGE_LOW * gpu.capacity


def applies(spec: ModelSpec, setup: TrainSetup) -> bool:
    """Whether the traced stream decides this setup (a config transformers can build, a setup
    the trace follows, torch and transformers installed)."""
    if not spec.hf_config or not traceable():
        return False
    from memplan.traced.verdict import decides

    return decides(setup)


def judged_at_edge(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu, result: MemoryEstimate
) -> MemoryEstimate:
    """`result` with the traced verdict where its allocated peak is at the edge and the trace
    applies; as it was otherwise, or where the trace fails."""
    if not at_edge(result, gpu) or not applies(spec, setup):
        return result
    from memplan.errors import MemplanError
    from memplan.traced.verdict import traced_reserved

    try:
        reserved = traced_reserved(spec, setup, gpu)
    except MemplanError:  # the model's code cannot run on meta tensors: the analytic verdict
        return result
    return result.model_copy(update={"reserved": reserved})


def batch_runs(
    spec: ModelSpec,
    setup_at: Callable[[int], TrainSetup],
    gpu: Gpu,
    analytic: Callable[[int], bool],
) -> Callable[[int], bool]:
    """The replay test of the largest-batch search over the setups `setup_at` gives: the traced
    stream's where the trace applies (two traces, then every batch from their affine stream;
    a trace per batch asked where the stream is not affine in the batch), else `analytic`."""
    if not applies(spec, setup_at(2)):
        return analytic
    from memplan.traced.verdict import affine_in_batch

    if not affine_in_batch(setup_at(2)):
        return _each_traced(spec, setup_at, gpu, analytic)
    return _affine_traced(spec, setup_at, gpu, analytic)


def _affine_traced(
    spec: ModelSpec,
    setup_at: Callable[[int], TrainSetup],
    gpu: Gpu,
    analytic: Callable[[int], bool],
) -> Callable[[int], bool]:
    from memplan.errors import MemplanError
    from memplan.traced.verdict import BatchStream

    streams: list[BatchStream] = []

    def runs(batch: int) -> bool:
        try:
            if not streams:
                streams.append(BatchStream(spec, setup_at, gpu, batch))
            return streams[0].runs(batch)
        except (MemplanError, ValueError):
            return analytic(batch)

    return runs


def seq_runs(
    spec: ModelSpec,
    setup_at: Callable[[int], TrainSetup],
    gpu: Gpu,
    analytic: Callable[[int], bool],
) -> Callable[[int], bool]:
    """The replay test of the largest-sequence search: a trace of the step at each candidate
    (`setup_at(n)`; the stream is not affine in the sequence, as it is in the batch) where the
    trace applies, else `analytic`."""
    if not applies(spec, setup_at(1)):
        return analytic
    return _each_traced(spec, setup_at, gpu, analytic)


def _each_traced(
    spec: ModelSpec,
    setup_at: Callable[[int], TrainSetup],
    gpu: Gpu,
    analytic: Callable[[int], bool],
) -> Callable[[int], bool]:
    """A trace per candidate asked: the searches ask few, nearest their allocated bound first."""
    from memplan.errors import MemplanError
    from memplan.traced.verdict import traced_reserved

    def runs(n: int) -> bool:
        try:
            return traced_reserved(spec, setup_at(n), gpu).runs
        except (MemplanError, ValueError):
            return analytic(n)

    return runs
