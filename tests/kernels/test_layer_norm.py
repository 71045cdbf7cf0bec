"""memplan.kernels.layer_norm against its plain-PyTorch reference (fp32 F.layer_norm), on CPU
through the Triton interpreter or on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import layer_norm_saved_bytes
from memplan.kernels.layer_norm import LayerNorm, layer_norm, reference_layer_norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_and_compare(x, w, b, dtype):
    """Forward and backward of memplan vs the reference on fp32 copies."""
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    xr, wr = (t.detach().float().clone().requires_grad_(t.requires_grad) for t in (x, w))
    br = b.detach().float().clone().requires_grad_(b.requires_grad) if b is not None else None
    ref_leaves = [t for t in (xr, wr, br) if t is not None and t.requires_grad]
    ref = reference_layer_norm(xr, wr, br, 1e-5)
    y = layer_norm(x, w, b, 1e-5)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, ref) <= TOL[dtype]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(ref, ref_leaves, dy.float())
    for g, r, leaf in zip(got, want, leaves, strict=True):
        assert g.dtype == leaf.dtype
        assert rel(g, r) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
def test_matches_reference(device, dtype, has_bias):
    torch.manual_seed(0)
    # an offset mean and a large scale: the two-pass variance must not lose precision
    x = (torch.randn(5, 123, 127, device=device) * 3 + 2).to(dtype).requires_grad_()
    w = (torch.randn(127, device=device) * 0.5 + 1).to(dtype).requires_grad_()
    b = (torch.randn(127, device=device)).to(dtype).requires_grad_() if has_bias else None
    run_and_compare(x, w, b, dtype)


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_non_contiguous_input(device, layout):
    torch.manual_seed(2)
    if layout == "row_slice":
        x = torch.randn(5, 123, 200, device=device)[..., 3:130]
    else:
        x = torch.randn(127, 5, 123, device=device).permute(1, 2, 0)
    assert not x.is_contiguous()
    x.requires_grad_()
    w = torch.randn(127, device=device, requires_grad=True)
    b = torch.randn(127, device=device, requires_grad=True)
    run_and_compare(x, w, b, torch.float32)


def test_frozen_affine_parameters(device):
    x = torch.randn(9, 50, device=device, requires_grad=True)
    w, b = torch.randn(50, device=device), torch.randn(50, device=device)
    run_and_compare(x, w, b, torch.float32)


@settings(max_examples=6, deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=0, max_size=2), hidden=st.integers(8, 300))
def test_shapes_property(lead, hidden):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(*lead, hidden, device=device, requires_grad=True)
    w = torch.randn(hidden, device=device, requires_grad=True)
    b = torch.randn(hidden, device=device, requires_grad=True)
    run_and_compare(x, w, b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_contract(device, dtype, saved_storage_bytes):
    rows, hidden = 37, 96
    norm = LayerNorm(hidden).to(device, dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    saved = saved_storage_bytes(lambda: norm(x), norm)
    assert saved == layer_norm_saved_bytes(rows, hidden, dtype.itemsize)


def test_backward_allocates_only_the_gradients(new_storages):
    """dx, dW and dB (and the weight-gradient partials) are all backward makes: no zeros for the
    non-differentiable mean and rstd outputs."""
    rows, hidden = 1500, 64
    x = torch.randn(rows, hidden, requires_grad=True)
    weight = torch.randn(hidden, requires_grad=True)
    bias = torch.randn(hidden, requires_grad=True)
    y = layer_norm(x, weight, bias, 1e-5)
    with new_storages() as created:
        y.backward(torch.randn_like(y))
    assert [shape for _, shape in created.sizes if shape == (rows,)] == []


def test_module_matches_torch_layer_norm(device):
    torch.manual_seed(3)
    ours, theirs = LayerNorm(64, eps=1e-5).to(device), torch.nn.LayerNorm(64).to(device)
    with torch.no_grad():
        for p in (ours.weight, ours.bias):
            p.normal_()
        theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, 64, device=device)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert LayerNorm(64, bias=False).bias is None


def test_meta_tensors_take_the_eager_path():
    x = torch.empty(4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = layer_norm(x, w, b, 1e-5)
    assert y.is_meta and y.shape == x.shape and y.dtype == x.dtype
    grads = torch.autograd.grad(y, (x, w, b), torch.empty_like(y))
    assert [g.shape for g in grads] == [x.shape, w.shape, b.shape]


def test_bad_weight_shape_raises_usage_error():
    with pytest.raises(UsageError, match="hidden size"):
        layer_norm(torch.randn(2, 8), torch.ones(7), None, 1e-5)


@pytest.mark.parametrize("n_rows", [28, 33])
def test_paired_partials(device, n_rows):
    """More backward programs than SMs (pairs add dW and dB into shared zeroed rows; an odd
    count leaves the last row single): both sums match the reference."""
    torch.manual_seed(n_rows)
    x = torch.randn(n_rows, 1024, device=device, requires_grad=True)
    w = torch.randn(1024, device=device, requires_grad=True)
    b = torch.randn(1024, device=device, requires_grad=True)
    run_and_compare(x, w, b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_per_step_backward(device, monkeypatch, dtype):
    """The backward with one row per loop step (its configuration from hidden 4096 up), forced
    here on a small odd hidden size with more programs than the interpreter's 4 "SMs" (paired
    partials)."""
    from memplan.kernels import layer_norm as module
    from memplan.kernels._utils import norm_backward_config

    def one_row(n_rows, n_cols, dev, op):
        config = norm_backward_config(n_rows, n_cols, dev, op)
        per_program = -(-n_rows // min(n_rows, 9))
        return config._replace(
            rows=1, n_programs=-(-n_rows // per_program), rows_per_program=per_program
        )

    monkeypatch.setattr(module, "norm_backward_config", one_row)
    torch.manual_seed(3)
    x = (torch.randn(3, 41, 127, device=device) * 2 + 1).to(dtype).requires_grad_()
    w = (torch.randn(127, device=device) * 0.5 + 1).to(dtype).requires_grad_()
    b = torch.randn(127, device=device).to(dtype).requires_grad_()
    run_and_compare(x, w, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["no_weight", "no_weight_no_bias", "bias_only_frozen"])
def test_absent_weight_and_bias_as_torch(device, dtype, affine):
    """weight=None (nn.LayerNorm(elementwise_affine=False)) raised AttributeError; as
    F.layer_norm, no weight is a scale of 1, no bias a shift of 0, and no gradient comes back
    for an absent parameter."""
    torch.manual_seed(4)
    x = (torch.randn(3, 11, 97, device=device) * 2 + 1).to(dtype).requires_grad_()
    b = torch.randn(97, device=device).to(dtype)
    b = None if affine == "no_weight_no_bias" else b.requires_grad_(affine == "no_weight")
    y = layer_norm(x, None, b, 1e-5)
    xr = x.detach().float().requires_grad_()
    br = None if b is None else b.detach().float().requires_grad_(b.requires_grad)
    ref = F.layer_norm(xr, (97,), None, br, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel(y, ref) <= TOL[dtype]
    dy = torch.randn_like(y)
    leaves = [t for t in (x, b) if t is not None and t.requires_grad]
    ref_leaves = [t for t in (xr, br) if t is not None and t.requires_grad]
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(ref, ref_leaves, dy.float())
    for g, r, leaf in zip(got, want, leaves, strict=True):
        assert g.dtype == leaf.dtype and rel(g, r) <= TOL[dtype]


def test_absent_weight_through_the_module_path_and_torch_compile(device):
    """nn.LayerNorm(elementwise_affine=False)'s call, eager and compiled (the custom op)."""
    torch.manual_seed(5)
    theirs = torch.nn.LayerNorm(40, elementwise_affine=False).to(device)
    x = torch.randn(6, 40, device=device, requires_grad=True)
    ref = theirs(x)
    dy = torch.randn_like(ref)
    (dx_ref,) = torch.autograd.grad(ref, x, dy)

    def fused(t):
        return layer_norm(t, theirs.weight, theirs.bias, theirs.eps)

    for fn in (fused, torch.compile(fused, backend="aot_eager", fullgraph=True)):
        y = fn(x)
        (dx,) = torch.autograd.grad(y, x, dy)
        assert rel(y, ref) <= 1e-5 and rel(dx, dx_ref) <= 1e-5


def test_absent_weight_on_meta_tensors():
    """register_fake of the forward and backward ops with weight (and bias) None."""
    x = torch.empty(4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(16, device="meta", dtype=torch.float32, requires_grad=True)
    for bias in (None, b):
        y = layer_norm(x, None, bias, 1e-5)
        assert y.is_meta and y.shape == x.shape and y.dtype == x.dtype
        leaves = (x,) if bias is None else (x, bias)
        grads = torch.autograd.grad(y, leaves, torch.empty_like(y))
        assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in leaves]


def test_absent_weight_saves_what_the_contract_says(device, saved_storage_bytes):
    rows, hidden = 37, 96
    norm = torch.nn.LayerNorm(hidden, elementwise_affine=False).to(device)
    x = torch.randn(rows, hidden, device=device, requires_grad=True)
    saved = saved_storage_bytes(lambda: layer_norm(x, None, None, 1e-5), norm)
    assert saved == layer_norm_saved_bytes(rows, hidden, 4)


def test_module_without_elementwise_affine_matches_torch(device):
    torch.manual_seed(6)
    ours = LayerNorm(32, elementwise_affine=False).to(device)
    theirs = torch.nn.LayerNorm(32, elementwise_affine=False).to(device)
    assert ours.weight is None and ours.bias is None and not list(ours.parameters())
    x = torch.randn(5, 32, device=device)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert "elementwise_affine=False" in repr(ours)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1e-5, "1e-5", True])
def test_bad_eps_raises_usage_error(eps):
    """A negative or nan eps gave NaN rows, a string a TypeError from the launcher."""
    with pytest.raises(UsageError, match="eps must be a finite number"):
        layer_norm(torch.randn(2, 8), torch.ones(8), None, eps)


def test_integer_bias_raises_usage_error():
    """An integer bias was read as floats (F.layer_norm refuses it)."""
    with pytest.raises(UsageError, match="floating-point"):
        layer_norm(torch.randn(2, 8), None, torch.ones(8, dtype=torch.int64), 1e-5)
    with pytest.raises(UsageError, match=r"\(7,\) do not match hidden size 8"):
        layer_norm(torch.randn(2, 8), None, torch.ones(7), 1e-5)
