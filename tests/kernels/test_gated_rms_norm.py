"""memplan.kernels.gated_rms_norm against its plain-PyTorch reference (Hugging Face's
Qwen3_5RMSNormGated formula), on CPU through the Triton interpreter or on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import gated_rms_norm_saved_bytes
from memplan.kernels.gated_rms_norm import gated_rms_norm, reference_gated_rms_norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_and_compare(x, gate, w, dtype):
    """Forward and backward of memplan vs the reference on fp32 copies."""
    xr, gr, wr = (t.detach().float().clone().requires_grad_() for t in (x, gate, w))
    ref = reference_gated_rms_norm(xr, gr, wr, 1e-6)
    y = gated_rms_norm(x, gate, w, 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, ref) <= TOL[dtype]
    dy = torch.randn_like(y)
    grads_ref = torch.autograd.grad(ref, (xr, gr, wr), dy.float())
    grads = torch.autograd.grad(y, (x, gate, w), dy)
    for grad, grad_ref, t in zip(grads, grads_ref, (x, gate, w), strict=True):
        assert grad.dtype == t.dtype and grad.shape == t.shape
        assert rel(grad, grad_ref) <= TOL[dtype]


def leaves(device, dtype, *shape, weight_dtype=None):
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    gate = (torch.randn(*shape, device=device) * 2).to(dtype).requires_grad_()
    w = (torch.randn(shape[-1], device=device) * 0.5 + 1).to(weight_dtype or dtype)
    return x, gate, w.requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 123, 127), (3, 7, 4, 128), (1, 96)])
def test_matches_reference(device, dtype, shape):
    torch.manual_seed(0)
    run_and_compare(*leaves(device, dtype, *shape), dtype)


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_non_contiguous_inputs(device, layout):
    torch.manual_seed(2)

    def strided():
        if layout == "row_slice":  # rows with a stride larger than the row: read in place
            return torch.randn(5, 9, 200, device=device)[..., :127]
        return torch.randn(127, 5, 9, device=device).permute(1, 2, 0)  # copied

    x, gate = strided(), strided()
    assert not x.is_contiguous() and not gate.is_contiguous()
    w = torch.randn(127, device=device, requires_grad=True)
    run_and_compare(x.requires_grad_(), gate.requires_grad_(), w, torch.float32)


def test_fp32_weight_keeps_the_product_in_fp32_like_hf(device):
    """Under autocast the weight is fp32: the weighted product stays fp32, the output is x's
    dtype."""
    torch.manual_seed(3)
    x, gate, w = leaves(device, torch.bfloat16, 6, 64, weight_dtype=torch.float32)
    y = gated_rms_norm(x, gate, w, 1e-6)
    assert y.dtype == torch.bfloat16
    assert rel(y, reference_gated_rms_norm(x, gate, w, 1e-6)) <= 1e-2
    dx, dg, dw = torch.autograd.grad(y, (x, gate, w), torch.randn_like(y))
    assert dx.dtype == dg.dtype == torch.bfloat16 and dw.dtype == torch.float32


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton interpreter truncates fp32->bf16 casts"
)
def test_bf16_matches_hf_rounding(device):
    """On bf16 inputs the kernel rounds where Hugging Face does, so it agrees with the bf16
    reference to about one ulp, gradients included."""
    torch.manual_seed(1)
    x, gate, w = leaves(device, torch.bfloat16, 64, 16, 128)
    y = gated_rms_norm(x, gate, w, 1e-6)
    ref = reference_gated_rms_norm(x, gate, w, 1e-6)
    torch.testing.assert_close(y, ref, rtol=8e-3, atol=1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, gate, w), dy)
    grads_ref = torch.autograd.grad(ref, (x, gate, w), dy)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert rel(grad, grad_ref) <= 8e-3


def test_frozen_weight_and_gate_without_grad(device):
    torch.manual_seed(4)
    x, gate, w = leaves(device, torch.float32, 3, 17, 40)
    w.requires_grad_(False)
    gate.requires_grad_(False)
    y = gated_rms_norm(x, gate, w, 1e-5)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn_like(y)
    (dxr,) = torch.autograd.grad(reference_gated_rms_norm(xr, gate, w, 1e-5), xr, dy)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert rel(dx, dxr) <= 1e-5


@settings(max_examples=6, deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=0, max_size=2), width=st.integers(8, 300))
def test_shapes_property(lead, width):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run_and_compare(*leaves(device, torch.float32, *lead, width), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_contract(device, dtype, saved_storage_bytes):
    rows, width = 37, 96
    x, gate, w = leaves(device, dtype, rows, width)
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(w.detach())
    saved = saved_storage_bytes(lambda: gated_rms_norm(x, gate, holder.weight, 1e-6), holder)
    assert saved == gated_rms_norm_saved_bytes(rows, width, dtype.itemsize)


def test_bad_shapes_raise_usage_errors(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(UsageError, match="gate of shape"):
        gated_rms_norm(x, torch.randn(4, 7, device=device), torch.ones(8, device=device), 1e-6)
    with pytest.raises(UsageError, match="weight of shape"):
        gated_rms_norm(x, torch.randn_like(x), torch.ones(7, device=device), 1e-6)
    with pytest.raises(UsageError, match="has none"):
        gated_rms_norm(torch.tensor(1.0), torch.tensor(1.0), torch.ones(1), 1e-6)
