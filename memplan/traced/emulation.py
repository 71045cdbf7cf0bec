"""The torch-function layer of the traced step: what makes the model's meta tensors run as its
CUDA tensors would, above autograd (so that autograd records what CUDA's ops save): SDPA through
the kernel CUDA picks (sdpa.route), CUDA autocast's casts (autocast.Autocast), and dropout through
the fused kernel CUDA runs in training (native_dropout: a bool mask saved for backward; on other
devices at::dropout multiplies by a noise tensor of the input's dtype instead)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memplan.traced import sdpa
from memplan.traced.autocast import Autocast

_SDPA = torch.nn.functional.scaled_dot_product_attention
_DROPOUT = torch.nn.functional.dropout


class CudaSemantics(TorchFunctionMode):
    def __init__(self, autocast: Autocast | None, compute_capability: tuple[int, int]) -> None:
        super().__init__()
        self.autocast = autocast
        self.compute_capability = compute_capability
        self.kernels: Counter[str] = Counter()  # SDPA calls by the kernel that ran them
        # Each distinct SDPA call (dtype, shapes, mask, GQA, dropout) and the kernel it got.
        self.calls: dict[sdpa.SdpaCall, str] = {}

    def copy(self) -> CudaSemantics:
        """A mode with the same state, to enter where this one is not active (a checkpointed
        layer's recomputation inside backward)."""
        twin = CudaSemantics(self.autocast, self.compute_capability)
        twin.kernels = self.kernels
        twin.calls = self.calls
        return twin

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.autocast is not None:
            args, kwargs = self.autocast.apply(func, args, kwargs)
        if func is _DROPOUT:
            return _dropout(*args, **kwargs)
        if func is _SDPA:
            kernel, out = sdpa.route(*args, **kwargs, compute_capability=self.compute_capability)
            self.kernels[kernel] += 1
            self.calls[sdpa.describe_call(*args, **kwargs)] = kernel
            return out
        return func(*args, **kwargs)


def _dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """at::dropout on CUDA: the fused native_dropout when training with 0 < p < 1
    (is_fused_kernel_acceptable), the input itself when p is 0 or not training."""
    if not training or p == 0 or input.numel() == 0 or input.device.type != "meta":
        return _DROPOUT(input, p, training, inplace)
    out = torch.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out
