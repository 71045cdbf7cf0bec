"""RMSNorm: y = (x / rms(x)) * (offset + weight), rms(x) = sqrt(mean(x^2) + eps).

Casting modes match the Hugging Face modules they replace:
- "llama" (LlamaRMSNorm and most models): normalize in fp32, cast to the input dtype, then
  multiply by the weight (output dtype = torch promotion of weight and input dtypes).
- "gemma" (GemmaRMSNorm, offset 1.0): everything in fp32, cast once at the end (input dtype).

Forward saves only x and the fp32 inverse RMS per row. Backward (n = x * rstd, m = dy * w):
    dx = rstd * (m - n * mean(m * n))            (d rstd / dx = -rstd^3 x / N)
    dw = sum over rows of dy * n                 (n cast to the input dtype first for "llama")
dw is reduced in two stages: each program sums a contiguous range of rows into an fp32 partial
held in registers, then one torch sum over the partials. dx may overwrite dy's buffer
(`in_place_backward`), which is unsafe where dy is also the residual's gradient (Gemma 2/3 put a
norm on the residual branch's output, so the same gradient tensor feeds both)."""

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
from memplan.kernels._op import Op, launcher, use_custom_op
from memplan.kernels._utils import (
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
)

CASTING_MODES = ("llama", "gemma")


def reference_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> torch.Tensor:
    """Plain PyTorch, the Hugging Face formulas (LlamaRMSNorm / GemmaRMSNorm)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    return (offset + weight) * normed.to(x.dtype)


# --- Triton kernels -------------------------------------------------------------------------


@fast_launch
@triton.jit
def _rms_norm_forward_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    offset,
    branch_ptr,
    h_ptr,
    branch_row_stride,
    GEMMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr = False,
):
    """y = norm(x), or with ADD: h = x + branch (rounded to x's dtype, as torch's add), y = norm(h).
    h is stored with y's row stride."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if ADD:
        branch = tl.load(
            branch_ptr + rows[:, None] * branch_row_stride + cols[None, :], mask=mask, other=0.0
        )
        # torch's add: the sum in fp32, rounded to nearest even (Triton's default on the GPU;
        # its CPU interpreter truncates)
        x = (x.to(tl.float32) + branch.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * y_row_stride + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset

    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    normed = x * rstd[:, None]
    if not GEMMA:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = normed * w[None, :]
    tl.store(
        y_ptr + rows[:, None] * y_row_stride + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


@fast_launch
@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    offset,
    dy2_ptr,
    dy3_ptr,
    residual_grad_ptr,
    dy2_row_stride,
    dy3_row_stride,
    residual_grad_row_stride,
    GEMMA: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    WEIGHT_FROM_CACHE: tl.constexpr,
    N_DY: tl.constexpr = 1,
    ADD_RESIDUAL_GRAD: tl.constexpr = False,
):
    """dx (and the dW partials) from dy = the sum of N_DY output gradients (one per consumer of
    the output), plus with ADD_RESIDUAL_GRAD the residual stream's gradient added to dx."""
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols

    if not WEIGHT_FROM_CACHE:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)

    for start in range(row_start, row_end, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        dy = load_fp32(
            dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask, WEIGHT_FROM_CACHE
        )
        if N_DY >= 2:
            dy += load_fp32(
                dy2_ptr + rows[:, None] * dy2_row_stride + cols[None, :], mask, WEIGHT_FROM_CACHE
            )
        if N_DY >= 3:
            dy += load_fp32(
                dy3_ptr + rows[:, None] * dy3_row_stride + cols[None, :], mask, WEIGHT_FROM_CACHE
            )
        x = load_fp32(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask, WEIGHT_FROM_CACHE)
        if WEIGHT_FROM_CACHE:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        normed = x * rstd[:, None]
        m = dy * w[None, :]
        mean_mn = tl.sum(m * normed, axis=1) / n_cols
        dx = (m - normed * mean_mn[:, None]) * rstd[:, None]
        if ADD_RESIDUAL_GRAD:
            dx += load_fp32(
                residual_grad_ptr + rows[:, None] * residual_grad_row_stride + cols[None, :],
                mask,
                WEIGHT_FROM_CACHE,
            )
        tl.store(
            dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            if not GEMMA:
                normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            dw_acc += dy * normed

    if COMPUTE_DW:
        store_partial(dw_partial_ptr, pid, n_cols, cols, tl.sum(dw_acc, axis=0), col_mask, PAIRED)


# --- launchers ------------------------------------------------------------------------------


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, gemma: bool) -> torch.dtype:
    return x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)


def _launch_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    gemma: bool,
    branch: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, rstd, h): h = x + branch when a branch is given, y = norm(h if given else x)."""
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    y = empty_like_rows(x, _output_dtype(x, weight, gemma))
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    h = None if branch is None else empty_like_rows(x)
    if y.numel() == 0:  # no rows, or rows of 0 elements (as torch's rms_norm: empty output)
        return y, rstd, h
    branch2 = x2 if branch is None else as_rows(branch)
    block_n, rows, num_warps = norm_forward_config(n_cols)
    with on_device(x):
        _rms_norm_forward_kernel[(cdiv(n_rows, rows),)](
            x2,
            weight,
            y,
            rstd,
            x2.stride(0),
            n_cols,
            n_rows,
            n_cols,
            eps,
            offset,
            branch2,
            y if h is None else h,
            branch2.stride(0),
            GEMMA=gemma,
            BLOCK_N=block_n,
            ROWS=rows,
            ADD=branch is not None,
            num_warps=num_warps,
        )
    return y, rstd, h


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y like x (dtype per casting mode), rstd fp32 of shape x.shape[:-1]."""
    y, rstd, _ = _launch_forward(x, weight, eps, offset, gemma, None)
    return y, rstd


def add_rms_norm_forward(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, y, rstd): h = residual + branch in their dtype, y = norm(h), one read of each."""
    y, rstd, h = _launch_forward(residual, weight, eps, offset, gemma, branch)
    return h, y, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gemma: bool,
    compute_dw: bool,
    dx: torch.Tensor | None = None,
    extra_dys: tuple[torch.Tensor, ...] = (),
    residual_grad: torch.Tensor | None = None,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dw) for the output gradient dy + sum(extra_dys) (at most two: the gradients of the
    same output from several consumers), plus residual_grad added to dx. dx is written into `dx`
    when given (it may be dy itself: each program reads a tile of rows entirely before writing
    the same rows). sm_count: the GPU's SMs, which size the dW partials (num_sms)."""
    if len(extra_dys) > 2:
        raise ValueError(f"at most 3 output gradients, got {1 + len(extra_dys)}")
    x2 = as_rows(x)
    dy2 = as_rows(dy)
    n_rows, n_cols = x2.shape
    if dx is None:
        dx = empty_like_rows(x)
    dx2 = dx.view(n_rows, n_cols)
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    extra = [as_rows(g) for g in extra_dys] + [dy2] * (2 - len(extra_dys))
    res2 = dy2 if residual_grad is None else as_rows(residual_grad)
    sms = num_sms(x.device, sm_count)
    config = norm_backward_config(n_rows, n_cols, sms, "rms_norm")
    n_programs = config.n_programs
    dw_partial = (
        new_partials(1, n_programs, n_cols, x.device, sms)
        if compute_dw
        else dx2  # never written: COMPUTE_DW=False
    )
    with on_device(x):
        _rms_norm_backward_kernel[(n_programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dx2,
            dw_partial,
            dy2.stride(0),
            x2.stride(0),
            n_cols,
            n_rows,
            n_cols,
            config.rows_per_program,
            offset,
            extra[0],
            extra[1],
            res2,
            extra[0].stride(0),
            extra[1].stride(0),
            res2.stride(0),
            GEMMA=gemma,
            COMPUTE_DW=compute_dw,
            PAIRED=partial_layout(n_programs, sms)[1],
            BLOCK_N=config.block_n,
            ROWS=config.rows,
            WEIGHT_FROM_CACHE=config.weight_from_cache,
            N_DY=1 + len(extra_dys),
            ADD_RESIDUAL_GRAD=residual_grad is not None,
            num_warps=config.num_warps,
        )
    dw = sum_partials(dw_partial, weight.dtype)[0] if compute_dw else None
    return dx, dw


# --- op declarations (memplan.kernels._op) --------------------------------------------------


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    gemma: bool,
    in_place_backward: bool,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd); in_place_backward and sm_count are for backward (see _norm_grads)."""
    return rms_norm_forward(x, weight, eps, offset, gemma)


def _forward_fake(x, weight, eps, offset, gemma, in_place_backward, sm_count=None):
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, gemma))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


def _add_forward(
    residual: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    gemma: bool,
    in_place_backward: bool,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, y, rstd). Without a branch h is residual itself, a view handed back so that its
    gradient joins the norm's in the same pass: eager path only (a custom op's output cannot
    alias its input; add_rms_norm sends that case to the plain norm while tracing)."""
    if branch is None:
        y, rstd = rms_norm_forward(residual, weight, eps, offset, gemma)
        return residual.view_as(residual), y, rstd
    return add_rms_norm_forward(residual, branch, weight, eps, offset, gemma)


def _add_forward_fake(
    residual, branch, weight, eps, offset, gemma, in_place_backward, sm_count=None
):
    y, rstd = _forward_fake(residual, weight, eps, offset, gemma, in_place_backward)
    return residual.new_empty(residual.shape), y, rstd


def _backward_fake(
    dy, extra_dys, x, weight, rstd, offset, gemma, compute_dw, residual_grad, sm_count
):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if compute_dw else (0,))


@launcher("rms_norm_backward", fake=_backward_fake)
def _backward_launch(
    dy: torch.Tensor,
    extra_dys: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gemma: bool,
    compute_dw: bool,
    residual_grad: torch.Tensor | None,
    sm_count: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); dw empty unless compute_dw."""
    dx, dw = rms_norm_backward(
        dy, x, weight, rstd, offset, gemma, compute_dw, extra_dys=tuple(extra_dys),
        residual_grad=residual_grad, sm_count=sm_count,
    )  # fmt: skip
    return dx, dw if dw is not None else weight.new_empty(0)


def _backward_in_place_fake(
    dy, extra_dys, x, weight, rstd, offset, gemma, compute_dw, residual_grad, sm_count
):
    return weight.new_empty(weight.shape if compute_dw else (0,))


@launcher("rms_norm_backward_", fake=_backward_in_place_fake, mutates_args=("dy",))
def _backward_in_place_launch(
    dy: torch.Tensor,
    extra_dys: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gemma: bool,
    compute_dw: bool,
    residual_grad: torch.Tensor | None,
    sm_count: int | None,
) -> torch.Tensor:
    """dw (empty unless compute_dw); dx is written over dy."""
    _, dw = rms_norm_backward(
        dy, x, weight, rstd, offset, gemma, compute_dw, dx=dy, extra_dys=tuple(extra_dys),
        residual_grad=residual_grad, sm_count=sm_count,
    )  # fmt: skip
    return dw if dw is not None else weight.new_empty(0)


def _norm_grads(
    ctx, dys: tuple[torch.Tensor | None, ...], residual_grad: torch.Tensor | None, needs_dx: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw) of a norm (or of residual + branch before it) from the gradients of its output's
    consumers (None where one gave none) and, after a residual add, of the sum itself."""
    x, weight, rstd = ctx.saved_tensors
    compute_dw = ctx.needs_input_grad[ctx.weight_index]
    dys = tuple(g for g in dys if g is not None)
    if not dys:
        dw = torch.zeros_like(weight) if compute_dw else None
        return (residual_grad if needs_dx else None), dw
    dy, extra = dys[0], list(dys[1:])
    args = (extra, x, weight, rstd, ctx.offset, ctx.gemma, compute_dw, residual_grad, ctx.sm_count)
    # dx over dy: only where the caller allowed it (dy must be read by nothing else, e.g. not
    # shared with a residual branch) and dx is wanted at all.
    if ctx.in_place_backward and needs_dx and dy.dtype == x.dtype and dy.is_contiguous():
        dx, dw = dy, _backward_in_place_launch(dy, *args)
    else:
        dx, dw = _backward_launch(dy, *args)
    return dx, dw if compute_dw else None


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset, gemma, in_place_backward, sm_count = inputs
    _save(ctx, x, weight, output[1], offset, gemma, in_place_backward, sm_count, weight_index=1)


@first_order_only
def _backward(ctx, dy, _d_rstd, *extra_dys):
    """Gradients of (x, weight, eps, offset, gemma, in_place_backward, sm_count)."""
    dx, dw = _norm_grads(ctx, (dy, *extra_dys), None, ctx.needs_input_grad[0])
    return dx, dw, None, None, None, None, None


def _add_setup_context(ctx, inputs, output):
    _residual, _branch, weight, _eps, offset, gemma, in_place_backward, sm_count = inputs
    h, rstd = output[0], output[2]
    _save(ctx, h, weight, rstd, offset, gemma, in_place_backward, sm_count, weight_index=2)


@first_order_only
def _add_backward(ctx, dh, dy, _d_rstd, *extra_dys):
    """Gradients of (residual, branch, weight, eps, offset, gemma, in_place_backward, sm_count):
    both summands get the sum's gradient, h's own plus the norm's."""
    needs_residual, needs_branch = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _norm_grads(ctx, (dy, *extra_dys), dh, needs_residual or needs_branch)
    return dx if needs_residual else None, dx if needs_branch else None, dw, *(None,) * 5


def _save(
    ctx, x, weight, rstd, offset, gemma, in_place_backward, sm_count, *, weight_index
) -> None:
    """Saves the norm's input, weight and rstd: nothing else is kept for backward."""
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # consumers that gave no gradient come back as None
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset, ctx.gemma, ctx.in_place_backward = offset, gemma, in_place_backward
    ctx.sm_count = sm_count
    ctx.weight_index = weight_index


# y = norm(x): outputs (y, rstd), y handed to several consumers as views (fan_out) in eager.
RMS_NORM = Op(
    "rms_norm",
    _forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
    fan_out=0,
)
# h = residual + branch, y = norm(h): outputs (h, y, rstd), y fanned out as above.
ADD_RMS_NORM = Op(
    "add_rms_norm",
    _add_forward,
    fake=_add_forward_fake,
    setup_context=_add_setup_context,
    backward=_add_backward,
    fan_out=1,
)


# --- public API -----------------------------------------------------------------------------

MAX_CONSUMERS = 3


def _check_args(x: torch.Tensor, weight: torch.Tensor, casting: str, consumers: int) -> None:
    if casting not in CASTING_MODES:
        raise UsageError(f"casting must be one of {CASTING_MODES}, got {casting!r}.")
    if x.dim() == 0:
        raise UsageError("rms_norm normalizes the last dim of x, which has none (a 0-d tensor).")
    if weight.shape != (x.shape[-1],):
        raise UsageError(
            f"RMSNorm weight of shape {tuple(weight.shape)} does not match hidden size "
            f"{x.shape[-1]}."
        )
    if not (isinstance(consumers, int) and 1 <= consumers <= MAX_CONSUMERS):
        raise UsageError(f"consumers must be an int from 1 to {MAX_CONSUMERS}, got {consumers!r}.")
    check_floating("rms_norm", x, weight)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    casting: str = "llama",
    in_place_backward: bool = False,
    sm_count: int | None = None,
) -> torch.Tensor:
    """Fused RMSNorm over the last dim of x (any leading shape). See the module docstring.
    sm_count: the SMs of the GPU x stands for, which size backward's dW partials (None: x's
    device's; meta tensors have none)."""
    return rms_norm_per_consumer(
        x, weight, eps, offset=offset, casting=casting, in_place_backward=in_place_backward,
        sm_count=sm_count,
    )[0]  # fmt: skip


def rms_norm_per_consumer(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    consumers: int = 1,
    offset: float = 0.0,
    casting: str = "llama",
    in_place_backward: bool = False,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """rms_norm's output once per consumer (1-3): equal views of one tensor, whose gradients the
    backward sums in its own pass (e.g. q, k and v projections of one normalized input). Under
    torch.compile the same tensor is repeated and autograd sums the gradients. sm_count as in
    rms_norm."""
    _check_args(x, weight, casting, consumers)
    # The kernels read the weight with unit stride; autograd sends its gradient through the copy.
    weight = weight.contiguous()
    gemma = casting == "gemma"
    args = (x, weight, float(eps), float(offset), gemma, in_place_backward, sm_count)
    return RMS_NORM.fanned_out(*args, consumers=consumers)[1]


def add_rms_norm(
    residual: torch.Tensor,
    branch: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    consumers: int = 1,
    offset: float = 0.0,
    casting: str = "llama",
    in_place_backward: bool = False,
    sm_count: int | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(h, ys): h = residual + branch (the next residual stream, in their dtype) and ys =
    rms_norm(h) once per consumer as in rms_norm_per_consumer, from one read of residual and
    branch. Backward adds h's own gradient to the norm's input gradient in the same pass.
    residual and branch must have one shape and dtype. Without a branch h is residual (a view of
    it: the first layer's residual stream, whose gradient then joins the norm's in the same pass
    too). sm_count as in rms_norm."""
    _check_args(residual, weight, casting, consumers)
    if branch is None:
        if use_custom_op(residual):  # a custom op cannot return a view of its input
            return residual, rms_norm_per_consumer(
                residual, weight, eps, consumers=consumers, offset=offset, casting=casting,
                in_place_backward=in_place_backward, sm_count=sm_count,
            )  # fmt: skip
    elif branch.shape != residual.shape or branch.dtype != residual.dtype:
        raise UsageError(
            f"add_rms_norm adds tensors of one shape and dtype, got {tuple(residual.shape)} "
            f"{residual.dtype} and {tuple(branch.shape)} {branch.dtype}."
        )
    else:
        check_floating("add_rms_norm", branch)
    weight = weight.contiguous()
    args = (residual, branch, weight, float(eps), float(offset), casting == "gemma")
    (h, *_), ys = ADD_RMS_NORM.fanned_out(*args, in_place_backward, sm_count, consumers=consumers)
    return h, ys


def reference_add_rms_norm(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the decoder layer's `residual + hidden_states` then its RMSNorm."""
    h = residual + branch
    return h, reference_rms_norm(h, weight, eps, offset=offset, casting=casting)


class RMSNorm(torch.nn.Module):
    """Drop-in for LlamaRMSNorm (casting="llama", offset=0) and GemmaRMSNorm (casting="gemma",
    offset=1.0, weight stored as w with the output scaled by 1 + w)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting: str = "llama",
        in_place_backward: bool = False,
    ) -> None:
        super().__init__()
        if casting not in CASTING_MODES:
            raise UsageError(f"casting must be one of {CASTING_MODES}, got {casting!r}.")
        init = torch.zeros if offset else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size))
        self.eps = eps
        self.offset = offset
        self.casting = casting
        self.in_place_backward = in_place_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x,
            self.weight,
            self.eps,
            offset=self.offset,
            casting=self.casting,
            in_place_backward=self.in_place_backward,
        )

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, "
            f"casting={self.casting!r}"
        )
