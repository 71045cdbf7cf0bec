"""Cross entropy on given logits, with the logit gradient computed in the forward.

One program per row: a first pass over the vocabulary keeps an online max and sum of
exponentials in fp32 (and the sum of logits for label smoothing), a second pass writes the
gradient, either into a new buffer or over the logits themselves (`inplace_grad`). Backward only
scales the saved gradient by grad_output (in place, skipped on device when it is 1).

Per row, with x the (optionally softcapped) logits, p = softmax(x), t the target, V the vocab,
eps the label smoothing and z the z-loss scale, lse = log(sum_j exp(x_j)):
    loss = lse - (1 - eps) * x_t - eps * mean_j(x_j) + z * lse^2
    dloss/dx_j = (1 + 2 z lse) p_j - eps / V - (1 - eps) [j == t]
Softcapping (Gemma 2) is x = c * tanh(r / c) of the raw logits r, so dx/dr = 1 - (x / c)^2.
Rows whose target is ignore_index have loss 0 and gradient 0. 'mean' divides by the number of
non-ignored rows (at least 1, so an all-ignored batch gives 0, not nan) or by num_items_in_batch
when given (gradient accumulation, as Hugging Face's ForCausalLMLoss). The loss is fp32."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn

from memplan.errors import UsageError
from memplan.kernels._launch import fast_launch
from memplan.kernels._op import Op, launcher
from memplan.kernels._utils import (
    cdiv,
    first_order_only,
    is_real_number,
    may_write_over,
    next_power_of_2,
    num_sms,
)

REDUCTIONS = ("mean", "sum", "none")
# Softcaps the fp32 kernels compute right: beyond, the cap or logits / cap leave fp32's normal
# range and flush to zero on the GPU (every logit capped to 0, or a 0/0 gradient).
SOFTCAP_MIN, SOFTCAP_MAX = 1e-30, 1e30


def reference_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | Tensor | None = None,
    return_z_loss: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Plain PyTorch in fp32: F.cross_entropy semantics plus softcap, z-loss, num_items."""
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = target != ignore_index
    rows = F.cross_entropy(
        x, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    z_rows = z_loss_scale * torch.logsumexp(x, dim=-1).square() * valid
    rows = rows + z_rows
    if reduction == "none":
        loss, z_loss = rows, z_rows
    else:
        loss, z_loss = rows.sum(), z_rows.sum()
        if reduction == "mean":
            divisor = valid.sum().clamp_min(1) if num_items_in_batch is None else num_items_in_batch
            loss, z_loss = loss / divisor, z_loss / divisor
    return (loss, z_loss) if return_z_loss else loss


# --- Triton kernels -------------------------------------------------------------------------


@triton.jit
def _tanh(x, SERIES: tl.constexpr):
    # From exp(-2|x|) in (0, 1]: no overflow at any |x|, exact sign. Near 0, 1 - exp(-2|x|)
    # cancels (relative error ~6e-8 / |x|, so the capped logit is off by ~6e-8 x cap). With
    # SERIES, below |x| = 0.2 the odd Taylor series to x^9 instead (truncation below 1e-9
    # relative there).
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    if SERIES:
        a2 = a * a
        series = a * (
            1.0
            + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0))))
        )
        t = tl.where(a < 0.2, series, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_logits(row_ptr, cols, mask, softcap, HAS_SOFTCAP: tl.constexpr, L2_POLICY: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf"), eviction_policy=L2_POLICY)
    x = x.to(tl.float32)
    if HAS_SOFTCAP:
        x = tl.where(mask, softcap * _tanh(x / softcap, HAS_SOFTCAP == 2), float("-inf"))
    return x


@triton.jit
def _logit_grad(x, cols, target, lse, p_coef, uniform, target_coef, softcap, HAS_SOFTCAP):
    g = p_coef * tl.exp(x - lse) - uniform
    g = tl.where(cols == target, g - target_coef, g)
    if HAS_SOFTCAP:
        t = tl.maximum(x / softcap, -1.0)  # masked lanes hold -inf
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _zero_row(row_ptr, n_cols, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=row_ptr.dtype.element_ty)
    for off in range(0, n_cols, BLOCK):
        tl.store(row_ptr + off + cols, zeros, mask=off + cols < n_cols)


@fast_launch
@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    target_ptr,
    loss_ptr,
    z_loss_ptr,
    lse_ptr,
    scale_ptr,
    n_cols,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    STORE_LSE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    FIRST_READ: tl.constexpr,  # L2 eviction policy of the first pass over a streamed row
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    grad_row = grad_ptr + row * grad_stride
    target = tl.load(target_ptr + row)
    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if HAS_Z_LOSS:
            tl.store(z_loss_ptr + row, 0.0)
        if STORE_LSE:
            tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            _zero_row(grad_row, n_cols, BLOCK)
        return
    # Every thread reads the target logit, but only one writes its gradient, possibly over it
    # (in place): read it first, and keep a barrier between the reads and the gradient's stores.
    # A target outside [0, n_cols) reads nothing; its row's lse, and so its loss and gradient,
    # become NaN below (torch raises there; a host check would cost a sync per call).
    in_range = (target >= 0) & (target < n_cols)
    x_t = tl.load(logits_row + target, mask=in_range, other=0.0).to(tl.float32)

    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        # The whole row stays in registers: one read, one write.
        mask = cols < n_cols
        x = _load_logits(logits_row, cols, mask, softcap, HAS_SOFTCAP, "")
        m = tl.max(x, 0)
        d = tl.sum(tl.exp(x - m), 0)
        if HAS_SMOOTHING:
            sum_x = tl.sum(tl.where(mask, x, 0.0), 0)
    else:
        m = float("-inf")
        d = 0.0
        sum_x = 0.0
        for off in range(0, n_cols, BLOCK):
            mask = off + cols < n_cols
            xb = _load_logits(logits_row, off + cols, mask, softcap, HAS_SOFTCAP, FIRST_READ)
            m_new = tl.maximum(m, tl.max(xb, 0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(xb - m_new), 0)
            m = m_new
            if HAS_SMOOTHING:
                sum_x += tl.sum(tl.where(mask, xb, 0.0), 0)
    lse = tl.where(in_range, m + tl.log(d), float("nan"))

    if HAS_SOFTCAP:
        x_t = softcap * _tanh(x_t / softcap, HAS_SOFTCAP == 2)
    if HAS_SMOOTHING:
        loss = lse - (1.0 - label_smoothing) * x_t - label_smoothing * sum_x / n_cols
    else:
        loss = lse - x_t
    if HAS_Z_LOSS:
        z = z_loss_scale * lse * lse
        loss += z
        tl.store(z_loss_ptr + row, z)
    tl.store(loss_ptr + row, loss)
    if STORE_LSE:
        tl.store(lse_ptr + row, lse)

    if COMPUTE_GRAD:
        tl.debug_barrier()
        if ROW_SCALE:
            scale = tl.load(scale_ptr + row)
        else:
            scale = tl.load(scale_ptr)
        p_coef = scale
        if HAS_Z_LOSS:
            p_coef = scale * (1.0 + 2.0 * z_loss_scale * lse)
        uniform = 0.0
        if HAS_SMOOTHING:
            uniform = scale * label_smoothing / n_cols
        target_coef = scale * (1.0 - label_smoothing)
        if SINGLE_BLOCK:
            g = _logit_grad(
                x, cols, target, lse, p_coef, uniform, target_coef, softcap, HAS_SOFTCAP
            )
            tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)
        else:
            # Last block first: the blocks read most recently are the likeliest still in L2.
            # They are read for the last time here, and the gradient is not read again soon.
            n_blocks = tl.cdiv(n_cols, BLOCK)
            for i in range(0, n_blocks):
                off = (n_blocks - 1 - i) * BLOCK
                mask = off + cols < n_cols
                xb = _load_logits(logits_row, off + cols, mask, softcap, HAS_SOFTCAP, "evict_first")
                g = _logit_grad(
                    xb, off + cols, target, lse, p_coef, uniform, target_coef, softcap, HAS_SOFTCAP
                )
                g = g.to(grad_ptr.dtype.element_ty)
                tl.store(grad_row + off + cols, g, mask=mask, eviction_policy="evict_first")


@fast_launch
@triton.jit
def _cross_entropy_grad_from_lse_kernel(
    logits_ptr,
    logits_stride,
    target_ptr,
    lse_ptr,
    scale_ptr,
    vocab_start,
    n_cols,
    vocab_size,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss_scale,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The gradient over the vocabulary columns [vocab_start, vocab_start + n_cols), written over
    those logits, from a log-sum-exp computed earlier over the whole vocabulary."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    target = tl.load(target_ptr + row)
    if target == ignore_index:
        _zero_row(logits_row, n_cols, BLOCK)
        return
    lse = tl.load(lse_ptr + row)
    if ROW_SCALE:
        scale = tl.load(scale_ptr + row)
    else:
        scale = tl.load(scale_ptr)
    p_coef = scale
    if HAS_Z_LOSS:
        p_coef = scale * (1.0 + 2.0 * z_loss_scale * lse)
    uniform = 0.0
    if HAS_SMOOTHING:
        uniform = scale * label_smoothing / vocab_size
    target_coef = scale * (1.0 - label_smoothing)
    local_target = target - vocab_start
    cols = tl.arange(0, BLOCK)
    for off in range(0, n_cols, BLOCK):
        mask = off + cols < n_cols
        x = _load_logits(logits_row, off + cols, mask, softcap, HAS_SOFTCAP, "")
        g = _logit_grad(
            x, off + cols, local_target, lse, p_coef, uniform, target_coef, softcap, HAS_SOFTCAP
        )
        tl.store(logits_row + off + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _scale_rows_kernel(x_ptr, row_stride, n_cols, scale_ptr, BLOCK: tl.constexpr):
    """x[row] *= scale[row] (a per-row grad_output; rows scaled by 1 are left as they are)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(scale_ptr + row)
    if s != 1.0:
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        ptr = x_ptr + row * row_stride + cols
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (x * s).to(x_ptr.dtype.element_ty), mask=mask)


# --- options --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class LossOptions:
    """The options of memplan's losses (cross_entropy, fused_linear_cross_entropy and their
    modules), checked once when made (UsageError) and held as Python numbers (numpy scalars are
    accepted).

    ignore_index: rows whose target is this have loss 0 and gradient 0.
    label_smoothing: eps in [0, 1].
    softcap: None (no cap), or c for logits c * tanh(x / c) (Gemma 2's final softcap).
    z_loss_scale: z >= 0, z * lse^2 added to each row's loss.
    reduction: 'mean', 'sum' or 'none'.
    num_items_in_batch: what 'mean' divides by (a number or a one-element tensor, as in Hugging
        Face's gradient accumulation); None: the number of non-ignored rows."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    softcap: float | None = None
    z_loss_scale: float = 0.0
    reduction: str = "mean"
    num_items_in_batch: int | float | Tensor | None = None

    def __post_init__(self) -> None:
        reduction, smoothing, softcap = self.reduction, self.label_smoothing, self.softcap
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise UsageError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not is_real_number(smoothing) or not 0.0 <= smoothing <= 1.0:
            raise UsageError(f"label_smoothing must be a number in [0, 1], got {smoothing!r}")
        # A cap of inf would compute inf * tanh(x / inf) = inf * 0 = nan: no cap is None.
        valid_cap = is_real_number(softcap) and SOFTCAP_MIN <= softcap <= SOFTCAP_MAX
        if softcap is not None and not valid_cap:
            raise UsageError(
                f"softcap must be None (no cap) or a finite positive number in "
                f"[{SOFTCAP_MIN:g}, {SOFTCAP_MAX:g}], got {softcap!r}"
            )
        z_loss_scale = self.z_loss_scale
        if not is_real_number(z_loss_scale) or not 0.0 <= z_loss_scale < math.inf:
            raise UsageError(f"z_loss_scale must be a finite number >= 0, got {z_loss_scale!r}")
        self._check_num_items()
        ignore_index = self.ignore_index
        # bool is an int subclass: True would silently ignore class 1.
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise UsageError(f"ignore_index must be an integer, got {ignore_index!r}")
        if not -(2**63) <= ignore_index < 2**63:
            raise UsageError(f"ignore_index must fit in int64, got {ignore_index}")
        set_ = functools.partial(object.__setattr__, self)
        set_("ignore_index", int(ignore_index))
        set_("label_smoothing", float(smoothing))
        set_("softcap", None if softcap is None else float(softcap))
        set_("z_loss_scale", float(z_loss_scale))

    def _check_num_items(self) -> None:
        count = self.num_items_in_batch
        if count is None:
            return
        if self.reduction != "mean":
            raise UsageError("num_items_in_batch applies to reduction='mean' only")
        if not isinstance(count, Tensor) and not (is_real_number(count) and 0.0 < count < math.inf):
            raise UsageError(f"num_items_in_batch must be a finite positive number, got {count!r}")
        if isinstance(count, Tensor) and (count.numel() != 1 or count.dtype == torch.bool):
            # (its value is not checked: that would cost a host sync per call)
            raise UsageError(
                "num_items_in_batch must be a number or a one-element numeric tensor, got a "
                f"{count.dtype} tensor of shape {tuple(count.shape)}"
            )

    def with_items(self, num_items_in_batch: int | float | Tensor | None) -> LossOptions:
        """These options with another num_items_in_batch (a module's per-call argument)."""
        if num_items_in_batch is None and self.num_items_in_batch is None:
            return self
        return dataclasses.replace(self, num_items_in_batch=num_items_in_batch)

    def op_args(self) -> tuple[int, float, float, float, str]:
        """What the custom ops take for these options (a softcap of 0.0 is none)."""
        return (
            self.ignore_index,
            self.label_smoothing,
            self.softcap or 0.0,
            self.z_loss_scale,
            self.reduction,
        )

    @classmethod
    def from_op_args(
        cls, ignore_index: int, label_smoothing: float, softcap: float, z_loss_scale: float,
        reduction: str,
    ) -> LossOptions:  # fmt: skip
        return cls(ignore_index, label_smoothing, softcap or None, z_loss_scale, reduction)

    def divisor(self, device: torch.device) -> Tensor | None:
        """num_items_in_batch as a 0-d fp32 tensor on the device (a tensor stays on the device),
        or None."""
        count = self.num_items_in_batch
        if count is None:
            return None
        if isinstance(count, Tensor):
            return count.detach().to(device=device, dtype=torch.float32).reshape(())
        return torch.tensor(float(count), dtype=torch.float32, device=device)


# Caps from here on take tanh's series near 0, where 1 - exp(-2|x|) loses the capped logit's
# precision; below, the series would cost the common caps (Gemma 2's 30) time for nothing.
SERIES_TANH_FROM = 1e3


def softcap_mode(softcap: float) -> int:
    """The kernels' HAS_SOFTCAP: 0 no cap (softcap 0.0), 1 a cap, 2 a cap large enough for
    tanh's series near 0."""
    if softcap <= 0.0:
        return 0
    return 2 if softcap >= SERIES_TANH_FROM else 1


# --- launchers ------------------------------------------------------------------------------

# Rows up to SINGLE_BLOCK_MAX elements are held in registers (one read); longer rows are
# streamed in blocks of LOOP_BLOCK, twice with the gradient (online max/sum, then the gradient),
# once without it (launch-configuration sweep in docs/bench_loss.md).
SINGLE_BLOCK_MAX = 8192
LOOP_BLOCK = 4096
# The two-pass FLCE's gradient-from-lse kernel (one read per slice of a row).
SLICE_BLOCK = 8192


def _row_launch_config(n_cols: int, *, with_grad: bool) -> tuple[int, bool, int]:
    """(BLOCK, SINGLE_BLOCK, num_warps) for the one-program-per-row kernels."""
    block = next_power_of_2(max(n_cols, 1))
    if block <= SINGLE_BLOCK_MAX:
        return block, True, 4 if block <= 1024 else 8
    return LOOP_BLOCK, False, 8 if with_grad else 4


def launch_cross_entropy_forward(
    logits: Tensor,
    grad: Tensor | None,
    target: Tensor,
    loss_rows: Tensor,
    z_rows: Tensor | None,
    lse_rows: Tensor | None,
    scale: Tensor,
    options: LossOptions,
    *,
    row_scale: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Loss (and z-loss, lse) per row into fp32 buffers; the gradient, scaled by `scale` (one
    value, or one per row when row_scale), into `grad` (which may be `logits` itself) unless
    grad is None. logits: (rows, V) with unit column stride. The reduction is the caller's."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    cfg_block, single, cfg_warps = _row_launch_config(n_cols, with_grad=grad is not None)
    if block is not None:
        single = block >= n_cols
    block = block or cfg_block
    num_warps = num_warps or cfg_warps
    softcap = options.softcap or 0.0
    _cross_entropy_fwd_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad if grad is not None else logits,
        grad.stride(0) if grad is not None else 0,
        target,
        loss_rows,
        z_rows if z_rows is not None else loss_rows,
        lse_rows if lse_rows is not None else loss_rows,
        scale,
        n_cols,
        options.ignore_index,
        options.label_smoothing,
        softcap,
        options.z_loss_scale,
        HAS_SOFTCAP=softcap_mode(softcap),
        HAS_SMOOTHING=options.label_smoothing > 0.0,
        HAS_Z_LOSS=z_rows is not None,
        COMPUTE_GRAD=grad is not None,
        STORE_LSE=lse_rows is not None,
        ROW_SCALE=row_scale,
        BLOCK=block,
        SINGLE_BLOCK=single,
        # evict_last on a streamed row's first read keeps it for the second (the gradient)
        FIRST_READ="evict_last" if grad is not None and not single else "",
        num_warps=num_warps,
    )


def launch_cross_entropy_grad_from_lse(
    logits: Tensor,
    target: Tensor,
    lse_rows: Tensor,
    scale: Tensor,
    options: LossOptions,
    *,
    vocab_start: int,
    vocab_size: int,
    row_scale: bool = False,
) -> None:
    """Overwrite a vocabulary slice of logits (rows, n_cols) with its gradient, given lse."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = min(next_power_of_2(max(n_cols, 1)), SLICE_BLOCK)
    num_warps = 8 if block >= 2048 else 4
    softcap = options.softcap or 0.0
    _cross_entropy_grad_from_lse_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        lse_rows,
        scale,
        vocab_start,
        n_cols,
        vocab_size,
        options.ignore_index,
        options.label_smoothing,
        softcap,
        options.z_loss_scale,
        HAS_SOFTCAP=softcap_mode(softcap),
        HAS_SMOOTHING=options.label_smoothing > 0.0,
        HAS_Z_LOSS=options.z_loss_scale > 0.0,
        ROW_SCALE=row_scale,
        BLOCK=block,
        num_warps=num_warps,
    )


@fast_launch
@triton.jit
def _scale_all_kernel(x_ptr, row_stride, n_cols, n_tiles, scale_ptr, BLOCK: tl.constexpr):
    """x *= one scale, a bounded grid striding over (row, column block) tiles. grad_output is 1
    for a loss that is backpropagated directly: then nothing to do, and no host sync to know it."""
    s = tl.load(scale_ptr)
    if s != 1.0:
        col_blocks = tl.cdiv(n_cols, BLOCK)
        for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            row = (tile // col_blocks).to(tl.int64)
            cols = (tile % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            ptr = x_ptr + row * row_stride + cols
            x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptr, (x * s).to(x_ptr.dtype.element_ty), mask=mask)


# Programs per SM of the one-scale kernel: when the scale is 1 each program only reads it, so a
# bounded grid costs a few us where one program per row of dW would not.
SCALE_PROGRAMS_PER_SM = 4


def launch_scale_rows_(x: Tensor, scale: Tensor) -> None:
    """x *= scale in place, scale one fp32 value (skipped on device when 1) or one per row of x
    (x 1-D counts as one row). x must have a unit column stride."""
    if x.numel() == 0:
        return
    rows = x.view(1, -1) if x.dim() == 1 else x
    n_rows, n_cols = rows.shape
    block = min(next_power_of_2(n_cols), 4096)
    if scale.numel() == 1:
        n_tiles = n_rows * cdiv(n_cols, block)
        grid = (min(n_tiles, SCALE_PROGRAMS_PER_SM * num_sms(x.device)),)
        _scale_all_kernel[grid](rows, rows.stride(0), n_cols, n_tiles, scale, BLOCK=block)
        return
    grid = (n_rows, cdiv(n_cols, block))
    _scale_rows_kernel[grid](rows, rows.stride(0), n_cols, scale, BLOCK=block, num_warps=8)


@launcher("scale_", fake=lambda x, scale: None, mutates_args=("x",))
def scale_(x: Tensor, scale: Tensor) -> None:
    """x *= scale in place; scale is a 0-d/1-element tensor or one value per row of x."""
    launch_scale_rows_(x, scale.detach().to(torch.float32).contiguous().reshape(-1))


def grad_scale(target: Tensor, divisor: Tensor | None, options: LossOptions) -> Tensor:
    """One fp32 value that the per-row gradients are multiplied by: 1 / (number of non-ignored
    rows, at least 1) or 1 / divisor for 'mean', 1 otherwise. Stays on the device (no sync)."""
    if options.reduction != "mean":
        return torch.ones(1, dtype=torch.float32, device=target.device)
    if divisor is None:
        divisor = (target != options.ignore_index).sum().clamp_min(1)
    return divisor.to(torch.float32).reciprocal().reshape(1)


def reduce_rows(rows: Tensor, scale: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total * scale[0] if reduction == "mean" else total


def _losses(
    logits: Tensor,
    grad: Tensor | None,
    target: Tensor,
    divisor: Tensor | None,
    options: LossOptions,
) -> tuple[Tensor, Tensor]:
    """(loss, z_loss) reduced; the scaled gradient into `grad` unless it is None."""
    n_rows = logits.shape[0]
    scale = grad_scale(target, divisor, options)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    z_rows = torch.zeros_like(loss_rows) if options.z_loss_scale > 0.0 else None
    launch_cross_entropy_forward(logits, grad, target, loss_rows, z_rows, None, scale, options)
    if z_rows is None:
        z_rows = torch.zeros_like(loss_rows)
    reduction = options.reduction
    return reduce_rows(loss_rows, scale, reduction), reduce_rows(z_rows, scale, reduction)


# --- op declarations (memplan.kernels._op) --------------------------------------------------


def _forward(
    logits: Tensor,
    target: Tensor,
    divisor: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_loss_scale: float,
    reduction: str,
    compute_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, z_loss, gradient of the unscaled loss w.r.t. logits; empty unless compute_grad)."""
    options = LossOptions.from_op_args(
        ignore_index, label_smoothing, softcap, z_loss_scale, reduction
    )
    if compute_grad:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    else:
        grad = logits.new_empty(0)
    loss, z_loss = _losses(logits, grad if compute_grad else None, target, divisor, options)
    return loss, z_loss, grad


def _loss_fake(logits: Tensor, reduction: str) -> Tensor:
    shape = (logits.shape[0],) if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)


def _forward_fake(logits, target, divisor, *options_and_compute_grad):
    *_, reduction, compute_grad = options_and_compute_grad
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return _loss_fake(logits, reduction), _loss_fake(logits, reduction), grad


def _setup_context(ctx, inputs, output):
    """Saves the gradient computed in the forward, nothing else."""
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    # Otherwise autograd hands backward a (rows x vocab) tensor of zeros for the gradient output.
    ctx.set_materialize_grads(False)


@first_order_only
def _backward(ctx, grad_loss, grad_z_loss, grad_grad):
    (grad,) = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 9
    # The gradient is scaled where it lies: no second buffer. A second backward through the
    # same graph (retain_graph) is refused by autograd's saved-tensor version check.
    scale_(grad, grad_loss)
    return grad, None, None, None, None, None, None, None, None


def _forward_in_place(
    logits: Tensor,
    target: Tensor,
    divisor: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_loss_scale: float,
    reduction: str,
) -> tuple[Tensor, Tensor]:
    """(loss, z_loss); the gradient overwrites logits."""
    options = LossOptions.from_op_args(
        ignore_index, label_smoothing, softcap, z_loss_scale, reduction
    )
    return _losses(logits, logits, target, divisor, options)


def _forward_in_place_fake(logits, target, divisor, *options):
    return _loss_fake(logits, options[-1]), _loss_fake(logits, options[-1])


def _setup_context_in_place(ctx, inputs, output):
    """Saves the logits, which hold the gradient now: the graph keeps no new tensor."""
    ctx.save_for_backward(inputs[0])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


@first_order_only
def _backward_in_place(ctx, grad_loss, grad_z_loss):
    (grad,) = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 8
    scale_(grad, grad_loss)
    return grad, None, None, None, None, None, None, None


# outputs (loss, z_loss, logits' gradient)
CROSS_ENTROPY = Op(
    "cross_entropy",
    _forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)
# outputs (loss, z_loss), the gradient written over the logits
CROSS_ENTROPY_IN_PLACE = Op(
    "cross_entropy_",
    _forward_in_place,
    fake=_forward_in_place_fake,
    setup_context=_setup_context_in_place,
    backward=_backward_in_place,
    mutates_args=("logits",),
)


# --- API ------------------------------------------------------------------------------------


def check_target(op: str, target: Tensor) -> None:
    """UsageError unless target holds integer class indices: a bool or floating-point target
    would be cast to class 0/1 or truncated (torch's cross entropy refuses both)."""
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise UsageError(f"{op} expects integer class targets, got {target.dtype}")


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | Tensor | None = None,
    inplace_grad: bool = False,
    return_z_loss: bool = False,
    options: LossOptions | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross entropy of logits (N, V) against int targets (N,), fp32 loss.

    The loss options (LossOptions) come as keywords, or as `options` (which then replaces them).
    The gradient is computed in the forward: into a new buffer of the logits' dtype, or, with
    inplace_grad=True, over the logits themselves (the caller promises not to read the logits
    again; autograd then saves nothing new; logits whose rows share elements, or a leaf that
    requires grad, get a new buffer instead). z-loss (z_loss_scale * lse^2 per token) is part of
    the loss; return_z_loss also returns it alone, detached, for logging."""
    if options is None:
        options = LossOptions(
            ignore_index, label_smoothing, softcap, z_loss_scale, reduction, num_items_in_batch
        )
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise UsageError(
            f"cross_entropy expects logits (N, V) and target (N,), got {tuple(logits.shape)} "
            f"and {tuple(target.shape)}"
        )
    if not logits.is_floating_point():
        raise UsageError(f"cross_entropy expects floating-point logits, got {logits.dtype}")
    check_target("cross_entropy", target)
    if logits.shape[1] == 0:
        raise UsageError("cross_entropy needs logits over at least one class, got V = 0")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    target = target.to(torch.int64).contiguous()
    inputs = (logits, target, options.divisor(logits.device), *options.op_args())
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    # Rows that share elements (an expanded (1, V) row, stride 0) cannot each hold their own
    # gradient: one row's gradient would overwrite logits another row still reads.
    rows_overlap = logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]
    if inplace_grad and need_grad and not rows_overlap and may_write_over(logits):
        loss, z_loss = CROSS_ENTROPY_IN_PLACE(*inputs)
    else:
        loss, z_loss, _ = CROSS_ENTROPY(*inputs, need_grad)
    return (loss, z_loss) if return_z_loss else loss


class CrossEntropyLoss(nn.Module):
    """nn.Module form of `cross_entropy`; forward(logits, target, num_items_in_batch=None). The
    options are checked when the module is made and kept in `.options`."""

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        z_loss_scale: float = 0.0,
        reduction: str = "mean",
        inplace_grad: bool = False,
        return_z_loss: bool = False,
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, softcap, z_loss_scale, reduction)
        self.inplace_grad = inplace_grad
        self.return_z_loss = return_z_loss

    def forward(
        self, logits: Tensor, target: Tensor, num_items_in_batch: int | Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        return cross_entropy(
            logits,
            target,
            options=self.options.with_items(num_items_in_batch),
            inplace_grad=self.inplace_grad,
            return_z_loss=self.return_z_loss,
        )

    def extra_repr(self) -> str:
        return f"reduction={self.options.reduction!r}, inplace_grad={self.inplace_grad}"
