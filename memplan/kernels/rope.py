"""Rotary position embedding, exactly Hugging Face's `apply_rotary_pos_emb` (rotate_half layout):
    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
i.e. out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 (halves of the head dim).
cos/sin are used as the model's rotary embedding returns them, both halves read, so scaled
variants (linear, dynamic NTK, YaRN, Llama 3) need nothing special. cos/sin of head_dim / 2 (one
value per rotated pair, gpt-oss's tables) apply to both halves: cos1 = cos2, sin1 = sin2.

q and k are rotated together, one program per token (one launch per 65535 batch rows), reading
them through their strides (they are usually transposed views of (B, S, heads, head_dim)
projections: no copy). Out of place by default, the outputs keep the inputs' memory layout, as
the eager ops do; with `in_place` q and k are overwritten (and backward overwrites dq and dk),
as Liger-Kernel does, allocating nothing (each program reads its elements before writing them).
Nothing but cos/sin is saved. Backward applies the transposed rotation
R^T [a1, a2] = [a2, -a1]:
    dx1 = dy1 * cos1 + dy2 * sin2,   dx2 = dy2 * cos2 - dy1 * sin1.
No gradient flows to cos/sin (HF computes them under no_grad)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from memplan.errors import UsageError
from memplan.kernels._launch import fast_launch
from memplan.kernels._op import Op, launcher, use_custom_op
from memplan.kernels._utils import (
    check_floating,
    may_write_over,
    memory_overlaps,
    next_power_of_2,
    on_device,
)


def reference_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, transformers' apply_rotary_pos_emb."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --- Triton kernel --------------------------------------------------------------------------


@triton.jit
def _head_tile(x_ptr, b, s, n_heads, sb, ss, sh, HALF, BLOCK_H, BLOCK_D):
    """Pointers to the first halves of one token's heads (unit stride along head_dim), and
    their mask."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & (dims < HALF)[None, :]
    return x_ptr + b * sb + s * ss + heads[:, None] * sh + dims[None, :], mask


@triton.jit
def _load_halves(ptrs, mask, half_stride):
    first = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return first, tl.load(ptrs + half_stride, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rotate_and_store(ptrs, mask, half_stride, x1, x2, cos1, cos2, sin1, sin2, BACKWARD):
    if BACKWARD:
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    tl.store(ptrs, out1.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + half_stride, out2.to(ptrs.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    first_batch,
    n_q_heads,
    n_k_heads,
    # strides in (batch, seq, head) order, whatever the tensors' dim order; head_dim has unit
    # stride in every tensor and sin shares cos's strides (each argument costs host time on
    # every launch)
    q_sb,
    q_ss,
    q_sh,
    k_sb,
    k_ss,
    k_sh,
    qo_sb,
    qo_ss,
    qo_sh,
    ko_sb,
    ko_ss,
    ko_sh,
    cos_sb,
    cos_ss,
    HALF: tl.constexpr,
    COS_HALF: tl.constexpr,  # offset of cos's and sin's second half: HALF, or 0 for half tables
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # One token per program, on a (seq, batch) grid: no integer division to find the token.
    # Both q and k are loaded before anything is stored (the stores could alias the loads, so
    # the compiler keeps their order): one memory round trip per program, not two.
    s = tl.program_id(0).to(tl.int64)
    b = first_batch + tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HALF
    cs_offset = b * cos_sb + s * cos_ss + dims[None, :]
    cos1, cos2 = _load_halves(cos_ptr + cs_offset, dmask[None, :], COS_HALF)
    sin1, sin2 = _load_halves(sin_ptr + cs_offset, dmask[None, :], COS_HALF)
    q_in, q_mask = _head_tile(q_ptr, b, s, n_q_heads, q_sb, q_ss, q_sh, HALF, BLOCK_QH, BLOCK_D)
    k_in, k_mask = _head_tile(k_ptr, b, s, n_k_heads, k_sb, k_ss, k_sh, HALF, BLOCK_KH, BLOCK_D)
    q1, q2 = _load_halves(q_in, q_mask, HALF)
    k1, k2 = _load_halves(k_in, k_mask, HALF)
    q_out, _ = _head_tile(q_out_ptr, b, s, n_q_heads, qo_sb, qo_ss, qo_sh, HALF, BLOCK_QH, BLOCK_D)
    k_out, _ = _head_tile(k_out_ptr, b, s, n_k_heads, ko_sb, ko_ss, ko_sh, HALF, BLOCK_KH, BLOCK_D)
    _rotate_and_store(q_out, q_mask, HALF, q1, q2, cos1, cos2, sin1, sin2, BACKWARD)
    _rotate_and_store(k_out, k_mask, HALF, k1, k2, cos1, cos2, sin1, sin2, BACKWARD)


# --- launcher -------------------------------------------------------------------------------


def _bsh_strides(x: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """Strides of a q/k tensor in (batch, seq, head) order (head_dim's is 1)."""
    b, first, second, _ = x.stride()
    if unsqueeze_dim == 1:  # (B, heads, S, D)
        return b, second, first
    return b, first, second  # (B, S, heads, D)


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> None:
    if unsqueeze_dim not in (1, 2):
        raise UsageError(f"rope supports unsqueeze_dim 1 or 2, got {unsqueeze_dim}.")
    if q.dim() != 4 or k.dim() != 4:
        raise UsageError("rope expects 4-d q and k (batch, heads, seq, head_dim).")
    seq_dim = 3 - unsqueeze_dim
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or cos.shape[-1] not in (head_dim, head_dim // 2):
        raise UsageError(
            f"rope needs an even head_dim shared by q and k, and cos/sin of head_dim or "
            f"head_dim / 2; got q {q.shape[-1]}, k {k.shape[-1]}, cos {cos.shape[-1]}."
        )
    if (q.shape[0], q.shape[seq_dim]) != (k.shape[0], k.shape[seq_dim]):
        raise UsageError("rope: q and k must share batch and sequence sizes.")
    if cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise UsageError("rope: cos and sin must have the same (batch, seq, head_dim) shape.")
    if cos.shape[-2] != q.shape[seq_dim] or (
        cos.dim() == 3 and cos.shape[0] not in (1, q.shape[0])
    ):
        raise UsageError(
            f"rope: cos/sin of shape {tuple(cos.shape)} do not fit q and k of batch {q.shape[0]} "
            f"and sequence {q.shape[seq_dim]} (expected ([1 or batch,] seq, head_dim))."
        )
    if q.shape[unsqueeze_dim] == 0 or k.shape[unsqueeze_dim] == 0:
        raise UsageError("rope: q and k need at least one head each.")
    check_floating("rope", q, k, cos, sin)


def _num_warps(block_qh: int, block_kh: int, block_d: int) -> int:
    """Warps for one program, which moves (q heads + k heads) x head_dim elements: one warp per
    512 elements, at most 8 (chosen by `bench_kernels.py --tune --ops rope`)."""
    per_512 = max(1, (block_qh + block_kh) * block_d * 2 // 512)
    return min(8, 1 << (per_512.bit_length() - 1))


# CUDA's limit on grid axis 1, which numbers the batch rows: larger batches take several launches.
MAX_GRID_Y = 65535


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    backward: bool,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len = q.shape[0], q.shape[3 - unsqueeze_dim]
    n_q_heads, n_k_heads = q.shape[unsqueeze_dim], k.shape[unsqueeze_dim]
    head_dim = q.shape[-1]
    # The kernel takes head_dim at unit stride and one set of strides for cos and sin: copies
    # only for tensors not laid out so (transformers' are; in-place callers check q and k).
    if not in_place:
        q, k = _unit_last_stride(q), _unit_last_stride(k)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    # (batch or 1, seq, D) -> (batch, seq, D) with stride 0 where broadcast: no copy.
    table_dim = cos.shape[-1]
    cos = cos.expand(batch, seq_len, table_dim)
    sin = sin.expand(batch, seq_len, table_dim)
    q_out, k_out = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
    if q.numel() == 0:
        return q_out, k_out
    block_d = next_power_of_2(head_dim // 2)
    block_qh, block_kh = next_power_of_2(n_q_heads), next_power_of_2(n_k_heads)
    strides = (
        *_bsh_strides(q, unsqueeze_dim),
        *_bsh_strides(k, unsqueeze_dim),
        *_bsh_strides(q_out, unsqueeze_dim),
        *_bsh_strides(k_out, unsqueeze_dim),
        *cos.stride()[:2],
    )
    constants = {
        "HALF": head_dim // 2,
        "COS_HALF": head_dim // 2 if table_dim == head_dim else 0,
        "BLOCK_QH": block_qh,
        "BLOCK_KH": block_kh,
        "BLOCK_D": block_d,
        "BACKWARD": backward,
        "num_warps": _num_warps(block_qh, block_kh, block_d),
    }
    with on_device(q):
        for first_batch in range(0, batch, MAX_GRID_Y):
            grid = (seq_len, min(MAX_GRID_Y, batch - first_batch))
            _rope_kernel[grid](
                q, k, q_out, k_out, cos, sin, first_batch, n_q_heads, n_k_heads, *strides,
                **constants,
            )  # fmt: skip
    return q_out, k_out


# --- op declarations (memplan.kernels._op) --------------------------------------------------


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out); in place (eager path only: rope() turns it off where the custom op runs)
    they are new views of q's and k's rotated memory. Not marked dirty (autograd refuses that
    for two outputs that are views, which q and k are): the caller guarantees nothing reads the
    unrotated q and k, as with Liger-Kernel's RoPE."""
    q_out, k_out = _launch(q, k, cos, sin, unsqueeze_dim, backward=False, in_place=in_place)
    if in_place:
        return q_out.view_as(q_out), k_out.view_as(k_out)
    return q_out, k_out


def _forward_fake(q, k, cos, sin, unsqueeze_dim, in_place):
    return torch.empty_like(q), torch.empty_like(k)


def _backward_fake(dq, dk, cos, sin, unsqueeze_dim):
    return torch.empty_like(dq), torch.empty_like(dk)


@launcher("rope_backward", fake=_backward_fake)
def _backward_launch(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed rotation of dq and dk, into new tensors."""
    return _launch(dq, dk, cos, sin, unsqueeze_dim, backward=True)


def _setup_context(ctx, inputs, output):
    """Saves cos and sin only."""
    _q, _k, cos, sin, unsqueeze_dim, in_place = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim, ctx.in_place = unsqueeze_dim, in_place


@once_differentiable  # linear in dq and dk: a second derivative only through them
def _backward(ctx, dq, dk):
    """Gradients of (q, k, cos, sin, unsqueeze_dim, in_place)."""
    cos, sin = ctx.saved_tensors
    # In place only into gradients that own their elements (not expanded ones, e.g. from a
    # sum's backward).
    if (
        ctx.in_place
        and not use_custom_op(dq)
        and _in_place_layout(dq, dk)
        and not memory_overlaps(dq, dk)
    ):
        dq, dk = _launch(dq, dk, cos, sin, ctx.unsqueeze_dim, backward=True, in_place=True)
    else:
        dq, dk = _backward_launch(dq, dk, cos, sin, ctx.unsqueeze_dim)
    return dq, dk, None, None, None, None


def _in_place_layout(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can rotate these tensors in their own memory: head_dim at unit stride
    and no element shared by several positions (an expanded tensor would be rotated once per
    position, each rotation reading another's output)."""
    for t in tensors:
        strides = t.stride()
        if strides[-1] != 1:
            return False
        if 0 in strides and any(s == 0 and n != 1 for s, n in zip(strides, t.shape, strict=True)):
            return False
    return True


# outputs (q rotated, k rotated)
ROPE = Op("rope", _forward, fake=_forward_fake, setup_context=_setup_context, backward=_backward)


# --- public API -----------------------------------------------------------------------------


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused apply_rotary_pos_emb: q (B, n_heads, S, D), k (B, n_kv_heads, S, D) for
    unsqueeze_dim=1 ((B, S, heads, D) for 2); cos/sin (B or 1, S, D) or (S, D), or D / 2 wide
    (one value per rotated pair, applied to both halves). The rotation
    is computed in fp32 and stored in q's and k's dtype, also where cos/sin are fp32 (under
    autocast; transformers' formula would promote q and k to fp32 there, which attention then
    casts back).

    in_place: rotate q and k in their own memory, and their gradients in dq and dk's (the
    caller must not read the unrotated q, k afterwards; under torch.compile, and for expanded
    q or k, q or k whose head_dim is not at unit stride, or leaves that require grad, the
    out-of-place op runs instead and the returned tensors are new)."""
    _check_shapes(q, k, cos, sin, unsqueeze_dim)
    # A leaf that requires grad (or a view of one) must keep its values: rotated out of place.
    in_place = (
        in_place
        and not use_custom_op(q)
        and _in_place_layout(q, k)
        and may_write_over(q)
        and may_write_over(k)
    )
    return ROPE(q, k, cos, sin, unsqueeze_dim, in_place)
