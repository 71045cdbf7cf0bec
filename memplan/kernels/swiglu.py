"""SwiGLU: out = silu(gate) * up, the gated MLP of Llama-family models (act_fn(gate_proj(x)) *
up_proj(x) with hidden_act "silu").

Forward fused, fp32 math inside, output in the input dtype. Only gate and up are saved; backward
recomputes the activation (s = sigmoid(g), silu'(g) = s * (1 + g * (1 - s))):
    d_gate = d_out * up * silu'(gate),   d_up = d_out * silu(gate)
Launchers, custom ops, autograd and `in_place_backward` are shared with the other GLU
(memplan.kernels._glu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memplan.kernels._glu import GatedMLP, GluOp, load_tile, store_tile, tile_of
from memplan.kernels._launch import fast_launch


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch, as Hugging Face computes it."""
    return F.silu(gate) * up


# --- Triton kernels -------------------------------------------------------------------------


@fast_launch
@triton.jit
def _swiglu_forward_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    n_rows,
    n_cols,
    n_col_blocks,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    EVICTION: tl.constexpr,
):
    rows, cols = tile_of(tl.program_id(0), n_col_blocks, ROWS, BLOCK)
    mask = (rows < n_rows) & (cols < n_cols)
    g = load_tile(gate_ptr, gate_row_stride, rows, cols, mask, EVICTION)
    u = load_tile(up_ptr, up_row_stride, rows, cols, mask, EVICTION)
    out = g * tl.sigmoid(g) * u
    store_tile(out_ptr, out_row_stride, rows, cols, out, mask)


@fast_launch
@triton.jit
def _swiglu_backward_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    product_ptr,
    dout_row_stride,
    gate_row_stride,
    up_row_stride,
    dgate_row_stride,
    dup_row_stride,
    product_row_stride,
    n_rows,
    n_cols,
    n_col_blocks,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_PRODUCT: tl.constexpr,
    DOUT_EVICTION: tl.constexpr,
    GATE_UP_EVICTION: tl.constexpr,
):
    rows, cols = tile_of(tl.program_id(0), n_col_blocks, ROWS, BLOCK)
    mask = (rows < n_rows) & (cols < n_cols)
    do = load_tile(dout_ptr, dout_row_stride, rows, cols, mask, DOUT_EVICTION)
    g = load_tile(gate_ptr, gate_row_stride, rows, cols, mask, GATE_UP_EVICTION)
    u = load_tile(up_ptr, up_row_stride, rows, cols, mask, GATE_UP_EVICTION)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = do * u * (sig * (1.0 + g * (1.0 - sig)))
    du = do * silu
    store_tile(dgate_ptr, dgate_row_stride, rows, cols, dg, mask)
    store_tile(dup_ptr, dup_row_stride, rows, cols, du, mask)
    if WRITE_PRODUCT:  # the forward's output again, same expression, for down_proj's dW
        store_tile(product_ptr, product_row_stride, rows, cols, silu * u, mask)


# --- op, autograd and public API (memplan.kernels._glu) ----------------------------------------

_SWIGLU = GluOp("swiglu", _swiglu_forward_kernel, _swiglu_backward_kernel)
swiglu_forward = _SWIGLU.forward
swiglu_backward = _SWIGLU.backward


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    in_place_backward: bool = False,
    down: torch.nn.Module | None = None,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """silu(gate) * up, fused; gate and up of the same shape and dtype (any leading shape).
    With `down` (an nn.Linear): down(product), the product recomputed in backward instead of
    kept (memplan.kernels._glu) unless autocast is on (gate's device's, or `autocast`, its dtype
    where the caller knows it)."""
    return _SWIGLU(gate, up, in_place_backward=in_place_backward, down=down, autocast=autocast)


class SwiGLU(GatedMLP):
    """The gated MLP down_proj(silu(gate_proj(x)) * up_proj(x)) with the product fused."""

    glu = staticmethod(swiglu)
