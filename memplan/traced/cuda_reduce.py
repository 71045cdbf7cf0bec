"""The staging buffer and semaphores of PyTorch's CUDA reduction kernels on meta tensors: the
reduction's TensorIterator rebuilt from the tensors' shapes and strides, its launch configuration
sized by estimators/kernel_scratch.py (pure Python, which the analytic walk shares)."""

from __future__ import annotations

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from memplan.estimators.kernel_scratch import (
    REDUCTIONS,
    WIDE_16BIT_LOADS,
    CudaDevice,
    ReduceIter,
    reduce_iter,
    staging_blocks,
)

__all__ = ["REDUCTIONS", "CudaDevice", "ReduceIter", "reduction_iter", "reduction_staging_blocks"]


def reduction_staging_blocks(
    name: str, source: torch.Tensor, out: torch.Tensor, dims: object, device: CudaDevice
) -> list:
    """The staging buffer and semaphores of `name` reducing `source` (cast to `out`'s dtype
    where make_reduction casts it) into `out` over `dims` (None or empty: all): [] where one CTA
    reduces each output; a list per 32-bit sub-iteration where the input is too large."""
    dtype = out.dtype
    scalar = source.dtype
    lowp_to_fp32 = scalar in (torch.float16, torch.bfloat16) and dtype == torch.float32
    if dtype != scalar and not lowp_to_fp32:
        scalar = dtype  # make_reduction casts the input (cuda_scratch.reduction_cast_blocks)
    if scalar.is_complex or source.numel() == 0:
        return []
    it = reduction_iter(source, scalar, out, dims)
    opmath = 4 if scalar in (torch.float16, torch.bfloat16, torch.float32) else scalar.itemsize
    vec = 8 if scalar.itemsize == 2 and name in WIDE_16BIT_LOADS else 4
    lowp_out = dtype.itemsize if dtype in (torch.float16, torch.bfloat16) and scalar == dtype else 0
    return staging_blocks(it, scalar.itemsize, opmath, vec, lowp_out, device)


def reduction_iter(
    source: torch.Tensor, scalar: torch.dtype, out: torch.Tensor, dims: object
) -> ReduceIter:
    """make_reduction's iterator: the input (its cast keeps its strides where dense), the output
    viewed with stride 0 along the reduced dimensions, reordered and coalesced."""
    ndim = source.dim()
    reduced = set(range(ndim)) if not dims else {d % ndim for d in _dims(dims)}
    if scalar == source.dtype or is_non_overlapping_and_dense_or_false(source):
        in_strides = list(source.stride())
        offset = source.storage_offset() * scalar.itemsize if scalar == source.dtype else 0
    else:
        in_strides, offset = _contiguous(source.shape), 0
    out_strides = list(out.stride())
    if out.dim() < ndim:  # review_reduce_result: the reduced dimensions back, stride 0
        for d in sorted(reduced):
            out_strides.insert(d, 0)
    else:  # kept dimensions of size 1 broadcast over the input's (compute_strides)
        out_strides = [
            0 if d in reduced and source.shape[d] != 1 else s for d, s in enumerate(out_strides)
        ]
    return reduce_iter(
        list(source.shape),
        [s * out.dtype.itemsize for s in out_strides],
        [s * scalar.itemsize for s in in_strides],
        offset,
    )


def _dims(dims: object) -> list[int]:
    return [dims] if isinstance(dims, int) else list(dims)  # type: ignore[arg-type]


def _contiguous(shape: torch.Size) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]
