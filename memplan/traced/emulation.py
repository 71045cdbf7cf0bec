"""The torch-function layer of the traced step: what makes the model's meta tensors run as its
CUDA tensors would, above autograd (so that autograd records what CUDA's ops save): SDPA through
the kernel CUDA picks (sdpa.route) and CUDA autocast's casts (autocast.Autocast)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memplan.traced import sdpa
from memplan.traced.autocast import Autocast

_SDPA = torch.nn.functional.scaled_dot_product_attention


class CudaSemantics(TorchFunctionMode):
    def __init__(self, autocast: Autocast | None, compute_capability: tuple[int, int]) -> None:
        super().__init__()
        self.autocast = autocast
        self.compute_capability = compute_capability
        self.kernels: Counter[str] = Counter()  # SDPA calls by the kernel that ran them

    def copy(self) -> CudaSemantics:
        """A mode with the same state, to enter where this one is not active (a checkpointed
        layer's recomputation inside backward)."""
        twin = CudaSemantics(self.autocast, self.compute_capability)
        twin.kernels = self.kernels
        return twin

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.autocast is not None:
            args, kwargs = self.autocast.apply(func, args, kwargs)
        if func is _SDPA:
            kernel, out = sdpa.route(*args, **kwargs, compute_capability=self.compute_capability)
            self.kernels[kernel] += 1
            return out
        return func(*args, **kwargs)
