"""Reserved memory and the out-of-memory verdict: the step's allocations and frees (the walk's
event stream, build and step 1 to the second steady step) replayed through the model of PyTorch's
caching allocator with the GPU's capacity. Pure Python."""

from __future__ import annotations

from memplan.estimators.allocator import AllocatorSettings, replay
from memplan.estimators.timeline import step_sizes, walk_run
from memplan.schema import Gpu, MemoryEstimate, ModelSpec, ReservedPrediction, TrainSetup


def predict_reserved(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: Gpu,
    capacity: int | None = None,
    backend: str = "cuda",
) -> ReservedPrediction:
    """Whether the step runs on `gpu` with `capacity` bytes for the allocator (default: the
    GPU's), and the torch.cuda.max_memory_reserved() it reaches. Reserving past the capacity
    first releases the cached segments that hold nothing, as the allocator does; a step that
    still cannot allocate runs out of memory at that event."""
    capacity = gpu.capacity if capacity is None else capacity
    sizes = step_sizes(spec, setup, gpu, backend)
    _, log = walk_run(spec, setup, sizes, steady_steps=1)
    settings = AllocatorSettings(
        capacity=capacity,
        expandable_segments=setup.expandable_segments,
        device_memory=gpu.memory_bytes,
    )
    result = replay(log.events, settings, marks=log.step_ends[:1])
    oom = None if result.oom_index is None else log.events[result.oom_index]
    return ReservedPrediction(
        capacity_bytes=capacity,
        expandable_segments=setup.expandable_segments,
        runs=oom is None,
        reserved_bytes=result.peak_reserved,
        oom_phase=oom.phase if oom else None,
        oom_label=oom.label if oom else None,
        allocated_bytes=None if oom else result.peak_allocated,
        allocated_step1_bytes=None if oom else result.peaks_by[0],
    )


def with_reserved(predicted: MemoryEstimate, reserved: ReservedPrediction) -> MemoryEstimate:
    """The estimate with its replay. max_memory_allocated counts the allocator's blocks, so where
    the replay holds more than the walk's tensors (a large request whose segment would leave at
    most 1 MiB takes the whole segment: SmolLM3's 43 MiB MLP weights take 44), its allocated
    peaks are the prediction, the difference under "allocator_blocks"."""
    update: dict = {"reserved": reserved}
    extra = (reserved.allocated_bytes or 0) - predicted.peak_bytes
    if extra > 0:
        breakdown = {**predicted.breakdown, "allocator_blocks": extra}
        update.update(peak_bytes=predicted.peak_bytes + extra, breakdown=breakdown)
    step1 = reserved.allocated_step1_bytes or 0
    if step1 > predicted.peak_step1_bytes:
        update["peak_step1_bytes"] = step1
    return predicted.model_copy(update=update)
