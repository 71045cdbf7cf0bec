"""LayerNorm: y = (x - mean) * rstd * weight + bias over the last dim, fp32 math inside, output in
the input dtype (as torch's layer_norm does for bf16/fp16 inputs). weight and bias may each be
None, as in F.layer_norm (a scale of 1, a shift of 0: nn.LayerNorm(elementwise_affine=False)).

Forward saves x and the fp32 mean and inverse std per row. Backward (xhat = (x - mean) * rstd,
m = dy * w, or dy without a weight):
    dx = rstd * (m - mean(m) - xhat * mean(m * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy
dw and db are reduced in two stages: fp32 partials per program (a contiguous range of rows,
accumulated in registers), then one torch sum over the partials."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memplan.errors import UsageError
from memplan.kernels._launch import fast_launch
from memplan.kernels._norm_weight_grad import (
    new_partials,
    partial_layout,
    store_partial,
    sum_partials,
)
from memplan.kernels._op import Op, launcher
from memplan.kernels._utils import (
    as_rows,
    cdiv,
    check_floating,
    empty_like_rows,
    first_order_only,
    is_real_number,
    norm_backward_config,
    norm_forward_config,
    num_sms,
    on_device,
)


def reference_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Plain PyTorch: fp32 layer norm, cast back to the input dtype."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


# --- Triton kernels -------------------------------------------------------------------------


@fast_launch
@triton.jit
def _layer_norm_forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    # Two-pass variance over the row held in registers; masked lanes must not contribute.
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * y_row_stride + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


@fast_launch
@triton.jit
def _layer_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols

    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)

    for start in range(row_start, row_end, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            m = dy * w[None, :]
        else:
            m = dy
        mean_m = tl.sum(m, axis=1) / n_cols
        mean_mx = tl.sum(m * xhat, axis=1) / n_cols
        dx = (m - mean_m[:, None] - xhat * mean_mx[:, None]) * rstd[:, None]
        tl.store(
            dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy

    if COMPUTE_DW:
        store_partial(dw_partial_ptr, pid, n_cols, cols, tl.sum(dw_acc, axis=0), col_mask, PAIRED)
    if COMPUTE_DB:
        store_partial(db_partial_ptr, pid, n_cols, cols, tl.sum(db_acc, axis=0), col_mask, PAIRED)


# --- launchers ------------------------------------------------------------------------------


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y like x, mean and rstd fp32 of shape x.shape[:-1]."""
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    y = empty_like_rows(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if y.numel() == 0:  # no rows, or rows of 0 elements (as torch's layer_norm: empty output)
        return y, mean, rstd
    block_n, rows, num_warps = norm_forward_config(n_cols)
    with on_device(x):
        _layer_norm_forward_kernel[(cdiv(n_rows, rows),)](
            x2,
            weight if weight is not None else x2,  # x2: never read
            bias if bias is not None else x2,
            y,
            mean,
            rstd,
            x2.stride(0),
            n_cols,
            n_rows,
            n_cols,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            ROWS=rows,
            num_warps=num_warps,
        )
    return y, mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dw: bool,
    compute_db: bool,
    sums_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, sums): sums stacks the asked-for dW and dB, in that order, as rows of one
    (compute_dw + compute_db, hidden) tensor in sums_dtype (default: the weight's dtype; the
    bias's when there is no weight)."""
    if compute_dw and weight is None:
        raise ValueError("compute_dw needs a weight")
    if sums_dtype is None:
        sums_dtype = weight.dtype if weight is not None else x.dtype
    x2 = as_rows(x)
    dy2 = as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = empty_like_rows(x)
    n_partials = int(compute_dw) + int(compute_db)
    if dx.numel() == 0:  # no rows, or rows of 0 elements
        return dx, x.new_zeros((n_partials, n_cols), dtype=sums_dtype)
    sms = num_sms(x.device)
    config = norm_backward_config(n_rows, n_cols, sms, "layer_norm")
    n_programs = config.n_programs

    # dW and dB partials in one buffer, so that one launch sums both
    partials = new_partials(n_partials, n_programs, n_cols, x.device, sms)
    dw_partial = partials[0] if compute_dw else dx  # dx: never written
    db_partial = partials[-1] if compute_db else dx
    with on_device(x):
        _layer_norm_backward_kernel[(n_programs,)](
            dy2,
            x2,
            weight if weight is not None else x2,  # x2: never read
            mean,
            rstd,
            dx,
            dw_partial,
            db_partial,
            dy2.stride(0),
            x2.stride(0),
            n_cols,
            n_rows,
            n_cols,
            config.rows_per_program,
            HAS_WEIGHT=weight is not None,
            COMPUTE_DW=compute_dw,
            COMPUTE_DB=compute_db,
            PAIRED=partial_layout(n_programs, sms)[1],
            BLOCK_N=config.block_n,
            ROWS=config.rows,
            num_warps=config.num_warps,
        )
    return dx, sum_partials(partials, sums_dtype)


# --- op declarations (memplan.kernels._op) --------------------------------------------------


def _forward_fake(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)


def _backward_fake(dy, x, weight, mean, rstd, compute_dw, compute_db, sums_dtype):
    sums = x.new_empty((int(compute_dw) + int(compute_db), x.shape[-1]), dtype=sums_dtype)
    return x.new_empty(x.shape), sums


_backward_launch = launcher("layer_norm_backward", fake=_backward_fake)(layer_norm_backward)


def _setup_context(ctx, inputs, output):
    """Saves x, the weight and the per-row mean and rstd."""
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # else autograd makes zeros for mean's and rstd's gradients
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    # dW and dB come back in the weight's dtype; dB without a weight in the bias's
    ctx.sums_dtype = (weight if weight is not None else bias if bias is not None else x).dtype


@first_order_only
def _backward(ctx, dy, *_unused):
    """Gradients of (x, weight, bias, eps)."""
    x, weight, mean, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = ctx.has_bias and ctx.needs_input_grad[2]
    dx, sums = _backward_launch(dy, x, weight, mean, rstd, compute_dw, compute_db, ctx.sums_dtype)
    return dx, sums[0] if compute_dw else None, sums[-1] if compute_db else None, None


# outputs (y, mean, rstd)
LAYER_NORM = Op(
    "layer_norm",
    layer_norm_forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# --- public API -----------------------------------------------------------------------------


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Fused LayerNorm over the last dim of x (any leading shape); weight and bias may be None
    (F.layer_norm's scale of 1 and shift of 0)."""
    if x.dim() == 0:
        raise UsageError("layer_norm normalizes the last dim of x, which has none (a 0-d tensor).")
    params = [p for p in (weight, bias) if p is not None]
    if any(p.shape != (x.shape[-1],) for p in params):
        shapes = ", ".join(str(tuple(p.shape)) for p in params)
        raise UsageError(
            f"LayerNorm weight/bias of shape {shapes} do not match hidden size {x.shape[-1]}."
        )
    check_floating("layer_norm", x, *params)
    if not is_real_number(eps) or not 0.0 <= eps < math.inf:
        raise UsageError(f"layer_norm eps must be a finite number >= 0, got {eps!r}")
    # The kernels read weight and bias with unit stride; autograd sends their gradients back
    # through the copies.
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return LAYER_NORM(x, weight, bias, float(eps))[0]


class LayerNorm(torch.nn.Module):
    """Drop-in for torch.nn.LayerNorm over the last dim."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        elementwise_affine: bool = True,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size)) if elementwise_affine and bias else None
        )
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"({self.hidden_size},), eps={self.eps}, "
            f"elementwise_affine={self.weight is not None}, bias={self.bias is not None}"
        )
