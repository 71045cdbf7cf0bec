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

import math

import torch

from memplan.traced.cuda_reduce import REDUCTIONS, CudaDevice, reduction_staging_blocks
from memplan.traced.sdpa import backward_scratch_bytes

# Sorts of at most this many keys run in place in one block (sortKeyValueInplace, Sort.cu).
SMALL_SORT_KEYS = 4096
# cub's onesweep radix sort of int64 keys with int64 values on sm90: items per tile (the
# lookback's unit), passes of 8 bits each, and its temporaries' alignment.
ONESWEEP_TILE_ITEMS = 4608
RADIX_DIGITS = 256
CUB_ALIGNMENT = 256

# Up to this many ids the dense embedding backward sums rows directly, without sorting
# (embedding_backward_feature_kernel).
EMBEDDING_DIRECT_IDS = 3072
# Rows of one partial sum in the dense embedding backward (NROWS_PER_THREAD).
EMBEDDING_ROWS_PER_PARTIAL = 10

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
    if keys.dtype != torch.int64 or n <= SMALL_SORT_KEYS or not one_segment:
        return []
    return [n * 8, cub_sort_pairs_bytes(n)]


def embedding_backward_blocks(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> list[int]:
    """What CUDA's dense embedding backward holds beside the weight's gradient until it returns
    (EmbeddingBackwardKernel.cu, the order of an H100 trace's blocks): sorted ids and their
    positions, segment offsets, the segment count, partials per segment and their offsets, the
    partial-segment count and offsets, and the partial sums (NROWS_PER_THREAD = 10 rows each)."""
    n, width = ids.numel(), grad.shape[-1]
    if n <= EMBEDDING_DIRECT_IDS:
        return []
    segments = min(n, rows)
    partials = n // EMBEDDING_ROWS_PER_PARTIAL + segments
    opmath = 4 if grad.dtype in (torch.float16, torch.bfloat16, torch.float32) else 8
    index = ids.element_size()
    counts = [n * index, n * index, n * index, 8, segments * index, segments * index, 8]
    return [*counts, partials * index, partials * width * opmath]


def cub_sort_pairs_bytes(n: int, key_bytes: int = 8, value_bytes: int = 8) -> int:
    """cub::DeviceRadixSort::SortPairs' temporary storage for n int64 keys with int64 values:
    alternate key and value buffers, one 256-digit histogram of 8-byte counts per 8-bit pass, the
    passes' counters, the lookback (one 256-digit row of 4-byte entries per tile), each aligned
    to 256 bytes, and 255 bytes of slack for aligning the whole (AliasTemporaries). Matches the
    block every recorded trace allocates: 8192 keys 150,015 B, 71,680 keys 1,180,159 B, 81,920
    keys 1,346,047 B and 129,024 keys 2,109,951 B."""
    passes = key_bytes
    parts = (
        n * key_bytes,
        n * value_bytes,
        passes * RADIX_DIGITS * 8,
        passes * 4,
        math.ceil(n / ONESWEEP_TILE_ITEMS) * RADIX_DIGITS * 4,
    )
    return sum(_aligned(part) for part in parts) + CUB_ALIGNMENT - 1


def reduction_cast_blocks(source: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """The input cast to the reduction's output dtype where make_reduction casts it."""
    if dtype == source.dtype or dtype.is_complex or source.dtype.is_complex:
        return []
    if source.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32:
        return []
    return [source.numel() * dtype.itemsize]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // CUB_ALIGNMENT) * CUB_ALIGNMENT
