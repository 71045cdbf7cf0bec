"""What CUDA kernels allocate beside their outputs, in bytes: pure Python (no torch), shared by
the analytic walk (estimators/timeline.py) and the traced step (traced/cuda_scratch.py and
traced/cuda_reduce.py, which read the sizes and strides off meta tensors).

- Reductions' global-memory staging buffer and semaphores (ATen/native/cuda/Reduce.cuh, torch
  2.11): where setReduceConfig splits each output's inputs across several CTAs
  (ctas_per_output > 1), gpu_reduce_kernel allocates ReduceConfig::global_memory_size() bytes of
  partial results, then semaphore_size() bytes of per-output-block counters, through the caching
  allocator, and frees them when the kernel is launched. The TensorIterator (reduced dimensions
  first, then coalesced) is ported with the configuration. Hugging Face's RMSNorm weight gradient
  (and a Linear's bias gradient) sums all tokens per hidden unit: 128 fp32 partials per output
  and CTA, e.g. tokens * hidden * 8 bytes at 8192 tokens.
- A one-segment radix sort of int64 keys: the iota of its indices, then cub's storage.
- The dense embedding backward of more than 3072 ids (EmbeddingBackwardKernel.cu)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# Reduce.cuh's constants: threads per block (complex double: 256), the warp, the CTA split's
# bounds on values per thread (CUDA's, not ROCm's).
MAX_NUM_THREADS = 512
WARP_SIZE = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
# can_use_32bit_indexing: every operand's largest byte offset, and the element count, fit int32.
INT32_MAX = 2**31 - 1
# Resident threads per SM where not 2048 (CUDA C Programming Guide's compute capabilities).
MAX_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536, (12, 1): 1536}
DEFAULT_THREADS_PER_SM = 2048

# The reductions that run gpu_reduce_kernel with a sum-like accumulator (opmath).
REDUCTIONS = ("sum", "mean", "nansum", "prod")
# sum and mean read 16-bit inputs 8 at a time (ReduceSumProdKernel.cu, ReduceMomentKernel.cu).
WIDE_16BIT_LOADS = ("sum", "mean")


@dataclass(frozen=True)
class CudaDevice:
    """What a reduction's launch configuration reads of the GPU."""

    sm_count: int = 132
    max_threads_per_sm: int = 2048

    @classmethod
    def of(cls, sm_count: int | None, capability: tuple[int, int] | None) -> CudaDevice:
        """The device with `sm_count` SMs (None: an H100's) of compute `capability`."""
        threads = MAX_THREADS_PER_SM.get(tuple(capability or ()), DEFAULT_THREADS_PER_SM)
        return cls(sm_count or cls.sm_count, threads)


@dataclass
class ReduceIter:
    """A reduction's TensorIterator: its shape, the output's and the input's strides and the
    input's offset, in bytes (reduced dimensions, of output stride 0, first)."""

    shape: list[int]
    out: list[int]
    inp: list[int]
    offset: int = 0

    def numel(self) -> int:
        return math.prod(self.shape)

    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.out if s == 0)

    def num_outputs(self) -> int:
        return math.prod(n for n, s in zip(self.shape, self.out, strict=True) if s != 0 or n == 0)

    def can_use_32bit_indexing(self) -> bool:
        if self.numel() > INT32_MAX:
            return False
        return all(
            1 + sum((n - 1) * s for n, s in zip(self.shape, strides, strict=True)) <= INT32_MAX
            for strides in (self.out, self.inp)
        )


def reduce_iter(
    shape: list[int], out_strides: list[int], in_strides: list[int], offset: int = 0
) -> ReduceIter:
    """make_reduction's iterator from byte strides per input dimension (the output's 0 along
    the reduced ones), reordered and coalesced."""
    it = ReduceIter(list(shape), list(out_strides), list(in_strides), offset)
    _reorder(it)
    _coalesce(it)
    return it


def staging_blocks(
    it: ReduceIter, scalar: int, opmath: int, vec: int, lowp_out: int, device: CudaDevice
) -> list:
    """The staging buffer and semaphores of the reduction `it` of `scalar`-byte inputs summed
    in `opmath`-byte accumulators, read `vec` at a time: [] where one CTA reduces each output; a
    list per distinct 32-bit sub-iteration where the input is too large, after the opmath
    buffer that a 16-bit output of `lowp_out` bytes (0: none) accumulates in."""
    if it.can_use_32bit_indexing():
        return _blocks(it, scalar, opmath, vec, device)
    held = []
    if lowp_out:
        span = max([lowp_out, *(n * s for n, s in zip(it.shape, it.out, strict=True))])
        held.append(span // lowp_out * opmath)
    subs = (_blocks(sub, scalar, opmath, vec, device) for sub in split_32bit(it))
    distinct = dict.fromkeys(tuple(blocks) for blocks in subs if blocks)
    return [*held, *(list(blocks) for blocks in distinct)]


def sum_staging_blocks(
    shape: list[int],
    reduced: list[int],
    scalar: int,
    out_bytes: int,
    device: CudaDevice,
    name: str = "sum",
) -> list:
    """staging_blocks of `name` over dimensions `reduced` of a contiguous input of `scalar`-byte
    floats into a contiguous output of `out_bytes`-byte floats (fp16/bf16 into fp32: no cast)."""
    in_strides, out_strides, step, out_step = [], [], scalar, out_bytes
    for d in reversed(range(len(shape))):
        in_strides.append(step)
        out_strides.append(0 if d in reduced and shape[d] != 1 else out_step)
        step *= max(shape[d], 1)
        out_step *= 1 if d in reduced else max(shape[d], 1)
    if not math.prod(shape):
        return []
    it = reduce_iter(shape, out_strides[::-1], in_strides[::-1])
    vec = 8 if scalar == 2 and name in WIDE_16BIT_LOADS else 4
    lowp_out = out_bytes if out_bytes == 2 and scalar == 2 else 0
    return staging_blocks(it, scalar, max(scalar, 4), vec, lowp_out, device)


def _reorder(it: ReduceIter) -> None:
    """TensorIteratorBase::reorder_dimensions: reduced dimensions first, then by stride."""
    ndim = len(it.shape)
    perm = list(range(ndim))[::-1]

    def should_swap(d0: int, d1: int) -> int:
        for i, strides in enumerate((it.out, it.inp)):
            s0, s1 = strides[d0], strides[d1]
            if i == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if it.shape[d0] > it.shape[d1]:
                return 1
        return 0

    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    it.shape = [it.shape[p] for p in perm]
    it.out = [it.out[p] for p in perm]
    it.inp = [it.inp[p] for p in perm]


def _coalesce(it: ReduceIter) -> None:
    """TensorIteratorBase::coalesce_dimensions: merge dimensions that step like one."""
    if len(it.shape) <= 1:
        return
    shape, operands = it.shape, (it.out, it.inp)
    prev = 0
    for d in range(1, len(shape)):
        if (
            shape[prev] == 1
            or shape[d] == 1
            or all(shape[prev] * s[prev] == s[d] for s in operands)
        ):
            if shape[prev] == 1:
                for s in operands:
                    s[prev] = s[d]
            shape[prev] *= shape[d]
        else:
            prev += 1
            if prev != d:
                for s in operands:
                    s[prev] = s[d]
                shape[prev] = shape[d]
    del shape[prev + 1 :], it.out[prev + 1 :], it.inp[prev + 1 :]


def split_32bit(it: ReduceIter) -> list[ReduceIter]:
    """with_32bit_indexing's parts, each distinct one once, in the order they first run: halve
    the dimension of largest extent until each part fits, depth first, the first half first
    (TensorIteratorBase::split; reductions are not re-coalesced). Equal parts stage equal
    blocks, each freed before the next part runs, so one stands for all (and a huge input's
    millions of parts are never listed)."""
    key = (tuple(it.shape), tuple(it.out), tuple(it.inp), it.offset % OFFSET_PERIOD)
    return [ReduceIter(list(s), list(o), list(i), off) for s, o, i, off in _split(*key)]


# The input offset matters to a part's staging only through its alignment (_output_vec_size).
OFFSET_PERIOD = 4096


@functools.cache
def _split(shape: tuple, out: tuple, inp: tuple, offset: int) -> tuple:
    top = ReduceIter(list(shape), list(out), list(inp), offset)
    if top.can_use_32bit_indexing():
        return ((shape, out, inp, offset),)
    dim = max(
        (d for d in reversed(range(len(shape))) if shape[d]),
        key=lambda d: (shape[d] - 1) * max(abs(out[d]), abs(inp[d])),
    )
    first, rest = shape[dim] // 2, shape[dim] - shape[dim] // 2
    step = inp[dim] * first
    head = _split(tuple(_with(list(shape), dim, first)), out, inp, offset)
    tail = _split(tuple(_with(list(shape), dim, rest)), out, inp, (offset + step) % OFFSET_PERIOD)
    return tuple(dict.fromkeys(head + tail))


def _blocks(it: ReduceIter, scalar: int, opmath: int, vec: int, device: CudaDevice) -> list[int]:
    buffer, semaphores = staging_bytes(it, scalar, opmath, vec, device)
    return [buffer, semaphores] if buffer else []


def staging_bytes(
    it: ReduceIter, scalar: int, opmath: int, input_vec: int, device: CudaDevice
) -> tuple[int, int]:
    """setReduceConfig's global_memory_size() and semaphore_size() for a 32-bit iterator of
    `scalar`-byte inputs summed in `opmath`-byte accumulators (0, 0: no CTA split)."""
    num_outputs = it.num_outputs()
    inputs_per_output = it.numel() // num_outputs
    ndim, nreduce = len(it.shape), it.num_reduce_dims()
    if ndim:
        fastest = nreduce == ndim or it.inp[0] < it.inp[nreduce]
        dim0, dim1 = inputs_per_output, num_outputs
        if not fastest:
            dim0, dim1 = dim1, dim0
        moving = it.inp[0] if fastest else it.inp[nreduce]
    else:
        fastest, moving, dim0, dim1 = True, scalar, 1, 1
    output_vec = 1
    if moving == scalar:
        if fastest and dim0 >= 128 and nreduce == 1:
            dim0 //= input_vec  # vectorize along input
        elif not fastest:
            output_vec = _output_vec_size(it, scalar, nreduce)  # vectorize along output
            dim0 //= output_vec
    # set_block_dimension
    threads = MAX_NUM_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads else threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < threads else threads
    width = min(dim0_pow2, WARP_SIZE)
    height = min(dim1_pow2, threads // width)
    width = min(dim0_pow2, threads // height)
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or fastest
    if block_x_reduce:
        step_input *= width  # lanes split each output's inputs
    else:
        step_output *= width  # lanes take separate outputs
    if _div_up(inputs_per_output, step_input) < min(height * 16, MAX_VALUES_PER_THREAD):
        return 0, 0  # each warp takes its own outputs: no CTA split
    step_input *= height
    values_per_thread = _div_up(inputs_per_output, step_input)
    target_grid = device.sm_count * (device.max_threads_per_sm // (width * height))
    grid = _div_up(num_outputs // output_vec, step_output)
    if values_per_thread < MAX_VALUES_PER_THREAD or grid > target_grid:
        return 0, 0
    ctas = max(
        min(_div_up(target_grid, grid), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
        _div_up(values_per_thread, MAX_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return 0, 0
    size = opmath * num_outputs * ctas
    if not block_x_reduce:
        size *= width * output_vec  # one staging slot per lane and vector element
    return size, 4 * grid


def _output_vec_size(it: ReduceIter, scalar: int, output_index: int) -> int:
    """get_output_vec_size: 4, halved until it divides the input's address (in elements; the
    allocator's blocks are 512-byte aligned), the output dimension and the other strides."""
    vec = 4
    values = [it.offset // scalar, it.shape[output_index]]
    values += [s // scalar for d, s in enumerate(it.inp) if d != output_index]
    for n in values:
        while n % vec:
            vec //= 2
    return vec


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    return [size if d == dim else n for d, n in enumerate(shape)]


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


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


def sort_blocks(n: int) -> list[int]:
    """A one-segment radix sort of `n` int64 keys: the iota of indices it sorts with the keys,
    then cub's storage; none for a small sort."""
    return [] if n <= SMALL_SORT_KEYS else [n * 8, cub_sort_pairs_bytes(n)]


def embedding_backward_bytes(
    n: int, width: int, rows: int, index: int = 8, opmath: int = 4
) -> list[int]:
    """What CUDA's dense embedding backward of `n` ids (`index` bytes each) into a (rows, width)
    gradient holds beside it until it returns (EmbeddingBackwardKernel.cu, the order of an H100
    trace's blocks): sorted ids and their positions, segment offsets, the segment count,
    partials per segment and their offsets, the partial-segment count and offsets, and the
    partial sums (NROWS_PER_THREAD = 10 rows each) in `opmath` bytes."""
    if n <= EMBEDDING_DIRECT_IDS:
        return []
    segments = min(n, rows)
    partials = n // EMBEDDING_ROWS_PER_PARTIAL + segments
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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // CUB_ALIGNMENT) * CUB_ALIGNMENT
