"""Small helpers shared by the kernel files: launch parameters, row views and new outputs,
argument checks, and the first-order-only backward."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from memplan.errors import UsageError

# Largest row a one-program-per-row kernel holds in registers (elements); wider rows would spill.
MAX_FUSED_SIZE = 65536


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch arithmetic: triton.cdiv and triton.next_power_of_2 are
    ConstexprFunctions, slow to call from Python on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def num_warps_for(block: int) -> int:
    """Warps for a program that processes `block` elements of a row at once."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


# Elements one elementwise program handles (ROWS x BLOCK tile); see elementwise_launch_config.
ELEMENTWISE_TILE = 2048


def elementwise_launch_config(n_cols: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for elementwise kernels over (ROWS x BLOCK) tiles:
    wide rows are split into column blocks, narrow rows grouped so each program moves the same
    ELEMENTWISE_TILE elements per tensor."""
    block = min(next_power_of_2(n_cols), ELEMENTWISE_TILE)
    rows = ELEMENTWISE_TILE // block
    return rows, block, num_warps_for(rows * block)


def num_sms(device: torch.device | str | int | None = None, given: int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device, or `given` where the caller knows the GPU the
    tensors stand for (meta tensors have no device to ask); a small constant on CPU
    (interpreter) and meta."""
    if given is not None:
        return given
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or 0)
    if device.type == "cuda" and torch.cuda.is_available():
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def autocast_dtype(device_type: str, given: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype autocast casts this device type's ops to, None where it is off; `given` where
    the caller knows it (meta tensors have no autocast of their own: the traced step emulates
    CUDA's)."""
    if given is not None:
        return given
    if device_type == "meta":  # no autocast of its own (and dynamo cannot trace the query)
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for an autograd backward whose gradients come from kernels, outside autograd.
    Under create_graph=True they would enter the graph as constants, and a second derivative
    through them would silently lack this op's curvature (torch's once_differentiable only
    catches gradient outputs that require grad, not the saved inputs the gradients depend on):
    there they are tied to a node that raises when differentiated. Otherwise a plain call."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        error = torch._C._functions.DelayedError(
            b"memplan's fused kernels give first derivatives only: a double backward (a "
            b"gradient of a gradient) through them is not supported",
            len(outputs),
        )
        tied = error(*[_requiring_grad(t) for t in outputs])
        tied = tied if isinstance(tied, tuple) else (tied,)  # one output comes back bare
        return tied[0] if single else tied

    return wrapper


def _requiring_grad(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    t.requires_grad_(True)
    return t


def is_real_number(value: object) -> bool:
    """A real number (int, float, numpy scalar), not a bool, a string or a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_floating(op: str, *tensors: torch.Tensor) -> None:
    """UsageError unless every tensor is floating point (the kernels compute in fp32 and would
    return zeros for integers, where torch raises)."""
    for t in tensors:
        if not t.is_floating_point():
            raise UsageError(f"{op} needs floating-point tensors, got {t.dtype}.")


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the element spans of a and b in memory can intersect (crossing byte ranges): an
    in-place write into one must then not be read through the other."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.is_meta or b.is_meta:  # no addresses there (all 0): offsets into one storage
        return _storage_spans_overlap(a, b)
    # addresses, not storages: asking for a storage costs host time
    return _spans_overlap(a, b, a.data_ptr(), b.data_ptr())


def _storage_spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage() is not b.untyped_storage():
        return False
    return _spans_overlap(
        a, b, a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    )


def _spans_overlap(a: torch.Tensor, b: torch.Tensor, a_start: int, b_start: int) -> bool:
    """Whether a's elements from byte a_start and b's from b_start can intersect."""

    def span(t: torch.Tensor, start: int) -> tuple[int, int]:
        if t.is_contiguous():
            return start, start + t.numel() * t.element_size()
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return start, start + (extent + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a, a_start), span(b, b_start)
    return a0 < b1 and b0 < a1


def may_write_over(t: torch.Tensor) -> bool:
    """Whether an in-place kernel may overwrite t's elements: not a leaf that requires grad, nor
    a view of one (torch refuses its own in-place ops there; a parameter would silently take
    the values of its gradient)."""
    base = t if t._base is None else t._base
    return not (base.is_leaf and base.requires_grad)


_CURRENT_DEVICE_ONLY = contextlib.nullcontext()


@functools.cache
def _cuda_devices() -> int:
    return torch.cuda.device_count()


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make t's CUDA device current for a launch: Triton launches on the current device. With
    one visible GPU that is always t's, and asking costs host time on every launch."""
    if t.is_cuda and _cuda_devices() > 1 and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _CURRENT_DEVICE_ONLY


def norm_forward_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for the RMSNorm/LayerNorm forward, one tile of ROWS rows per
    program: ~4K elements per program (narrow rows grouped), warps from num_warps_for but 8 for
    8192-element tiles (the launch sweep `bench_kernels.py --tune`, docs/bench_kernels.md)."""
    block_n = next_power_of_2(n_cols)
    if block_n > MAX_FUSED_SIZE:
        raise UsageError(f"fused norms support rows of at most {MAX_FUSED_SIZE}, got {n_cols}.")
    rows = max(1, min(16, 4096 // block_n))
    tile = block_n * rows
    return block_n, rows, 8 if tile == 8192 else num_warps_for(tile)


class NormBackwardConfig(NamedTuple):
    """Launch parameters of the RMSNorm/LayerNorm backward kernels (norm_backward_config)."""

    block_n: int
    rows: int
    num_warps: int
    n_programs: int
    rows_per_program: int
    # The RMSNorm kernel reloads the weight each row (an L1/L2 hit) and reads dy and x with
    # evict_first, instead of holding the weight in registers beside dy, x and the dW partial.
    weight_from_cache: bool


# Rows of 4096 elements and wider (one row per loop step): (num_warps, weight_from_cache) by op
# and row block where the launch sweep (`bench_kernels.py --tune`) found them faster than
# num_warps_for(block) with the weight in registers; elsewhere the default.
WIDE_ROW_BACKWARD: dict[tuple[str, int], tuple[int, bool]] = {
    ("rms_norm", 16384): (8, True),
    ("layer_norm", 4096): (4, False),
    ("layer_norm", 8192): (8, False),
    ("layer_norm", 16384): (8, False),
}


def norm_backward_config(n_rows: int, n_cols: int, sms: int, op: str) -> NormBackwardConfig:
    """Launch parameters for the norm backward kernels of `op` ("rms_norm" or "layer_norm"),
    where each program walks a contiguous range of rows and keeps a (hidden,) fp32 partial of
    dW: tiles of ~4K elements, 2 programs per SM (of `sms`, num_sms) up to 4K-element tiles
    (pairs share a partial row: memplan.kernels._norm_weight_grad), 1 above, which keeps the
    partials at Liger-Kernel's size; wider rows per WIDE_ROW_BACKWARD."""
    block_n = next_power_of_2(n_cols)
    if block_n > MAX_FUSED_SIZE:
        raise UsageError(f"fused norms support rows of at most {MAX_FUSED_SIZE}, got {n_cols}.")
    rows = max(1, 4096 // block_n)
    tile = block_n * rows
    per_sm = 2 if tile <= 4096 else 1
    n_programs = min(cdiv(n_rows, rows), sms * per_sm)
    rows_per_program = cdiv(n_rows, n_programs)
    n_programs = cdiv(n_rows, rows_per_program)
    num_warps, weight_from_cache = WIDE_ROW_BACKWARD.get(
        (op, block_n), (num_warps_for(tile), False)
    )
    return NormBackwardConfig(
        block_n, rows, num_warps, n_programs, rows_per_program, weight_from_cache
    )


@triton.jit
def load_fp32(ptr, mask, EVICT_FIRST: tl.constexpr):
    """A tile in fp32 (0 where masked); EVICT_FIRST for data read once, so that it leaves the
    cache before what is reused."""
    if EVICT_FIRST:
        value = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        value = tl.load(ptr, mask=mask, other=0.0)
    return value.to(tl.float32)


@triton.jit
def rounded_to(value, DTYPE: tl.constexpr):
    """fp32 `value` rounded to DTYPE's precision (kept in fp32), to nearest even as torch's
    casts round. For bf16 by integer arithmetic, which Triton's CPU interpreter runs as the GPU
    does (its casts truncate); finite values only."""
    if DTYPE == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return value.to(DTYPE).to(tl.float32)


def empty_like_rows(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of t's shape and device, in `dtype` (t's by default): an output
    the kernels index with unit column stride and their own row stride. empty_like, because it
    costs less host time than torch.empty(shape, dtype=, device=) on every launch."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as (rows, last_dim) with unit column stride, for kernels that take a row stride.
    Copies only when no such view exists (a transposed last dim, non-collapsible leading dims).
    The row stride of the result may be anything, even 0 (an expanded tensor): read-only use."""
    dim = x.dim()
    if dim == 2 and x.stride(1) == 1:  # the fast path: this runs on every launch
        return x
    if dim == 0:
        return x.view(1, 1)
    # The row count is explicit: view(-1, 0) cannot infer it for a last dim of 0.
    n_rows, n_cols = math.prod(x.shape[:-1]), x.shape[-1]
    if x.stride(-1) == 1 or n_cols == 1:
        try:
            return x.view(n_rows, n_cols)
        except RuntimeError:
            pass
    return x.contiguous().view(n_rows, n_cols)
