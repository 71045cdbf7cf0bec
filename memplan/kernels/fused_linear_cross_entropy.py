"""Fused linear cross entropy: CE(hidden @ weight^T + bias, target) without materializing the
(rows x vocab) logits, with dX, dW (and db) computed in the forward for 'mean' and 'sum'.

Rows are processed in chunks. Per chunk, cuBLAS writes the logits into one preallocated buffer,
the cross-entropy kernel (memplan.kernels.cross_entropy) overwrites them with their gradient in
fp32 math, then dX_chunk = dlogits @ W (one GEMM over the whole vocabulary, exact). dW sums over
all rows, and accumulating it over chunks in bf16 is the known cause of FLCE divergence, so
there are three schedules (kernel_contracts.flce_transient_bytes has their exact bytes):

- one_pass: dW += dlogits^T @ x per chunk, when no low-precision accumulation happens: a single
  chunk (one GEMM), an fp32 weight (accumulated in dW itself), or no dW at all (frozen weight).
- one_pass_fp32_acc: several chunks with a bf16/fp16 weight, dW accumulated by cuBLAS into an
  fp32 (vocab x hidden) buffer (addmm with out_dtype=float32). Only under a memory_budget that
  holds it: three GEMMs, the fastest exact schedule, at 2 x dW(bf16) more memory. dW itself is
  allocated after the last chunk, once the logits buffer is freed, so the two never coexist.
- two_pass: the default otherwise. Pass 1 per row chunk: logits, loss, the per-row log-sum-exp
  and dX. Pass 2 per vocabulary slice: the slice's logits again for all rows, their gradient from
  the stored log-sum-exp, and dW[slice] in one GEMM over all rows. Exact (each element of dW is
  one fp32-accumulated GEMM) and lean (one chunk's logits), at the cost of a fourth GEMM.

Chunks without any target (all ignore_index) skip their GEMMs; the two-pass dW GEMMs span only
the rows from the first to the last chunk with targets. The host reads which rows have a target
once per call: from a copy prefetch_targets issued earlier (the patched causal LM does at its
forward's start), else with a synchronization at the call. 'none' computes only the losses in
the forward; its backward runs the chosen schedule with each row's gradient scaled by its
grad_output."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import (
    flce_chunk_for_budget,
    flce_default_chunk,
)
from memplan.estimators.kernel_contracts import flce_schedule as contract_schedule
from memplan.kernels._op import Op
from memplan.kernels._utils import autocast_dtype, check_floating, first_order_only
from memplan.kernels.cross_entropy import (
    LossOptions,
    check_target,
    grad_scale,
    launch_cross_entropy_forward,
    launch_cross_entropy_grad_from_lse,
    reduce_rows,
    reference_cross_entropy,
    scale_,
)

# Smallest chunk for which the fp32-accumulator schedule beats the two-pass one: below it the
# per-chunk read-modify-write of the fp32 dW (8 bytes x vocab x hidden) takes longer than the
# extra GEMM (2 x rows x vocab x hidden FLOP) at the ~200-250 bf16 FLOP per byte of HBM of an
# H100 or H200 (their datasheet rates).
MIN_ACCUMULATED_CHUNK = 1024


def reference_fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | Tensor | None = None,
) -> Tensor:
    """Plain PyTorch in fp32: the full logits, then reference_cross_entropy."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return reference_cross_entropy(
        logits,
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        z_loss_scale=z_loss_scale,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
    )


def flce_schedule(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    chunk: int,
    *,
    weight_requires_grad: bool,
    budget_bytes: int | None,
    has_bias: bool,
    per_token_loss: bool = False,
) -> str:
    """The schedule for a chunk: kernel_contracts.flce_schedule with this module's threshold."""
    return contract_schedule(
        rows,
        hidden,
        vocab,
        dtype_bytes,
        chunk,
        weight_requires_grad=weight_requires_grad,
        budget_bytes=budget_bytes,
        has_bias=has_bias,
        per_token_loss=per_token_loss,
        min_accumulated_chunk=MIN_ACCUMULATED_CHUNK,
    )


# --- the chunked loop -----------------------------------------------------------------------


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def _mm_into(a: Tensor, b: Tensor, out: Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, accumulated in fp32 inside the GEMM; out may be fp32 while
    a and b are bf16/fp16 (cuBLAS then also adds into out in fp32)."""
    if out.dtype == a.dtype:
        if accumulate:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda or out.is_meta:  # meta: the traced step follows CUDA's allocations
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=out.dtype, out=out)
    elif accumulate:  # CPU has no mixed-dtype GEMM; products of bf16 values are exact in fp32.
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def _targets_to_host(
    target: Tensor, ignore_index: int, vocab: int
) -> tuple[Tensor, torch.cuda.Event | None]:
    """(flags, ready): whether each row of target has a target, then whether any target lies
    outside the vocabulary ((rows + 1,) bool on the host), copied behind the event `ready` (CUDA:
    pinned memory, non-blocking; None elsewhere)."""
    valid = target != ignore_index
    flags = torch.cat([valid, (valid & ((target < 0) | (target >= vocab))).any()[None]])
    if flags.is_meta:
        return _assumed_flags(flags.shape[0]), None
    if not flags.is_cuda:
        return flags.cpu(), None
    host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(flags.device))
    return host, ready


def _assumed_flags(n: int) -> Tensor:
    """The host flags of meta targets, which hold no values: every row has a target and none
    lies outside the vocabulary (what the fake's outputs assume too)."""
    flags = torch.ones(n, dtype=torch.bool)
    flags[-1] = False
    return flags


@dataclasses.dataclass(frozen=True, eq=False)
class PrefetchedTargets:
    """What FLCE's chunk loop reads about one target tensor, copied to the host ahead of the
    call by prefetch_targets. Invariant: it describes `target` only for the ignore_index and
    vocabulary it was made for and while target is unmodified (its version counter); a call
    given it for anything else copies again."""

    target: Tensor
    ignore_index: int
    vocab: int
    version: int
    flags: Tensor  # (rows + 1,) bool on the host, see _targets_to_host
    ready: torch.cuda.Event | None

    def flags_for(self, target: Tensor, ignore_index: int, vocab: int) -> Tensor | None:
        """The host flags, once copied, where they describe this call's target; else None."""
        if target is not self.target or (self.ignore_index, self.vocab, self.version) != (
            ignore_index,
            vocab,
            target._version,
        ):
            return None
        if self.ready is not None:
            self.ready.synchronize()
        return self.flags


def prefetch_targets(target: Tensor, ignore_index: int, vocab: int) -> PrefetchedTargets | None:
    """Start copying what FLCE's chunk loop needs to know about `target` (N,) to the host, ahead
    of the call, and return the handle to pass as fused_linear_cross_entropy(prefetched=...).
    FLCE reads, per chunk, whether any row has a target (chunks without one skip their GEMMs)
    and checks the targets' range; asked for at the call, that is a host synchronization after
    the whole forward, and the GPU idles while the host launches the first chunk. Issued at the
    start of the forward, the copy is long done when FLCE waits for it. None while torch.compile
    traces (the compiled op synchronizes at the call) and for targets FLCE would copy anyway
    (not 1-d contiguous int64)."""
    if torch.compiler.is_compiling():
        return None
    if target.dim() != 1 or target.dtype != torch.int64 or not target.is_contiguous():
        return None
    flags, ready = _targets_to_host(target, ignore_index, vocab)
    return PrefetchedTargets(target, ignore_index, vocab, target._version, flags, ready)


def _chunks_with_targets(
    target: Tensor, host_flags: Tensor | None, ignore_index: int, chunk: int, vocab: int
) -> list[bool]:
    """Whether each chunk of rows has at least one target, from host_flags (prefetched) or
    copied now. A target outside the vocabulary is an error (as in torch's cross entropy), read
    from the same copy."""
    if host_flags is None:
        host_flags, ready = _targets_to_host(target, ignore_index, vocab)
        if ready is not None:
            ready.synchronize()
    if host_flags[-1].item():
        raise UsageError(
            f"a target is outside the vocabulary [0, {vocab}) and is not ignore_index "
            f"({ignore_index})"
        )
    n_chunks = -(-target.shape[0] // chunk)
    has_target = F.pad(host_flags[:-1], (0, n_chunks * chunk - target.shape[0]))
    return has_target.view(n_chunks, chunk).any(dim=1).tolist()


def _flce(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    row_scale: Tensor | None,
    divisor: Tensor | None,
    host_flags: Tensor | None,
    options: LossOptions,
    chunk: int,
    schedule: str,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    keep_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, z-loss, grad scale, dX, dW, db), unused gradients empty. The losses are per row
    when keep_rows, else sums over rows: the per-row buffers then only span one chunk.
    host_flags: the target's flags prefetched to the host (PrefetchedTargets), or None."""
    n_rows, n_hidden = hidden.shape
    vocab = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    compute_db = compute_db and bias is not None
    want_grads = compute_dx or compute_dw or compute_db
    if not compute_dw:
        schedule = "one_pass"
    ignore_index, z_loss_scale = options.ignore_index, options.z_loss_scale
    rows_scaled = row_scale is not None
    scale = grad_scale(target, divisor, options)

    def scale_of(r0: int, r1: int) -> Tensor:
        return row_scale[r0:r1] if row_scale is not None else scale

    dx = (
        torch.empty(hidden.shape, dtype=dtype, device=device) if compute_dx else hidden.new_empty(0)
    )
    # with the fp32 accumulator, dW is allocated only once the logits buffer is released
    late_dw = compute_dw and schedule == "one_pass_fp32_acc" and n_rows > 0
    dw = (
        torch.empty(weight.shape, dtype=dtype, device=device)
        if compute_dw and not late_dw
        else weight.new_empty(0)
    )
    db = hidden.new_empty(0)
    chunk = max(1, min(chunk, n_rows))
    rows_kept = n_rows if keep_rows else chunk
    loss_rows = torch.zeros(rows_kept, dtype=torch.float32, device=device)
    z_rows = torch.zeros(rows_kept, dtype=torch.float32, device=device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    z_sum = torch.zeros((), dtype=torch.float32, device=device)
    if n_rows == 0:
        if compute_dw:
            dw.zero_()
        if compute_db:
            db = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
        if keep_rows:
            return loss_rows, z_rows, scale, dx, dw, db
        return loss_sum, z_sum, scale, dx, dw, db

    has_targets = _chunks_with_targets(target, host_flags, ignore_index, chunk, vocab)
    buffer_elems = chunk * vocab if schedule != "two_pass" else max(chunk * vocab, n_rows)
    buffer = torch.empty(buffer_elems, dtype=dtype, device=device)
    acc = None
    if schedule == "one_pass_fp32_acc":
        acc = torch.empty(weight.shape, dtype=torch.float32, device=device)
    lse_rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    if schedule != "two_pass":
        lse_rows = None
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=device) if compute_db else None

    dw_started = False
    logits = None
    for i, chunk_has_targets in enumerate(has_targets):
        r0, r1 = i * chunk, min(n_rows, (i + 1) * chunk)
        if not chunk_has_targets:
            if compute_dx:
                dx[r0:r1].zero_()
            continue
        x = hidden[r0:r1]
        logits = buffer[: (r1 - r0) * vocab].view(r1 - r0, vocab)
        _linear(x, weight, bias, logits)
        q0, q1 = (r0, r1) if keep_rows else (0, r1 - r0)
        launch_cross_entropy_forward(
            logits,
            logits if want_grads else None,
            target[r0:r1],
            loss_rows[q0:q1],
            z_rows[q0:q1] if z_loss_scale > 0.0 else None,
            lse_rows[r0:r1] if lse_rows is not None else None,
            scale_of(r0, r1),
            options,
            row_scale=rows_scaled,
        )
        if not keep_rows:
            loss_sum += loss_rows[q0:q1].sum()
            if z_loss_scale > 0.0:
                z_sum += z_rows[q0:q1].sum()
        if not want_grads:
            continue
        if compute_dx:
            torch.mm(logits, weight, out=dx[r0:r1])
        if db_acc is not None:
            db_acc += logits.sum(dim=0, dtype=torch.float32)
        if compute_dw and schedule != "two_pass":
            _mm_into(logits.t(), x, acc if acc is not None else dw, accumulate=dw_started)
            dw_started = True

    if compute_dw and schedule == "two_pass":
        _dw_by_vocab_slices(
            hidden, weight, bias, target, lse_rows, buffer, has_targets, chunk, dw, scale_of,
            options, rows_scaled,
        )  # fmt: skip
    elif acc is not None:
        del buffer, logits  # the chunk's logits: dW takes their place, not their sum with acc
        dw = acc.to(dtype) if dw_started else torch.zeros(weight.shape, dtype=dtype, device=device)
        del acc
    elif compute_dw and not dw_started:
        dw.zero_()
    if db_acc is not None:
        db = db_acc.to(bias.dtype)
    if keep_rows:
        return loss_rows, z_rows, scale, dx, dw, db
    return loss_sum, z_sum, scale, dx, dw, db


def _dw_by_vocab_slices(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse_rows: Tensor,
    buffer: Tensor,
    has_targets: list[bool],
    chunk: int,
    dw: Tensor,
    scale_of: Callable[[int, int], Tensor],
    options: LossOptions,
    rows_scaled: bool,
) -> None:
    """Pass 2 of the two-pass schedule: dW[slice] = dlogits[:, slice]^T @ x over all rows with
    targets, one GEMM per vocabulary slice."""
    with_targets = [i for i, has in enumerate(has_targets) if has]
    if not with_targets:
        dw.zero_()
        return
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    r0, r1 = with_targets[0] * chunk, min(n_rows, (with_targets[-1] + 1) * chunk)
    span = r1 - r0
    width = max(1, min(vocab, buffer.numel() // span))
    if width >= 256:  # whole GEMM tiles; the last slice takes the remainder
        width -= width % 256
    x = hidden[r0:r1]
    for v0 in range(0, vocab, width):
        v1 = min(vocab, v0 + width)
        logits = buffer[: span * (v1 - v0)].view(span, v1 - v0)
        _linear(x, weight[v0:v1], bias[v0:v1] if bias is not None else None, logits)
        launch_cross_entropy_grad_from_lse(
            logits,
            target[r0:r1],
            lse_rows[r0:r1],
            scale_of(r0, r1),
            options,
            vocab_start=v0,
            vocab_size=vocab,
            row_scale=rows_scaled,
        )
        torch.mm(logits.t(), x, out=dw[v0:v1])


# --- op declaration (memplan.kernels._op) ---------------------------------------------------


def _forward(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    row_scale: Tensor | None,
    divisor: Tensor | None,
    host_flags: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_loss_scale: float,
    reduction: str,
    chunk: int,
    schedule: str,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    per_token_loss: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, z_loss, per-token loss, dX, dW, db); the per-token loss is empty unless asked for
    (and for 'none', whose loss is per token), a gradient not asked for is empty. row_scale
    (the backward of 'none') scales each row's gradient."""
    options = LossOptions.from_op_args(
        ignore_index, label_smoothing, softcap, z_loss_scale, reduction
    )
    keep_rows = per_token_loss or reduction == "none"
    losses, z_losses, scale, dx, dw, db = _flce(
        hidden, weight, target, bias, row_scale, divisor, host_flags, options, chunk, schedule,
        compute_dx, compute_dw, compute_db, keep_rows,
    )  # fmt: skip
    if reduction == "none":
        return losses, z_losses, losses.new_empty(0), dx, dw, db
    if keep_rows:
        loss, z_loss = (
            reduce_rows(losses, scale, reduction),
            reduce_rows(z_losses, scale, reduction),
        )
        return loss, z_loss, losses, dx, dw, db
    if reduction == "mean":
        losses, z_losses = losses * scale[0], z_losses * scale[0]
    return losses, z_losses, losses.new_empty(0), dx, dw, db


def _forward_fake(hidden, weight, target, bias, row_scale, divisor, host_flags, *rest):
    reduction, _chunk, _schedule, compute_dx, compute_dw, compute_db, per_token_loss = rest[4:]
    n_rows = hidden.shape[0]
    per_row = reduction == "none"
    loss = hidden.new_empty((n_rows,) if per_row else (), dtype=torch.float32)
    z_loss = hidden.new_empty((n_rows,) if per_row else (), dtype=torch.float32)
    kept = per_token_loss and not per_row
    per_token = hidden.new_empty((n_rows,) if kept else (0,), dtype=torch.float32)
    dx = hidden.new_empty(hidden.shape) if compute_dx else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape) if compute_dw else weight.new_empty(0)
    db = bias.new_empty(bias.shape) if compute_db and bias is not None else hidden.new_empty(0)
    return loss, z_loss, per_token, dx, dw, db


def _setup_context(ctx, inputs, output):
    """'mean' and 'sum' save dX, dW and db, computed in the forward; 'none' saves the inputs
    and runs the chunked loop again in backward, each row scaled by its grad_output."""
    hidden, weight, target, bias, _row_scale, divisor, host_flags, *options = inputs
    ctx.reduction = options[4]
    ctx.mark_non_differentiable(*output[1:])
    # Otherwise autograd hands backward zero tensors the size of dX and dW for those outputs.
    ctx.set_materialize_grads(False)
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, divisor)
        ctx.host_flags = host_flags
        ctx.options = options
    else:
        ctx.save_for_backward(*output[3:])


N_INPUTS = 18


@first_order_only
def _backward(ctx, grad_loss, *unused):
    if grad_loss is None:
        return (None,) * N_INPUTS
    need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if ctx.reduction == "none":
        hidden, weight, target, bias, divisor = ctx.saved_tensors
        row_scale = grad_loss.to(torch.float32).contiguous()
        # 'sum' with a per-row scale: each row's gradient times its grad_output, no rows kept.
        options = ctx.options[:4] + ["sum"] + ctx.options[5:7]
        options += [need_dx, need_dw, need_db, False]
        inputs = (hidden, weight, target, bias, row_scale, divisor, ctx.host_flags, *options)
        _, _, _, dx, dw, db = FUSED_LINEAR_CROSS_ENTROPY.forward(*inputs)
    else:
        dx, dw, db = ctx.saved_tensors
        # Scaled where they lie (skipped on device when grad_output is 1): no second copy.
        for grad in (dx, dw, db):
            if grad.numel():
                scale_(grad, grad_loss)
    grads = (dx if need_dx else None, dw if need_dw else None, None, db if need_db else None)
    return grads + (None,) * (N_INPUTS - 4)


# outputs (loss, z_loss, per-token loss, dX, dW, db)
FUSED_LINEAR_CROSS_ENTROPY = Op(
    "fused_linear_cross_entropy",
    _forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# --- API ------------------------------------------------------------------------------------


def _check_int(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch: int | Tensor | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    return_per_token_loss: bool = False,
    prefetched: PrefetchedTargets | None = None,
    options: LossOptions | None = None,
    autocast: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross entropy of hidden (N, H) @ weight (V, H)^T (+ bias (V,)) against target (N,), fp32
    loss, same options (LossOptions, as keywords or as `options`) as
    memplan.kernels.cross_entropy.cross_entropy.

    Rows per chunk: chunk_size, or the largest that fits memory_budget bytes of transient memory
    (kernel_contracts.flce_chunk_for_budget; this also allows the faster fp32-accumulator
    schedule), or by default 2^ceil(log2(N / ceil(V / H))). return_per_token_loss also returns
    the fp32 loss per token (detached for 'mean' and 'sum'). Under autocast the inputs are cast
    to the autocast dtype, as nn.Linear would: hidden's device's, or `autocast`, its dtype where
    the caller knows it is on (meta tensors have no autocast). `prefetched`: prefetch_targets'
    handle for this target, read where it still describes it."""
    if options is None:
        options = LossOptions(
            ignore_index, label_smoothing, softcap, z_loss_scale, reduction, num_items_in_batch
        )
    _check_int("chunk_size", chunk_size)
    _check_int("memory_budget", memory_budget)
    if chunk_size is not None and memory_budget is not None:
        raise UsageError("give chunk_size or memory_budget, not both")
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or target.shape != (hidden.shape[0],)
        or (bias is not None and bias.shape != (weight.shape[0],))
    ):
        raise UsageError(
            "fused_linear_cross_entropy expects hidden (N, H), weight (V, H), target (N,) and "
            f"bias (V,) or None, got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(target.shape)}, {None if bias is None else tuple(bias.shape)}"
        )
    check_floating("fused_linear_cross_entropy", hidden, weight)
    check_target("fused_linear_cross_entropy", target)
    if hidden.shape[1] == 0 or weight.shape[0] == 0:
        raise UsageError(
            "fused_linear_cross_entropy needs a hidden size and a vocabulary of at least 1, got "
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    amp_dtype = autocast_dtype(hidden.device.type, autocast)
    if amp_dtype is not None:
        hidden, weight = hidden.to(amp_dtype), weight.to(amp_dtype)
        bias = bias.to(amp_dtype) if bias is not None else None
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise UsageError(
            f"hidden, weight and bias must share one dtype, got {hidden.dtype}, {weight.dtype}"
            f" and {None if bias is None else bias.dtype} (cast them, or run under autocast)"
        )
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    target = target.to(torch.int64).contiguous()

    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and hidden.requires_grad
    need_dw = grad_on and weight.requires_grad
    need_db = grad_on and bias is not None and bias.requires_grad
    n_rows, n_hidden = hidden.shape
    vocab, dtype_bytes = weight.shape[0], weight.element_size()
    per_row = options.reduction == "none"
    per_token_loss = return_per_token_loss or per_row
    if memory_budget is not None:
        chunk = flce_chunk_for_budget(
            n_rows,
            n_hidden,
            vocab,
            dtype_bytes,
            memory_budget,
            need_dw,
            has_bias=need_db,
            per_token_loss=per_token_loss,
            min_accumulated_chunk=MIN_ACCUMULATED_CHUNK,
        )
    else:
        chunk = chunk_size or flce_default_chunk(n_rows, n_hidden, vocab)
    chunk = max(1, min(chunk, n_rows))
    schedule = flce_schedule(
        n_rows,
        n_hidden,
        vocab,
        dtype_bytes,
        chunk,
        weight_requires_grad=need_dw,
        budget_bytes=memory_budget,
        has_bias=need_db,
        per_token_loss=per_token_loss,
    )
    host_flags = None
    if prefetched is not None:
        host_flags = prefetched.flags_for(target, options.ignore_index, vocab)
    loss, _, per_token, *_ = FUSED_LINEAR_CROSS_ENTROPY(
        hidden,
        weight,
        target,
        bias,
        None,
        options.divisor(hidden.device),
        host_flags,
        *options.op_args(),
        chunk,
        schedule,
        need_dx and not per_row,
        need_dw and not per_row,
        need_db and not per_row,
        return_per_token_loss,
    )
    if return_per_token_loss:
        return loss, loss if per_row else per_token
    return loss


class FusedLinearCrossEntropyLoss(nn.Module):
    """nn.Module form of `fused_linear_cross_entropy`;
    forward(hidden, weight, target, bias=None, num_items_in_batch=None). The loss options are
    checked when the module is made and kept in `.options`."""

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        z_loss_scale: float = 0.0,
        reduction: str = "mean",
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        return_per_token_loss: bool = False,
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, softcap, z_loss_scale, reduction)
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self.return_per_token_loss = return_per_token_loss

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        bias: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            options=self.options.with_items(num_items_in_batch),
            chunk_size=self.chunk_size,
            memory_budget=self.memory_budget,
            return_per_token_loss=self.return_per_token_loss,
        )

    def extra_repr(self) -> str:
        return (
            f"reduction={self.options.reduction!r}, chunk_size={self.chunk_size}, "
            f"memory_budget={self.memory_budget}"
        )
