"""Gated RMSNorm: y = (w * norm(x)) * silu(gate), the norm before the output projection of the
gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: `Qwen3_5RMSNormGated` and kin).

Casting as the Hugging Face module does it: x normalized in fp32 and cast to its dtype, times
the weight in their promoted dtype (bf16 for a bf16 model, fp32 under autocast's fp32 weight),
times silu of the gate in fp32, cast to x's dtype at the end.

Hugging Face's module keeps five tensors per element for backward (the fp32 input, the
normalized product, the weighted product, the fp32 gate and its SiLU: 16 bytes per element in
a bf16 model). This op keeps x, the gate and the fp32 inverse RMS per row (4 bytes per element
and 4 per row) and recomputes the rest. Backward (n = x * rstd, s = silu(g), p = w * n):
    dp = dy * s,  dg = dy * p * silu'(g),  dw = sum over rows of dp * n,
    dx = rstd * (m - n * mean(m * n)), m = dp * w
dW is reduced as the plain RMSNorm's is (memplan.kernels._norm_weight_grad)."""

from __future__ import annotations

import torch
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
    NormBackwardConfig,
    as_rows,
    cdiv,
    check_floating,
    empty_like_rows,
    first_order_only,
    load_fp32,
    norm_backward_config,
    norm_forward_config,
    num_sms,
    on_device,
    rounded_to,
)


def reference_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Plain PyTorch, the Hugging Face formula (Qwen3_5RMSNormGated.forward)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    weighted = weight * normed.to(x.dtype)
    return (weighted * torch.nn.functional.silu(gate.float())).to(x.dtype)


# --- Triton kernels -------------------------------------------------------------------------


@fast_launch
@triton.jit
def _gated_rms_norm_forward_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    g_row_stride,
    n_rows,
    n_cols,
    eps,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    """y (contiguous rows) and rstd; the weighted product rounded to x's dtype where the
    weight's and x's promoted dtype is x's (ROUND_PRODUCT), as torch's multiply rounds it."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0)
    g = g.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    dtype = x_ptr.dtype.element_ty
    normed = rounded_to(x * rstd[:, None], dtype)
    product = normed * w[None, :]
    if ROUND_PRODUCT:
        product = rounded_to(product, dtype)
    y = rounded_to(product * (g * tl.sigmoid(g)), dtype)
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(dtype), mask=mask)


@fast_launch
@triton.jit
def _gated_rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    g_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dg_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    g_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    ROUND_PRODUCT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """dx and dg (contiguous rows) and the dW partials; each program walks a contiguous range
    of rows. The products are recomputed as the forward rounded them, and their gradients
    rounded as autograd rounds them (to the products' dtypes)."""
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)

    for start in tl.range(row_start, row_end, ROWS, num_stages=STAGES):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        dy = load_fp32(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask, True)
        x = load_fp32(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask, True)
        g = load_fp32(g_ptr + rows[:, None] * g_row_stride + cols[None, :], mask, True)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        normed = x * rstd[:, None]
        normed_cast = rounded_to(normed, x_ptr.dtype.element_ty)
        product = normed_cast * w[None, :]
        if ROUND_PRODUCT:
            product = rounded_to(product, x_ptr.dtype.element_ty)
        sig = tl.sigmoid(g)
        d_product = dy * (g * sig)
        dg = dy * product * (sig * (1.0 + g * (1.0 - sig)))
        if ROUND_PRODUCT:
            d_product = rounded_to(d_product, x_ptr.dtype.element_ty)
        m = rounded_to(d_product * w[None, :], x_ptr.dtype.element_ty)
        mean_mn = tl.sum(m * normed, axis=1) / n_cols
        dx = (m - normed * mean_mn[:, None]) * rstd[:, None]
        offsets = rows[:, None] * n_cols + cols[None, :]
        dx = rounded_to(dx, dx_ptr.dtype.element_ty).to(dx_ptr.dtype.element_ty)
        dg = rounded_to(dg, dg_ptr.dtype.element_ty).to(dg_ptr.dtype.element_ty)
        tl.store(dx_ptr + offsets, dx, mask=mask)
        tl.store(dg_ptr + offsets, dg, mask=mask)
        if COMPUTE_DW:
            dw_acc += d_product * normed_cast

    if COMPUTE_DW:
        store_partial(dw_partial_ptr, pid, n_cols, cols, tl.sum(dw_acc, axis=0), col_mask, PAIRED)


# --- launchers ------------------------------------------------------------------------------

# Row tiles the backward's loop loads ahead (Triton's software pipelining).
BACKWARD_STAGES = 3


def _backward_config(n_rows: int, n_cols: int, sms: int) -> NormBackwardConfig:
    """The RMSNorm's backward launch with half its rows a tile, with BACKWARD_STAGES: at rows of
    128 (the DeltaNet's value head dim) faster than the RMSNorm's own (docs/bench_kernels.md)."""
    base = norm_backward_config(n_rows, n_cols, sms, "rms_norm")
    rows = max(1, base.rows // 2)
    per_sm = 2 if rows * base.block_n <= 4096 else 1
    n_programs = min(cdiv(n_rows, rows), sms * per_sm)
    rows_per_program = cdiv(n_rows, n_programs)
    return base._replace(
        rows=rows, n_programs=cdiv(n_rows, rows_per_program), rows_per_program=rows_per_program
    )


def _rounds_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32


def gated_rms_norm_forward(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y like x, rstd fp32 of shape x.shape[:-1]."""
    x2, g2 = as_rows(x), as_rows(gate)
    n_rows, n_cols = x2.shape
    y = empty_like_rows(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if y.numel() == 0:
        return y, rstd
    block_n, rows, num_warps = norm_forward_config(n_cols)
    with on_device(x):
        _gated_rms_norm_forward_kernel[(cdiv(n_rows, rows),)](
            x2,
            g2,
            weight,
            y,
            rstd,
            x2.stride(0),
            g2.stride(0),
            n_rows,
            n_cols,
            eps,
            ROUND_PRODUCT=_rounds_product(x, weight),
            BLOCK_N=block_n,
            ROWS=rows,
            num_warps=num_warps,
        )
    return y, rstd


def gated_rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    compute_dw: bool,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dgate, dw); sm_count: the GPU's SMs, which size the dW partials (num_sms)."""
    x2, g2, dy2 = as_rows(x), as_rows(gate), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = empty_like_rows(x)
    dg = empty_like_rows(gate)
    if dx.numel() == 0:
        return dx, dg, torch.zeros_like(weight) if compute_dw else None
    sms = num_sms(x.device, sm_count)
    config = _backward_config(n_rows, n_cols, sms)
    n_programs = config.n_programs
    dw_partial = new_partials(1, n_programs, n_cols, x.device, sms) if compute_dw else dx
    with on_device(x):
        _gated_rms_norm_backward_kernel[(n_programs,)](
            dy2,
            x2,
            g2,
            weight,
            rstd,
            dx,
            dg,
            dw_partial,
            dy2.stride(0),
            x2.stride(0),
            g2.stride(0),
            n_rows,
            n_cols,
            config.rows_per_program,
            ROUND_PRODUCT=_rounds_product(x, weight),
            COMPUTE_DW=compute_dw,
            PAIRED=partial_layout(n_programs, sms)[1],
            BLOCK_N=config.block_n,
            ROWS=config.rows,
            STAGES=BACKWARD_STAGES,
            num_warps=config.num_warps,
        )
    dw = sum_partials(dw_partial, weight.dtype)[0] if compute_dw else None
    return dx, dg, dw


# --- op declaration (memplan.kernels._op) ---------------------------------------------------


def _forward(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd); sm_count is for backward."""
    return gated_rms_norm_forward(x, gate, weight, eps)


def _forward_fake(x, gate, weight, eps, sm_count=None):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _backward_fake(dy, x, gate, weight, rstd, compute_dw, sm_count):
    dw = weight.new_empty(weight.shape if compute_dw else (0,))
    return x.new_empty(x.shape), gate.new_empty(gate.shape), dw


@launcher("gated_rms_norm_backward", fake=_backward_fake)
def _backward_launch(
    dy: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    compute_dw: bool,
    sm_count: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate, dw); dw empty unless compute_dw."""
    dx, dg, dw = gated_rms_norm_backward(dy, x, gate, weight, rstd, compute_dw, sm_count)
    return dx, dg, dw if dw is not None else weight.new_empty(0)


def _setup_context(ctx, inputs, output):
    x, gate, weight, _eps, sm_count = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.sm_count = sm_count


@first_order_only
def _backward(ctx, dy, _d_rstd):
    """Gradients of (x, gate, weight, eps, sm_count)."""
    x, gate, weight, rstd = ctx.saved_tensors
    compute_dw = ctx.needs_input_grad[2]
    dx, dg, dw = _backward_launch(dy, x, gate, weight, rstd, compute_dw, ctx.sm_count)
    needs_x, needs_gate = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    return (
        dx if needs_x else None,
        dg if needs_gate else None,
        dw if compute_dw else None,
        None,
        None,
    )


GATED_RMS_NORM = Op(
    "gated_rms_norm",
    _forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# --- public API -----------------------------------------------------------------------------


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    sm_count: int | None = None,
) -> torch.Tensor:
    """Fused gated RMSNorm over the last dim of x (any leading shape; the gate of x's shape).
    See the module docstring. sm_count as in memplan.kernels.rms_norm.rms_norm."""
    if x.dim() == 0:
        raise UsageError("gated_rms_norm normalizes the last dim of x, which has none.")
    if gate.shape != x.shape:
        raise UsageError(
            f"gated_rms_norm's gate of shape {tuple(gate.shape)} does not match x's "
            f"{tuple(x.shape)}."
        )
    if weight.shape != (x.shape[-1],):
        raise UsageError(
            f"gated RMSNorm weight of shape {tuple(weight.shape)} does not match the normalized "
            f"size {x.shape[-1]}."
        )
    check_floating("gated_rms_norm", x, gate, weight)
    # the kernels read the weight with unit stride; autograd sends its gradient through the copy
    weight = weight.contiguous()
    return GATED_RMS_NORM(x, gate, weight, float(eps), sm_count)[0]
