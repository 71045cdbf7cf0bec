"""The fit verdict at the edge of memory from the traced step's event stream.

Near the capacity whether a step runs depends on the exact order and size of every block the
allocator sees; the analytic walk allocates the tensors each layer saves and a few transients,
the traced step (the model's own code on meta tensors) every op's. Replayed through the
allocator model, the traced stream gave the GPU's outcome on 39 of the fit grid's 40 cases, 15 of
the 16 with memplan's kernels (docs/fit_verdict.md; in-sample). Plans with a kernel whose traced
path was not checked against recorded runs keep the analytic verdict (TRACED_KERNELS).

Imports torch and transformers: the advisor imports this module only where they are installed."""

from __future__ import annotations

from collections.abc import Callable

from memplan.estimators.allocator import AllocatorSettings, replay
from memplan.estimators.events import Event
from memplan.schema import Gpu, ModelSpec, ReservedPrediction, TrainSetup
from memplan.traced import trace_config
from memplan.traced.batch import AffineStream
from memplan.traced.estimate import TracedEstimate
from memplan.traced.step import TRACEABLE_OPTIMIZERS

# The protocol's steps: the third can run out of memory where the second did not.
STEPS = 3
# memplan's kernels whose traced path follows the GPU's allocation for allocation, checked
# against the recorded allocator traces (tests/data/allocator_traces, docs/fit_verdict.md).
TRACED_KERNELS = frozenset({"rms_norm", "rope", "swiglu", "geglu", "flce", "embedding"})


def decides(setup: TrainSetup) -> bool:
    """Whether the traced stream decides this setup's verdict: one GPU, memplan kernels among
    TRACED_KERNELS only, an optimizer the trace models, transformers' own gated DeltaNet (fla's
    and causal-conv1d's kernels do not run on meta tensors); the analytic verdict stands
    otherwise."""
    return (
        setup.deltanet_kernels == "torch"
        and setup.deltanet_conv == "torch"
        and TRACED_KERNELS.issuperset(setup.kernels)
        and setup.strategy is None
        and setup.gpus == 1
        and setup.optimizer in TRACEABLE_OPTIMIZERS
    )


def affine_in_batch(setup: TrainSetup) -> bool:
    """Whether every allocation of the traced step is affine in the batch (traced/batch.py):
    not with FLCE, whose chunks follow the rows in number and size."""
    return "flce" not in setup.kernels


def trace(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> TracedEstimate:
    """The protocol's steps traced for the model of `spec` (its config.json)."""
    config = dict(spec.hf_config, model_type=spec.model_type)
    return trace_config(config, setup, gpu, name=spec.name, steps=STEPS)


def replayed(events: list[Event], setup: TrainSetup, gpu: Gpu) -> ReservedPrediction:
    """The stream replayed through the allocator model at the GPU's capacity."""
    settings = AllocatorSettings(
        capacity=gpu.capacity,
        expandable_segments=setup.expandable_segments,
        device_memory=gpu.memory_bytes,
    )
    result = replay(events, settings)
    oom = None if result.oom_index is None else events[result.oom_index]
    return ReservedPrediction(
        capacity_bytes=gpu.capacity,
        expandable_segments=setup.expandable_segments,
        runs=oom is None,
        reserved_bytes=result.peak_reserved,
        oom_phase=oom.phase if oom else None,
        oom_label=oom.label if oom else None,
        method="traced",
    )


def traced_reserved(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> ReservedPrediction:
    """The verdict and reserved peak of the traced step."""
    return replayed(trace(spec, setup, gpu).events.events, setup, gpu)


class BatchStream:
    """The traced stream at any batch from two traces (traced/batch.py: every event's size is
    affine in the batch where affine_in_batch), for the largest-batch search over the setups
    `setup_at` gives; batch 1 is traced on its own."""

    def __init__(
        self, spec: ModelSpec, setup_at: Callable[[int], TrainSetup], gpu: Gpu, batch: int
    ) -> None:
        self.spec, self._at, self.gpu = spec, setup_at, gpu
        self.low = max(batch, 2)
        low = trace(spec, self._at(self.low), gpu)
        stream = AffineStream.of(low, self.low, trace(spec, self._at(self.low + 1), gpu))
        if stream is None:
            raise ValueError(
                f"the traced step allocates differently at batch {self.low} and {self.low + 1}"
            )
        self.stream = stream
        self.template = low.events.events

    def events(self, batch: int) -> list[Event]:
        if batch < 2:
            return trace(self.spec, self._at(batch), self.gpu).events.events
        step = batch - self.stream.batch0
        return [
            Event(e.action, e.tensor, base + slope * step, e.category, e.phase, e.label, e.stream)
            for e, base, slope in zip(
                self.template, self.stream.base, self.stream.slope, strict=True
            )
        ]

    def runs(self, batch: int) -> bool:
        return replayed(self.events(batch), self._at(batch), self.gpu).runs
