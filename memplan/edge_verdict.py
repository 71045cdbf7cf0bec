"""Where the analytic allocated peak lies at the edge of the capacity, the fit verdict and the
largest batch come from the traced step's event stream (memplan/traced/verdict.py) when torch
and transformers are installed and the setup is one the trace follows; the analytic verdict
stands elsewhere, and where they are not installed. docs/fit_verdict.md gives the figures."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from memplan.schema import Gpu, MemoryEstimate, ModelSpec, TrainSetup

# The boundary zone: allocated peaks from this share of the capacity up to the capacity.
EDGE_LOW = 0.85
NOTE = "verdict from the traced step (the analytic peak is at the edge of the capacity)"


def traceable() -> bool:
    """torch and transformers installed (the traced step needs both)."""
    return all(importlib.util.find_spec(name) for name in ("torch", "transformers"))


def at_edge(peak_bytes: int, gpu: Gpu) -> bool:
    return EDGE_LOW * gpu.capacity <= peak_bytes <= gpu.capacity


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
    if not at_edge(result.peak_bytes, gpu) or not applies(spec, setup):
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


def _each_traced(
    spec: ModelSpec,
    setup_at: Callable[[int], TrainSetup],
    gpu: Gpu,
    analytic: Callable[[int], bool],
) -> Callable[[int], bool]:
    """A trace per batch asked: the search asks few, nearest its allocated bound first."""
    from memplan.errors import MemplanError
    from memplan.traced.verdict import traced_reserved

    def runs(batch: int) -> bool:
        try:
            return traced_reserved(spec, setup_at(batch), gpu).runs
        except MemplanError:
            return analytic(batch)

    return runs
