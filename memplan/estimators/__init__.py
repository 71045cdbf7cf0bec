"""The analytic memory model: pure arithmetic over ModelSpec and TrainSetup; imports neither torch
nor transformers."""

from __future__ import annotations

from memplan.estimators.params import ParamCounts, count_params
from memplan.estimators.reserved import predict_reserved, with_reserved
from memplan.estimators.timeline import estimate_step
from memplan.schema import Gpu, MemoryEstimate, ModelSpec, TrainSetup


def estimate(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None, backend: str = "cuda"
) -> MemoryEstimate:
    """Predicted torch.cuda.max_memory_allocated() of a training step under the protocol."""
    return estimate_step(spec, setup, gpu, backend)


__all__ = ["estimate", "predict_reserved", "with_reserved", "count_params", "ParamCounts"]
