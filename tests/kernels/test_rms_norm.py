"""memplan.kernels.rms_norm against its plain-PyTorch reference (HF's LlamaRMSNorm and
GemmaRMSNorm formulas), on CPU through the Triton interpreter or on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import rms_norm_saved_bytes
from memplan.kernels.rms_norm import RMSNorm, reference_rms_norm, rms_norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_and_compare(x, w, dtype, casting="llama", offset=0.0, in_place=True):
    """Forward and backward of memplan vs the reference on fp32 copies; returns (y, dx, dw)."""
    xr, wr = (t.detach().float().clone().requires_grad_() for t in (x, w))
    ref = reference_rms_norm(xr, wr, 1e-6, offset=offset, casting=casting)
    y = rms_norm(x, w, 1e-6, offset=offset, casting=casting, in_place_backward=in_place)
    assert y.shape == x.shape
    assert rel(y, ref) <= TOL[dtype]
    dy = torch.randn_like(y)
    dxr, dwr = torch.autograd.grad(ref, (xr, wr), dy.float())
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert rel(dx, dxr) <= TOL[dtype]
    assert rel(dw, dwr) <= TOL[dtype]
    return y, dx, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("llama", 0.5)])
@pytest.mark.parametrize("in_place", [True, False])
def test_matches_reference(device, dtype, casting, offset, in_place):
    torch.manual_seed(0)
    x = torch.randn(5, 123, 127, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(127, device=device) * 0.5 + (1.0 - offset)).to(dtype).requires_grad_()
    run_and_compare(x, w, dtype, casting, offset, in_place)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton interpreter truncates fp32->bf16 casts"
)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_bf16_matches_hf_rounding(device, casting):
    """On bf16 inputs the kernel rounds where HF does (llama: normalized x to bf16 before the
    weight; gemma: once at the end), so it agrees with the bf16 reference to ~1 ulp."""
    torch.manual_seed(1)
    x = torch.randn(7, 300, device=device, dtype=torch.bfloat16)
    w = (torch.randn(300, device=device) * 0.5 + 1).to(torch.bfloat16)
    offset = 1.0 if casting == "gemma" else 0.0
    y = rms_norm(x, w, 1e-6, offset=offset, casting=casting)
    ref = reference_rms_norm(x, w, 1e-6, offset=offset, casting=casting)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=8e-3, atol=1e-5)


def test_fp32_weight_promotes_output_like_hf(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32  # weight(fp32) * normed(bf16), as LlamaRMSNorm
    assert rel(y, reference_rms_norm(x, w, 1e-6)) <= 1e-2  # bf16 rounding of the normed x
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_non_contiguous_input(device, layout):
    torch.manual_seed(2)
    if layout == "row_slice":  # rows with a stride larger than hidden: read in place
        x = torch.randn(5, 123, 200, device=device)[..., :127]
    else:  # hidden not innermost: copied
        x = torch.randn(127, 5, 123, device=device).permute(1, 2, 0)
    assert not x.is_contiguous()
    x.requires_grad_()
    w = torch.randn(127, device=device, requires_grad=True)
    run_and_compare(x, w, torch.float32)


def test_in_place_backward_reuses_dy_only_when_asked(device):
    x = torch.randn(6, 33, device=device, requires_grad=True)
    w = torch.randn(33, device=device, requires_grad=True)
    for in_place in (True, False):
        dy = torch.randn(6, 33, device=device)
        dy_before = dy.clone()
        y = rms_norm(x, w, 1e-6, in_place_backward=in_place)
        (dx,) = torch.autograd.grad(y, x, dy)
        if in_place:
            assert dx.data_ptr() == dy.data_ptr()
        else:
            assert dx.data_ptr() != dy.data_ptr() and torch.equal(dy, dy_before)


def test_weight_without_grad(device):
    x = torch.randn(3, 17, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device)
    y = rms_norm(x, w, 1e-5)
    xr = x.detach().clone().requires_grad_()
    ref = reference_rms_norm(xr, w, 1e-5)
    dy = torch.randn_like(y)
    (dxr,) = torch.autograd.grad(ref, xr, dy)
    (dx,) = torch.autograd.grad(y, x, dy)  # overwrites dy (in_place_backward)
    assert rel(dx, dxr) <= 1e-5


@settings(max_examples=6, deadline=None)
@given(
    lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    hidden=st.integers(8, 300),  # hidden 1 makes dx a pure cancellation (~0)
    casting=st.sampled_from(["llama", "gemma"]),
)
def test_shapes_property(lead, hidden, casting):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(*lead, hidden, device=device, requires_grad=True)
    w = torch.randn(hidden, device=device, requires_grad=True)
    run_and_compare(x, w, torch.float32, casting, 1.0 if casting == "gemma" else 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_contract(device, dtype, saved_storage_bytes):
    rows, hidden = 37, 96
    norm = RMSNorm(hidden).to(device, dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    saved = saved_storage_bytes(lambda: norm(x), norm)
    assert saved == rms_norm_saved_bytes(rows, hidden, dtype.itemsize)


def test_module_forward_and_repr(device):
    gemma = RMSNorm(64, eps=1e-6, offset=1.0, casting="gemma").to(device)
    assert torch.equal(gemma.weight, torch.zeros(64, device=device))
    x = torch.randn(2, 5, 64, device=device)
    torch.testing.assert_close(
        gemma(x), reference_rms_norm(x, gemma.weight, 1e-6, offset=1.0, casting="gemma")
    )
    assert "casting='gemma'" in repr(gemma)


def test_custom_op_path_matches_eager_path(device):
    """torch.ops.memplan.rms_norm (what torch.compile and fake tensors use) and the eager
    autograd.Function give the same values and gradients."""
    x = torch.randn(6, 45, device=device, requires_grad=True)
    w = torch.randn(45, device=device, requires_grad=True)
    dy = torch.randn(6, 45, device=device)
    y_op, rstd = torch.ops.memplan.rms_norm(x, w, 1e-6, 0.0, False, False)
    y_fn = rms_norm(x, w, 1e-6, in_place_backward=False)
    assert rstd.shape == (6,) and not rstd.requires_grad
    assert torch.equal(y_op, y_fn)
    for a, b in zip(torch.autograd.grad(y_op, (x, w), dy), torch.autograd.grad(y_fn, (x, w), dy)):
        assert torch.equal(a, b)


def test_meta_tensors_take_the_eager_path():
    x = torch.empty(4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(16, device="meta", requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    assert y.is_meta and y.shape == x.shape and y.dtype == torch.float32
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert dx.is_meta and dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("sms, partial_rows", [(132, 128), (108, 108), (None, 4)])
def test_the_dw_partials_are_sized_by_the_sm_count_given(sms, partial_rows):
    """Meta tensors have no device to ask for its SMs: the caller names the GPU's (the traced
    step: the catalog's), else the interpreter's 4. 4096 rows of 2048: 2 programs per SM (256
    of 16 rows for 132 SMs), pairs sharing a partial row where they outnumber the SMs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("zeros", "empty", "new_empty"):
                self.made.append(tuple(out.shape))
            return out

    x = torch.empty(4096, 2048, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(2048, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x * 1, w, 1e-6, sm_count=sms)
    with Shapes() as shapes:
        torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert (1, partial_rows, 2048) in shapes.made


def test_bad_arguments_raise_usage_errors():
    x = torch.randn(2, 8)
    with pytest.raises(UsageError, match="casting"):
        rms_norm(x, torch.ones(8), 1e-6, casting="none")
    with pytest.raises(UsageError, match="hidden size"):
        rms_norm(x, torch.ones(7), 1e-6)


# On the interpreter's 4 SMs, 28 and 33 rows take 7 programs (the last partial row single) and
# 29 rows 8 (every partial row paired); 1061 rows (4 * 2 * 132 + 5), more programs than an H100's
# 132 SMs, run under `-m slow`.
@pytest.mark.parametrize(
    "n_rows", [28, 29, 33, pytest.param(4 * 2 * 132 + 5, marks=pytest.mark.slow)]
)
def test_paired_partials_are_exact_and_deterministic(device, n_rows):
    """More backward programs than SMs: pairs of programs add into one zeroed partial row (odd
    program counts leave the last row single). dW matches the reference and repeats bit for
    bit."""
    from memplan.kernels._norm_weight_grad import partial_layout
    from memplan.kernels._utils import norm_backward_config, num_sms

    n_programs = norm_backward_config(n_rows, 1024, num_sms(device), "rms_norm").n_programs
    rows, paired = partial_layout(n_programs, num_sms(device))
    assert rows <= num_sms(device) and paired == (n_programs > num_sms(device))
    torch.manual_seed(n_rows)
    x = torch.randn(n_rows, 1024, device=device, requires_grad=True)
    w = torch.randn(1024, device=device, requires_grad=True)
    _, _, dw = run_and_compare(x, w, torch.float32, in_place=False)
    y = rms_norm(x, w, 1e-6, in_place_backward=False)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, w, dy, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(y, w, dy)[0])


# The default run takes each dtype with each norm, the weight read from the cache in one of the
# two norms per dtype; the other four cases run under `-m slow`.
@pytest.mark.parametrize(
    "dtype, casting, offset, weight_from_cache",
    [
        (torch.float32, "llama", 0.0, False),
        (torch.float32, "gemma", 1.0, True),
        (torch.bfloat16, "llama", 0.0, True),
        (torch.bfloat16, "gemma", 1.0, False),
        pytest.param(torch.float32, "llama", 0.0, True, marks=pytest.mark.slow),
        pytest.param(torch.float32, "gemma", 1.0, False, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, "llama", 0.0, False, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, "gemma", 1.0, True, marks=pytest.mark.slow),
    ],
)
def test_one_row_per_step_backward(device, monkeypatch, dtype, casting, offset, weight_from_cache):
    """The backward with one row per loop step (its configuration from hidden 4096 up; from
    16384 up also reloading the weight per row), forced here on a small odd hidden size, with
    paired partials and dX written over dy."""
    from memplan.kernels import rms_norm as module
    from memplan.kernels._utils import norm_backward_config

    def one_row(n_rows, n_cols, dev, op):
        config = norm_backward_config(n_rows, n_cols, dev, op)
        n_programs = min(n_rows, 2 * 4 + 1)  # more programs than the interpreter's 4 "SMs"
        per_program = -(-n_rows // n_programs)
        return config._replace(
            rows=1,
            n_programs=-(-n_rows // per_program),
            rows_per_program=per_program,
            weight_from_cache=weight_from_cache,
        )

    monkeypatch.setattr(module, "norm_backward_config", one_row)
    torch.manual_seed(2)
    x = torch.randn(3, 41, 127, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(127, device=device) * 0.5 + (1.0 - offset)).to(dtype).requires_grad_()
    run_and_compare(x, w, dtype, casting, offset, in_place=True)
