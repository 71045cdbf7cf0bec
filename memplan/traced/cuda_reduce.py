"""The global-memory staging buffer and semaphores of PyTorch's CUDA reduction kernels
(ATen/native/cuda/Reduce.cuh, torch 2.11): where setReduceConfig splits each output's inputs
across several CTAs (ctas_per_output > 1), gpu_reduce_kernel allocates
ReduceConfig::global_memory_size() bytes of partial results, then semaphore_size() bytes of
per-output-block counters, through the caching allocator, and frees them when the kernel is
launched. A reduction's TensorIterator (reduced dimensions first, then coalesced) is rebuilt
from the meta tensors' shapes and strides, and ported with the configuration.

Hugging Face's RMSNorm weight gradient (and a Linear's bias gradient) sums all tokens per hidden
unit: 128 fp32 partials per output and CTA, e.g. tokens * hidden * 8 bytes at 8192 tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

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
        return _prod(self.shape)

    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.out if s == 0)

    def num_outputs(self) -> int:
        return _prod(n for n, s in zip(self.shape, self.out, strict=True) if s != 0 or n == 0)

    def can_use_32bit_indexing(self) -> bool:
        if self.numel() > INT32_MAX:
            return False
        return all(
            1 + sum((n - 1) * s for n, s in zip(self.shape, strides, strict=True)) <= INT32_MAX
            for strides in (self.out, self.inp)
        )


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
    sizes = (scalar.itemsize, opmath, vec, device)
    if it.can_use_32bit_indexing():
        return _blocks(it, *sizes)
    # Half and bfloat16 outputs accumulate in an opmath buffer of the output's span.
    held = []
    if dtype in (torch.float16, torch.bfloat16) and scalar == dtype:
        span = max([dtype.itemsize, *(n * s for n, s in zip(it.shape, it.out, strict=True))])
        held.append(span // dtype.itemsize * opmath)
    return [*held, *(blocks for sub in split_32bit(it) if (blocks := _blocks(sub, *sizes)))]


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
    it = ReduceIter(
        list(source.shape),
        [s * out.dtype.itemsize for s in out_strides],
        [s * scalar.itemsize for s in in_strides],
        offset,
    )
    _reorder(it)
    _coalesce(it)
    return it


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
    """with_32bit_indexing: halve the dimension of largest extent until each part fits, depth
    first, the first half first (TensorIteratorBase::split; reductions are not re-coalesced)."""
    parts, stack = [], [it]
    while stack:
        top = stack.pop()
        if top.can_use_32bit_indexing():
            parts.append(top)
            continue
        dim = max(
            (d for d in reversed(range(len(top.shape))) if top.shape[d]),
            key=lambda d: (top.shape[d] - 1) * max(abs(top.out[d]), abs(top.inp[d])),
        )
        first, rest = top.shape[dim] // 2, top.shape[dim] - top.shape[dim] // 2
        step = top.inp[dim] * first
        stack.append(ReduceIter(_with(top.shape, dim, rest), top.out, top.inp, top.offset + step))
        stack.append(ReduceIter(_with(top.shape, dim, first), top.out, top.inp, top.offset))
    return parts


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


def _dims(dims: object) -> list[int]:
    return [dims] if isinstance(dims, int) else list(dims)  # type: ignore[arg-type]


def _contiguous(shape: torch.Size) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    return [size if d == dim else n for d, n in enumerate(shape)]


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _prod(values) -> int:  # type: ignore[no-untyped-def]
    total = 1
    for v in values:
        total *= v
    return total
