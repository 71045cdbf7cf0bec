"""Causal attention with a learned sink logit per head (gpt-oss), on torch's fused attention
kernels: no (heads x seq x seq) scores in memory.

Hugging Face's eager formula (modeling_gpt_oss.eager_attention_forward) appends the head's sink
logit s to every row of the scaled, masked scores S, takes the softmax over the seq + 1 columns
and drops the sink column. With L = logsumexp of the row of S and P = exp(S - L), O = P V (plain
softmax attention), each kept probability is exp(S_j) / (exp(L) + exp(s)) = P_j * r, so

    out = O * r,    r = exp(L) / (exp(L) + exp(s)) = sigmoid(L - s)    (one r per row and head)

Forward: the fused kernel returns O and L; O is scaled by r in its own memory.

Backward, for g = d(out): dO = g r and dr = rowsum(g O), which reaches L as
dL = dr r (1 - r) and s as -dr r (1 - r). Through O, softmax attention's backward gives
dS = P (dP - D) with dP = dO V^T and D = rowsum(dO O) = r rowsum(g O); through L, dS gets P dL
more. Together dS = P (dP - (D - dL)), and D - dL = r^2 rowsum(g O) = rowsum(dO out): the fused
backward forms D from its `grad_out` and `out` arguments, so calling it with grad_out = g r and
out = the returned output gives exactly the total dS, dV = P^T (g r), and dQ, dK from dS. The
sink's gradient is ds = -sum over batch and rows of rowsum(g out) (1 - r) (rowsum(g out) =
r rowsum(g O)), in fp32.

Kernels: flash attention (aten._flash_attention_forward/_backward) for fp16/bf16 on CUDA (keys
and values with fewer heads as they are, the window as window_size_left = window - 1); the
memory-efficient kernel (aten._efficient_attention_*) for fp32 on CUDA (keys and values
expanded to every query head in forward and again in backward, window_size = window; its
logsumexp is padded to 32 rows); elsewhere (CPU, shapes the fused kernels refuse) the same
decomposition in plain PyTorch ("math": O and L from materialized fp32 scores, the backward by
the D' formula), which the CPU tests check against Hugging Face's formula. Every path saves q,
k, v, the output, the fp32 logsumexp and the kernel's philox seed and offset: nothing scores-sized.

The window is Hugging Face's sliding_window: a query at position i attends to keys j with
i - window < j <= i (masking_utils.sliding_window_overlay)."""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from memplan.errors import UsageError
from memplan.kernels._op import Op

aten = torch.ops.aten

Kernel = Literal["flash", "efficient", "math"]
LOW_PRECISION = (torch.float16, torch.bfloat16)


def reference_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Hugging Face's eager sink attention (gpt-oss), in the (batch, seq, heads, head_dim)
    layout: the masked scores and the sink logit softmaxed together, the sink column dropped;
    computed in q's dtype as transformers does."""
    b, s, h, d = q.shape
    groups = h // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    query = q.transpose(1, 2)
    key = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    value = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    allowed = _allowed(s, window, q.device)
    mask = torch.zeros(s, s, dtype=scores.dtype, device=q.device)
    scores = scores + mask.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _allowed(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(seq, seq) bool: query i attends to key j (causal, within the window)."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return allowed


def kernel_for(q: torch.Tensor, v: torch.Tensor) -> Kernel:
    """The kernel that runs a call with these inputs (module docstring)."""
    d, dv = q.shape[-1], v.shape[-1]
    if q.device.type != "cuda" or d != dv:
        return "math"
    if q.dtype in LOW_PRECISION and d % 8 == 0 and d <= 256:
        return "flash"
    if q.dtype == torch.float32 and d % 4 == 0:
        return "efficient"
    return "math"


def lse_rows(seq: int, kernel: Kernel) -> int:
    """Rows of the logsumexp a kernel returns per (batch, head): the memory-efficient kernel pads
    them to a multiple of 32."""
    return -(-seq // 32) * 32 if kernel == "efficient" else seq


def _expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values (batch, seq, kv_heads, head_dim) repeated to every query head."""
    groups = heads // t.shape[2]
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def _group_sum(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over every query head summed back to the kv_heads it was repeated from."""
    b, s, h, d = t.shape
    if h == kv_heads:
        return t
    return t.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


# --- the math path: the decomposition in plain PyTorch ----------------------------------------


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _math_scores(
    q: torch.Tensor, k: torch.Tensor, window: int | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, heads, seq, seq) masked scores, with q and the expanded k (batch, heads, seq,
    head_dim), in fp32 (fp64 for fp64 inputs)."""
    query = q.transpose(1, 2).to(_math_dtype(q))
    key = _expanded(k, q.shape[2]).transpose(1, 2).to(query.dtype)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~_allowed(q.shape[1], window, q.device), float("-inf"))
    return scores, query, key


def _math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, seq, heads, head_dim) in q's dtype and L (batch, heads, seq) in fp32."""
    scores, _, _ = _math_scores(q, k, window, scale)
    lse = torch.logsumexp(scores, dim=-1)
    value = _expanded(v, q.shape[2]).transpose(1, 2).to(scores.dtype)
    out = torch.matmul(torch.exp(scores - lse[..., None]), value)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse


def _math_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention's backward with D = rowsum(grad out), from `out` and `grad` as
    given (the fused kernels' contract), in fp32."""
    scores, query, key = _math_scores(q, k, window, scale)
    probs = torch.exp(scores - lse[..., : q.shape[1], None])
    value = _expanded(v, q.shape[2]).transpose(1, 2).to(scores.dtype)
    d_out = grad.transpose(1, 2).to(scores.dtype)
    delta = (d_out * out.transpose(1, 2).to(scores.dtype)).sum(dim=-1, keepdim=True)
    d_value = torch.matmul(probs.transpose(2, 3), d_out)
    d_scores = probs * (torch.matmul(d_out, value.transpose(2, 3)) - delta)
    d_query = torch.matmul(d_scores, key) * scale
    d_key = torch.matmul(d_scores.transpose(2, 3), query) * scale
    kv_heads = k.shape[2]
    return (
        d_query.transpose(1, 2).to(q.dtype),
        _group_sum(d_key.transpose(1, 2), kv_heads).to(k.dtype),
        _group_sum(d_value.transpose(1, 2), kv_heads).to(v.dtype),
    )


# --- the fused kernels ------------------------------------------------------------------------


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, L, philox seed, philox offset) of causal softmax attention by kernel_for's kernel."""
    kernel = kernel_for(q, v)
    seq = q.shape[1]
    if kernel == "flash":
        left = -1 if window is None else window - 1
        out, lse, seed, offset, _ = aten._flash_attention_forward(
            q, k, v, None, None, seq, seq, 0.0, True, False,
            scale=scale, window_size_left=left, window_size_right=0,
        )  # fmt: skip
        return out, lse, seed, offset
    if kernel == "efficient":
        heads = q.shape[2]
        out, lse, seed, offset, _, _ = aten._efficient_attention_forward(
            q, _expanded(k, heads), _expanded(v, heads), None, None, None, None, None, 0.0, 1,
            True, scale=scale, window_size=window,
        )  # fmt: skip
        return out, lse, seed, offset
    out, lse = _math_forward(q, k, v, window, scale)
    return out, lse, q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.int64)


def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of softmax attention for output gradient `grad`, D from (grad, out)."""
    kernel = kernel_for(q, v)
    seq = q.shape[1]
    if kernel == "flash":
        left = -1 if window is None else window - 1
        return aten._flash_attention_backward(
            grad, q, k, v, out, lse, None, None, seq, seq, 0.0, True, seed, offset,
            scale=scale, window_size_left=left, window_size_right=0,
        )  # fmt: skip
    if kernel == "efficient":
        heads, kv_heads = q.shape[2], k.shape[2]
        dq, dk, dv, _ = aten._efficient_attention_backward(
            grad, q, _expanded(k, heads), _expanded(v, heads), None, out, None, None, seq, seq,
            lse, 0.0, seed, offset, 1, False, scale=scale, window_size=window,
        )  # fmt: skip
        return dq, _group_sum(dk, kv_heads), _group_sum(dv, kv_heads)
    return _math_backward(grad, q, k, v, out, lse, window, scale)


def _row_ratio(lse: torch.Tensor, sinks: torch.Tensor, seq: int) -> torch.Tensor:
    """r = sigmoid(L - s), fp32 (batch, seq, heads, 1): the share of each row's probability
    mass the sink leaves to the keys."""
    r = torch.sigmoid(lse[..., :seq] - sinks.to(lse.dtype)[:, None])
    return r.transpose(1, 2).unsqueeze(-1)


# --- the op -----------------------------------------------------------------------------------


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, L, philox seed, philox offset): O scaled by r in O's memory."""
    out, lse, seed, offset = _attention_forward(q, k, v, window, scale)
    out.mul_(_row_ratio(lse, sinks, q.shape[1]))
    return out, lse, seed, offset


def _forward_fake(q, k, v, sinks, window, scale):
    kernel = kernel_for(q, v)
    b, s, h, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((b, h, lse_rows(s, kernel)), dtype=torch.float32)
    if kernel == "flash":
        return out, lse, q.new_empty(2, dtype=torch.uint64), q.new_empty((), dtype=torch.uint64)
    if kernel == "efficient":
        return out, lse, q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64)
    return out, lse, q.new_empty(0, dtype=torch.int64), q.new_empty(0, dtype=torch.int64)


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, the output, L and the philox state; not r (recomputed from L)."""
    q, k, v, sinks, window, scale = inputs
    out, lse, seed, offset = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, seed, offset)
    ctx.window, ctx.scale = window, scale
    ctx.mark_non_differentiable(lse, seed, offset)


@once_differentiable
def _backward(ctx, grad, _lse, _seed, _offset):
    """Gradients of (q, k, v, sinks, window, scale): the fused backward with grad r and the
    output (module docstring), the sinks' from rowsum(grad out) (1 - r)."""
    q, k, v, sinks, out, lse, seed, offset = ctx.saved_tensors
    r = _row_ratio(lse, sinks, q.shape[1])
    # one (batch, seq, heads, head_dim) buffer: grad * out for the row sums, then grad * r
    scratch = torch.mul(grad, out)
    row_sums = scratch.sum(dim=-1, keepdim=True, dtype=_math_dtype(grad))
    d_sinks = (row_sums * (r - 1)).sum(dim=(0, 1, 3)).to(sinks.dtype)
    del row_sums
    scaled = torch.mul(grad, r, out=scratch)
    del r
    dq, dk, dv = _attention_backward(scaled, q, k, v, out, lse, seed, offset, ctx.window, ctx.scale)
    return dq, dk, dv, d_sinks, None, None


SINK_ATTENTION = Op(
    "sink_attention",
    _forward,
    fake=_forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# --- public API -----------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention with per-head sink logits, Hugging Face's gpt-oss formula
    (reference_sink_attention): q (batch, seq, heads, head_dim), k and v (batch, seq,
    kv_heads, head_dim) with heads a multiple of kv_heads (each with unit stride along
    head_dim), sinks (heads,); window: a query at i attends to keys j with i - window < j <= i
    (None: every j <= i); scale: of the scores, head_dim ** -0.5 by default. Returns (batch,
    seq, heads, head_dim) in q's dtype, contiguous."""
    _check(q, k, v, sinks, window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return SINK_ATTENTION(
        q if q.stride(-1) == 1 else q.contiguous(),
        k if k.stride(-1) == 1 else k.contiguous(),
        v if v.stride(-1) == 1 else v.contiguous(),
        sinks,
        window,
        scale,
    )[0]


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise UsageError("sink_attention takes q, k, v as (batch, seq, heads, head_dim)")
    b, s, h, _ = q.shape
    if k.shape[:2] != (b, s) or v.shape[:3] != k.shape[:3] or h % k.shape[2]:
        raise UsageError(
            f"sink_attention: q {tuple(q.shape)} with k {tuple(k.shape)}, v {tuple(v.shape)}: "
            "keys and values need q's batch and seq, and a number of heads dividing q's"
        )
    if sinks.shape != (h,):
        raise UsageError(f"sink_attention: sinks must be ({h},), one per head; got {sinks.shape}")
    if window is not None and window < 1:
        raise UsageError(f"sink_attention: window must be at least 1, got {window}")
