"""GeGLU: out = gelu(gate) * up, the gated MLP of Gemma-family models, with GELU's tanh
approximation (hidden_activation "gelu_pytorch_tanh": Gemma 2 and 3) or exact (the original
Gemma's "gelu", which transformers 5 builds as erf GELU).

tanh: gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2/pi). With
z = c (g + 0.044715 g^3) and 0.5 (1 + tanh(z)) = sigmoid(2z) = s (no cancellation for large |z|,
and no tanh needed, which Triton versions spell differently):
    gelu_tanh(g) = g s,   gelu_tanh'(g) = s + 2 g s (1 - s) c (1 + 3 * 0.044715 g^2)
exact: gelu(g) = g Phi(g), Phi(g) = 0.5 (1 + erf(g / sqrt(2))), gelu'(g) = Phi(g) + g phi(g),
phi(g) = exp(-g^2 / 2) / sqrt(2 pi).
    d_gate = d_out * up * gelu'(gate),   d_up = d_out * gelu(gate)

Forward fused, fp32 math inside, output in the input dtype. Only gate and up are saved; backward
recomputes the activation.
Launchers, custom ops, autograd and `in_place_backward` are shared with the other GLU
(memplan.kernels._glu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memplan.errors import UsageError
from memplan.kernels._glu import GatedMLP, GluOp, load_tile, store_tile, tile_of
from memplan.kernels._launch import fast_launch

APPROXIMATIONS = ("tanh", "none")


def reference_geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh"
) -> torch.Tensor:
    """Plain PyTorch, as Hugging Face computes it."""
    return F.gelu(gate, approximate=approximate) * up


# --- Triton kernels -------------------------------------------------------------------------


@triton.jit
def _gelu_and_slope(g, EXACT: tl.constexpr):
    """(gelu(g), gelu'(g)) in fp32."""
    if EXACT:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
        return g * cdf, cdf + g * pdf
    else:
        # sigmoid(2z) = 0.5 (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3): 2 sqrt(2/pi) here
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        return g * s, s + g * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)


@fast_launch
@triton.jit
def _geglu_forward_kernel(
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
    EXACT: tl.constexpr,
):
    rows, cols = tile_of(tl.program_id(0), n_col_blocks, ROWS, BLOCK)
    mask = (rows < n_rows) & (cols < n_cols)
    g = load_tile(gate_ptr, gate_row_stride, rows, cols, mask, EVICTION)
    u = load_tile(up_ptr, up_row_stride, rows, cols, mask, EVICTION)
    gelu, _ = _gelu_and_slope(g, EXACT)
    out = gelu * u
    store_tile(out_ptr, out_row_stride, rows, cols, out, mask)


@fast_launch
@triton.jit
def _geglu_backward_kernel(
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
    EXACT: tl.constexpr,
):
    rows, cols = tile_of(tl.program_id(0), n_col_blocks, ROWS, BLOCK)
    mask = (rows < n_rows) & (cols < n_cols)
    do = load_tile(dout_ptr, dout_row_stride, rows, cols, mask, DOUT_EVICTION)
    g = load_tile(gate_ptr, gate_row_stride, rows, cols, mask, GATE_UP_EVICTION)
    u = load_tile(up_ptr, up_row_stride, rows, cols, mask, GATE_UP_EVICTION)
    gelu, d_gelu = _gelu_and_slope(g, EXACT)
    dg = do * u * d_gelu
    du = do * gelu
    store_tile(dgate_ptr, dgate_row_stride, rows, cols, dg, mask)
    store_tile(dup_ptr, dup_row_stride, rows, cols, du, mask)
    if WRITE_PRODUCT:  # the forward's output again, same expression, for down_proj's dW
        store_tile(product_ptr, product_row_stride, rows, cols, gelu * u, mask)


# --- op, autograd and public API (memplan.kernels._glu) ----------------------------------------

_GEGLU = {
    "tanh": GluOp("geglu", _geglu_forward_kernel, _geglu_backward_kernel, EXACT=False),
    "none": GluOp("geglu_exact", _geglu_forward_kernel, _geglu_backward_kernel, EXACT=True),
}
geglu_forward = _GEGLU["tanh"].forward
geglu_backward = _GEGLU["tanh"].backward


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: str = "tanh",
    in_place_backward: bool = False,
    down: torch.nn.Module | None = None,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """gelu(gate, approximate=approximate) * up, fused ("tanh" or "none", as F.gelu); gate and
    up of one shape and dtype (any leading shape). With `down` (an nn.Linear): down(product),
    the product recomputed in backward instead of kept (memplan.kernels._glu) unless autocast
    is on (gate's device's, or `autocast`, its dtype where the caller knows it)."""
    if approximate not in _GEGLU:
        raise UsageError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    glu = _GEGLU[approximate]
    return glu(gate, up, in_place_backward=in_place_backward, down=down, autocast=autocast)


class GeGLU(GatedMLP):
    """The gated MLP down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)) with the product fused."""

    glu = staticmethod(geglu)
