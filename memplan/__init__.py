"""memplan: predict the peak GPU memory of an LLM training step, pick fused Triton kernels,
apply them to a Hugging Face model and verify the prediction.

Everything is imported lazily so that `memplan advise` never imports torch."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "advise": "memplan.advisor",
    "estimate": "memplan.estimators",
    "resolve_model": "memplan.catalog",
    "resolve_gpu": "memplan.catalog",
    "apply": "memplan.patching",
    "revert": "memplan.patching",
    "AutoMemplanModelForCausalLM": "memplan.patching",
    "MemplanTrainerCallback": "memplan.patching",
    "verify": "memplan.verify",
    "track": "memplan.verify",
    "ModelSpec": "memplan.schema",
    "TrainSetup": "memplan.schema",
    "Plan": "memplan.schema",
    "MemoryEstimate": "memplan.schema",
    "Advice": "memplan.schema",
    "MemplanError": "memplan.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __dir__() -> list[str]:
    """The public API (imported on first use), as dir() and tab completion show it."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
