"""CUDA autocast, replayed on meta tensors.

torch's autocast casts only tensors of its own device type, and a meta tensor has none, so the
traced step applies CUDA autocast's op policy itself at the level of the torch functions the
model calls (F.linear, torch.matmul, Tensor.pow, ...), which is where Python code meets the
autocast-registered aten ops. The lists are CUDA's in aten/src/ATen/autocast_mode.cpp (torch
2.11); F.cross_entropy, an implicit composite of log_softmax (fp32_set_opt_dtype) and nll_loss
(fp32), is cast to fp32 as those two would.

Like autocast, casts of fp32 leaf tensors that require grad (trainable parameters) to the low
precision type are cached for the autocast region; the cache is cleared when the region ends
(the forward, or one checkpointed layer's recomputation)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

LOWER_PRECISION = frozenset(
    {
        "linear",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "mv",
        "bmm",
        "baddbmm",
        "addmm",
        "addbmm",
        "addmv",
        "addr",
        "einsum",
        "chain_matmul",
        "multi_dot",
        "vecdot",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "prelu",
        "scaled_dot_product_attention",
    }
)
FP32 = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "__pow__",
        "__rpow__",
        "softplus",
        "layer_norm",
        "group_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "cross_entropy",
    }
)
# Ops that get dtype=float32 when the caller gives no dtype.
FP32_SET_OPT_DTYPE = frozenset(
    {"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "vector_norm", "matrix_norm"}
)
# Ops that run in the widest floating type of their inputs.
PROMOTE = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "index_put",
        "scatter_add",
        "tensordot",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "index_copy",
    }
)


def _eligible(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "meta"
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


@dataclass
class Autocast:
    """CUDA autocast's state: on or off, the low precision dtype, and the weight-cast cache.
    `on_cached` is told of every cast the cache keeps (the tracker tags it)."""

    dtype: torch.dtype
    on_cached: Callable[[torch.Tensor], None] = lambda t: None
    enabled: bool = False
    _cache: dict[int, tuple[weakref.ref, torch.Tensor]] = field(default_factory=dict)

    def clear(self) -> None:
        self._cache.clear()

    def apply(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments `func` runs with under autocast: as called with `out=` (autocast
        registers the ops' functional overloads only; their out= ones run as called)."""
        if not self.enabled or kwargs.get("out") is not None:
            return args, kwargs
        name = getattr(func, "__name__", "")
        if name in LOWER_PRECISION:
            return self._cast_arguments(args, kwargs, self.dtype)
        if name in FP32:
            return self._cast_arguments(args, kwargs, torch.float32)
        if name in FP32_SET_OPT_DTYPE:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if _eligible(first) and kwargs.get("dtype") is None and not _dtype_given(args):
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        if name in PROMOTE:
            floats = [t for t in _tensors(args) + _tensors(kwargs) if _eligible(t)]
            if floats:
                widest = floats[0].dtype
                for t in floats[1:]:
                    widest = torch.promote_types(widest, t.dtype)
                return self._cast_arguments(args, kwargs, widest)
        return args, kwargs

    def _cast_arguments(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
        """Every argument cast, the last first: autocast's wrapper casts them in a C++ call's
        argument list, which GCC evaluates right to left (an H200 trace of llama-3.2-1b under
        amp: each linear's weight copy is made before its input's)."""
        cast_kwargs = dict(
            reversed([(k, self._cast_all(v, dtype)) for k, v in reversed(kwargs.items())])
        )
        cast_args = tuple(reversed([self._cast_all(a, dtype) for a in reversed(args)]))
        return cast_args, cast_kwargs

    def _cast_all(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor):
            return self._cast(value, dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast_all(v, dtype) for v in value)
        if isinstance(value, dict):
            return {k: self._cast_all(v, dtype) for k, v in value.items()}
        return value

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (
            dtype == self.dtype
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
        )
        if not cacheable:
            return t.to(dtype)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = t.to(dtype)
        self._cache[id(t)] = (weakref.ref(t), cast)
        self.on_cached(cast)
        return cast


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _dtype_given(args: tuple) -> bool:
    """softmax(x, dim, dtype) with the dtype given positionally."""
    return any(isinstance(a, torch.dtype) for a in args)
