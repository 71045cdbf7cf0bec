"""memplan.apply / memplan.revert: patch a Hugging Face causal LM in place with memplan's
kernels, per-family patch specs as data (memplan/families), generic forwards (forwards.py), the
all-or-nothing engine (engine.py), the Auto class and the Trainer callback."""

from __future__ import annotations

from typing import Any

from memplan.families.patch_spec import PatchSpec
from memplan.patching.auto import AutoMemplanModelForCausalLM
from memplan.patching.engine import (
    SUPPORTED_MODEL_TYPES,
    AppliedPatch,
    applied_patch,
    apply,
    revert,
    supported_kernels,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AppliedPatch",
    "AutoMemplanModelForCausalLM",
    "MemplanTrainerCallback",
    "PatchSpec",
    "applied_patch",
    "apply",
    "revert",
    "supported_kernels",
]


def __getattr__(name: str) -> Any:
    # The callback imports transformers' trainer machinery: only when asked for.
    if name == "MemplanTrainerCallback":
        from memplan.patching.trainer import MemplanTrainerCallback

        return MemplanTrainerCallback
    raise AttributeError(f"module 'memplan.patching' has no attribute {name!r}")
