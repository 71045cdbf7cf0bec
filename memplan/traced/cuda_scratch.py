"""What a CUDA op allocates beside its outputs and frees before it returns: blocks a meta tensor's
op never makes, each read from H100 and H200 allocation traces (tests/data/allocator_traces).
The tracker allocates them, in order, right after the op's outputs and frees them in reverse.

- attention backward kernels: their scratch (sdpa.backward_scratch_bytes);
- SDPA's math path's _safe_softmax: the rows that are all -inf found and zeroed
  (safe_softmax_scratch_bytes);
- softmax backward: grad * output, a tensor of grad's size (softmax_backward_cuda_out; the CPU
  kernel forms none; seen in an eager attention layer's trace, docs/traced.md);
- a sort of more than 4096 int64 keys along its only dimension: the indices' iota (int64, one per
  key), then cub's radix-sort storage (cub_sort_pairs_bytes);
- the dense embedding backward of more than 3072 ids (embedding_backward_cuda_kernel; fewer are
  summed directly): the ids sorted with their
  positions, the segments' offsets and counts, and the partial sums of up to
  n / 10 + min(n, rows) segments in fp32 (opmath) with their offsets;
- a sum, mean, prod or nansum whose input dtype is not its output's (make_reduction in
  ReduceOps.cpp casts the input first; fp16/bf16 into fp32 excepted): the input cast to the output
  dtype, e.g. an int64 copy of the bool mask FLCE counts its targets with;
- then, where the reduction kernel splits each output's inputs across CTAs, its staging buffer
  and semaphores (cuda_reduce), e.g. every RMSNorm weight gradient's sum over the tokens."""

from __future__ import annotations

import torch

from memplan.estimators.kernel_scratch import (
    cub_sort_pairs_bytes,
    embedding_backward_bytes,
    sort_blocks,
)
from memplan.traced.cuda_reduce import REDUCTIONS, CudaDevice, reduction_staging_blocks
from memplan.traced.sdpa import backward_scratch_bytes

# A kernel's blocks in allocation order; a nested list is one launch of several, its blocks
# allocated and freed before the next's (a reduction split for 32-bit indexing).
Scratch = list["int | Scratch"]


def scratch_blocks(
    func: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    out: object,
    device: CudaDevice | None = None,
) -> Scratch:
    """The blocks CUDA allocates for `func` beyond its outputs `out`, in allocation order, on
    `device` (None: an H100)."""
    name = func.overloadpacket.__name__
    if name == "sort":
        return sort_scratch_blocks(args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1))
    if name == "_safe_softmax" and isinstance(out, torch.Tensor):
        return safe_softmax_scratch_bytes(args, out)
    if name == "embedding_dense_backward":
        return embedding_backward_blocks(args[0], args[1], args[2])
    if name in REDUCTIONS and isinstance(out, torch.Tensor):
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        staging = reduction_staging_blocks(name, args[0], out, dims, device or CudaDevice())
        return [*reduction_cast_blocks(args[0], out.dtype), *staging]
    return [
        size
        for size in (backward_scratch_bytes(func, args), softmax_backward_scratch_bytes(func, args))
        if size
    ]


def safe_softmax_scratch_bytes(args: tuple, out: torch.Tensor) -> list[int]:
    """What _safe_softmax (SDPA's math path) allocates beside its output `out`, alive together
    and freed last-made first before it returns: `self.eq(-inf)` (a bool of the input's size),
    `all(masked, dim, keepdim)` (a bool per row) and the 0-d zero it fills those rows with, in
    place (an H100 allocation trace of qwen3-0.6b in fp32); on meta tensors the op runs below
    the tracker, which sees its output only."""
    scores, dim = args[0], args[1]
    return [scores.numel(), scores.numel() // scores.shape[dim], out.element_size()]


def softmax_backward_scratch_bytes(func: torch._ops.OpOverload, args: tuple) -> int:
    """CUDA's softmax backward first forms grad * output (in their promoted dtype)."""
    if func.overloadpacket.__name__ != "_softmax_backward_data":
        return 0
    grad, output = args[0], args[1]
    return grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize


def sort_scratch_blocks(keys: torch.Tensor, dim: int) -> list[int]:
    """A one-segment radix sort of int64 keys: the iota of indices it sorts with the keys, then
    cub's storage. Other sorts (small, segmented, other key dtypes) are not modelled: none."""
    n = keys.numel()
    one_segment = keys.dim() == 0 or keys.shape[dim] == n
    return sort_blocks(n) if keys.dtype == torch.int64 and one_segment else []


def embedding_backward_blocks(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> list[int]:
    """What CUDA's dense embedding backward holds beside the weight's gradient until it returns
    (EmbeddingBackwardKernel.cu, the order of an H100 trace's blocks): sorted ids and their
    positions, segment offsets, the segment count, partials per segment and their offsets, the
    partial-segment count and offsets, and the partial sums (NROWS_PER_THREAD = 10 rows each)."""
    opmath = 4 if grad.dtype in (torch.float16, torch.bfloat16, torch.float32) else 8
    return embedding_backward_bytes(ids.numel(), grad.shape[-1], rows, ids.element_size(), opmath)


def reduction_cast_blocks(source: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """The input cast to the reduction's output dtype where make_reduction casts it."""
    if dtype == source.dtype or dtype.is_complex or source.dtype.is_complex:
        return []
    if source.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32:
        return []
    return [source.numel() * dtype.itemsize]


__all__ = ["cub_sort_pairs_bytes", "scratch_blocks"]
