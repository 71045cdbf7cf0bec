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

from memplan.kernels._glu import GatedMLP, GluOp


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch, as Hugging Face computes it."""
    return F.silu(gate) * up


# --- Triton kernels -------------------------------------------------------------------------


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
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + rows * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    dout_row_stride,
    gate_row_stride,
    up_row_stride,
    dgate_row_stride,
    dup_row_stride,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    do = tl.load(dout_ptr + rows * dout_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = do * u * (sig * (1.0 + g * (1.0 - sig)))
    du = do * silu
    tl.store(
        dgate_ptr + rows * dgate_row_stride + cols, dg.to(dgate_ptr.dtype.element_ty), mask=mask
    )
    tl.store(dup_ptr + rows * dup_row_stride + cols, du.to(dup_ptr.dtype.element_ty), mask=mask)


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
) -> torch.Tensor:
    """silu(gate) * up, fused; gate and up of the same shape and dtype (any leading shape).
    With `down` (an nn.Linear): down(product), the product recomputed in backward instead of
    kept (memplan.kernels._glu)."""
    return _SWIGLU(gate, up, in_place_backward=in_place_backward, down=down)


class SwiGLU(GatedMLP):
    """The gated MLP down_proj(silu(gate_proj(x)) * up_proj(x)) with the product fused."""

    glu = staticmethod(swiglu)
