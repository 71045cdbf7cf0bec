"""A traced estimate: the model's own Hugging Face code run for one training step on meta tensors
(no memory), every storage's allocation and release recorded, and the stream turned into the
same MemoryEstimate the analytic path gives (method "traced"). For architectures the families
registry does not hold, and to check the registry's hand-written contracts against the installed
transformers. Imports torch and transformers: nothing on the analytic path imports this package
at module level."""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401 - both are needed: fail here, where callers catch ImportError
import transformers  # noqa: F401

from memplan.schema import Gpu, TrainSetup
from memplan.traced.estimate import TracedEstimate, memory_estimate


def trace_config(
    config: dict[str, Any],
    setup: TrainSetup,
    gpu: Gpu | None = None,
    *,
    name: str | None = None,
    trust_remote_code: bool = False,
    steps: int = 2,
) -> TracedEstimate:
    """The traced estimate of the protocol's step for the model a config.json dict describes."""
    from memplan.traced.model import hf_config
    from memplan.traced.step import trace_steps

    hf = hf_config(config, name=name, trust_remote_code=trust_remote_code)
    run = trace_steps(hf, setup, gpu, steps=steps, trust_remote_code=trust_remote_code)
    return memory_estimate(run)


__all__ = ["TracedEstimate", "trace_config"]
