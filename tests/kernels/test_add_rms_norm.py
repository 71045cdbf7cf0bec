"""memplan.kernels.rms_norm's fused residual add (add_rms_norm) and its outputs handed to several
consumers (rms_norm_per_consumer), against plain PyTorch: `residual + branch` then the HF norm, with
every consumer's gradient summed by autograd. On CPU through the Triton interpreter or on CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import rms_norm_saved_bytes
from memplan.kernels.rms_norm import (
    add_rms_norm,
    reference_add_rms_norm,
    reference_rms_norm,
    rms_norm_per_consumer,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
INTERPRETED_BF16_ROUNDING = not torch.cuda.is_available()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def fp32_leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().float().clone().requires_grad_() for t in tensors]


def inputs(device, dtype, shape=(5, 123, 127), offset=0.0, seed=0):
    torch.manual_seed(seed)
    residual = torch.randn(*shape, device=device, dtype=dtype)
    branch = torch.randn(*shape, device=device, dtype=dtype)
    weight = (torch.randn(shape[-1], device=device) * 0.5 + (1.0 - offset)).to(dtype)
    return residual, branch, weight


# The default run takes each dtype with each norm, and one and three consumers, in place and not;
# the other combinations run under `-m slow`.
DEFAULT_ADD_NORM_CASES = {
    (torch.float32, "llama", 1, False),
    (torch.float32, "gemma", 3, True),
    (torch.bfloat16, "llama", 3, True),
    (torch.bfloat16, "gemma", 1, False),
}


@pytest.mark.parametrize(
    "dtype, casting, offset, consumers, in_place",
    [
        pytest.param(
            dtype,
            casting,
            offset,
            consumers,
            in_place,
            marks=()
            if (dtype, casting, consumers, in_place) in DEFAULT_ADD_NORM_CASES
            else pytest.mark.slow,
            id=f"{str(dtype).removeprefix('torch.')}-{casting}-{consumers}-{in_place}",
        )
        for dtype, (casting, offset), consumers, in_place in itertools.product(
            [torch.float32, torch.bfloat16],
            [("llama", 0.0), ("gemma", 1.0)],
            [1, 2, 3],
            [True, False],
        )
    ],
)
def test_add_rms_norm_matches_reference(device, dtype, casting, offset, consumers, in_place):
    residual, branch, weight = inputs(device, dtype, offset=offset)
    r, b, w = leaves(residual, branch, weight)
    h, ys = add_rms_norm(
        r, b, w, 1e-6, consumers=consumers, offset=offset, casting=casting,
        in_place_backward=in_place,
    )  # fmt: skip
    rr, br, wr = fp32_leaves(residual, branch, weight)
    h_ref, y_ref = reference_add_rms_norm(rr, br, wr, 1e-6, offset=offset, casting=casting)

    assert len(ys) == consumers and h.dtype == dtype and h.shape == residual.shape
    if dtype == torch.float32 or not INTERPRETED_BF16_ROUNDING:
        assert torch.equal(h, residual + branch)  # torch's own add, bit for bit
    else:
        assert rel(h, h_ref) <= TOL[dtype]
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert rel(ys[0], y_ref) <= TOL[dtype]

    grads = [torch.randn_like(ys[0]) for _ in ys]
    dh = torch.randn_like(h)
    want = torch.autograd.grad(
        (h_ref, y_ref), (rr, br, wr), (dh.float(), sum(g.float() for g in grads))
    )
    got = torch.autograd.grad((h, *ys), (r, b, w), (dh, *grads))  # may overwrite grads[0]
    assert torch.equal(got[0], got[1])  # both summands get the sum's gradient
    for g, g_ref in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert rel(g, g_ref) <= TOL[dtype]


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("consumers", [2, 3])
def test_consumed_norm_sums_its_consumers_gradients(device, casting, offset, consumers):
    residual, _, weight = inputs(device, torch.float32, shape=(3, 7, 200), offset=offset)
    x, w = leaves(residual, weight)
    ys = rms_norm_per_consumer(x, w, 1e-6, consumers=consumers, offset=offset, casting=casting)
    xr, wr = fp32_leaves(residual, weight)
    y_ref = reference_rms_norm(xr, wr, 1e-6, offset=offset, casting=casting)
    # every consumer a different function of its view, as q, k and v projections are
    mats = [torch.randn(200, 11, device=device) for _ in ys]
    loss = sum(((y @ m).sin()).sum() for y, m in zip(ys, mats, strict=True))
    loss_ref = sum(((y_ref @ m).sin()).sum() for m in mats)
    for g, g_ref in zip(torch.autograd.grad(loss, (x, w)), torch.autograd.grad(loss_ref, (xr, wr))):
        assert rel(g, g_ref) <= TOL[torch.float32]
    assert all(y._base is ys[0] for y in ys[1:])


def test_consumers_without_gradient_and_unused_outputs(device):
    """Consumers that give no gradient are skipped; with none at all, the residual's gradient
    passes through unchanged and the weight's is zero."""
    residual, branch, weight = inputs(device, torch.float32, shape=(9, 64))
    r, b, w = leaves(residual, branch, weight)
    h, ys = add_rms_norm(r, b, w, 1e-6, consumers=3)
    dh = torch.randn_like(h)
    dr, db, dw = torch.autograd.grad(h, (r, b, w), dh, retain_graph=True)
    assert torch.equal(dr, dh) and torch.equal(db, dh) and not dw.any()

    g = torch.randn_like(h)
    got = torch.autograd.grad((h, ys[1]), (r, w), (dh, g))
    rr, br, wr = fp32_leaves(residual, branch, weight)
    h_ref, y_ref = reference_add_rms_norm(rr, br, wr, 1e-6)
    want = torch.autograd.grad((h_ref, y_ref), (rr, wr), (dh, g))
    for a, b_ in zip(got, want, strict=True):
        assert rel(a, b_) <= 1e-5


def test_non_contiguous_inputs(device):
    torch.manual_seed(3)
    residual = torch.randn(64, 12, device=device).t()  # (12, 64), column-major
    branch = torch.randn(12, 128, device=device)[:, ::2]  # row stride 128, column stride 2
    weight = torch.randn(64, device=device)
    r, b, w = leaves(residual, branch, weight)
    h, (y,) = add_rms_norm(r, b, w, 1e-6)
    rr, br, wr = fp32_leaves(residual, branch, weight)
    h_ref, y_ref = reference_add_rms_norm(rr, br, wr, 1e-6)
    assert torch.equal(h, h_ref) and rel(y, y_ref) <= 1e-5
    dy = torch.randn(64, 12, device=device).t()
    got = torch.autograd.grad((h, y), (r, b, w), (dy, dy))
    want = torch.autograd.grad((h_ref, y_ref), (rr, br, wr), (dy, dy))
    for a, b_ in zip(got, want, strict=True):
        assert rel(a, b_) <= 1e-5


def test_custom_op_path_matches_eager_path(device):
    """torch.ops.memplan.add_rms_norm (what torch.compile and fake tensors use) gives the
    eager function's values and gradients."""
    residual, branch, weight = inputs(device, torch.float32, shape=(6, 45))
    r1, b1, w1 = leaves(residual, branch, weight)
    r2, b2, w2 = leaves(residual, branch, weight)
    h_op, y_op, rstd = torch.ops.memplan.add_rms_norm(r1, b1, w1, 1e-6, 0.0, False, False)
    h_fn, (y_fn,) = add_rms_norm(r2, b2, w2, 1e-6)
    assert rstd.shape == (6,) and not rstd.requires_grad
    assert torch.equal(h_op, h_fn) and torch.equal(y_op, y_fn)
    dh, dy = torch.randn_like(h_op), torch.randn_like(y_op)
    got = torch.autograd.grad((h_op, y_op), (r1, b1, w1), (dh, dy))
    want = torch.autograd.grad((h_fn, y_fn), (r2, b2, w2), (dh, dy))
    for a, b_ in zip(got, want, strict=True):
        assert torch.equal(a, b_)


def test_meta_tensors_take_the_eager_path():
    r = torch.empty(4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    b = torch.empty(4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    h, ys = add_rms_norm(r, b, w, 1e-6, consumers=2)
    assert h.is_meta and len(ys) == 2 and ys[0].shape == r.shape
    dr, db, dw = torch.autograd.grad((h, ys[0]), (r, b, w), (torch.empty_like(h),) * 2)
    assert dr.shape == r.shape and db.shape == b.shape and dw.shape == w.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_the_norm_contract(device, dtype, saved_storage_bytes):
    """The fused op saves what the norm after a plain add saves: the sum (the next residual
    stream) and the fp32 inverse RMS per row."""
    rows, hidden = 37, 96
    residual, branch, weight = inputs(device, dtype, shape=(rows, hidden))
    r, b = leaves(residual, branch)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(weight)

    def run():
        return add_rms_norm(r, b, norm.weight, 1e-6, consumers=3)

    saved = saved_storage_bytes(run, norm)
    assert saved == rms_norm_saved_bytes(rows, hidden, dtype.itemsize)


def test_bad_arguments_raise_usage_errors():
    x = torch.randn(2, 8)
    with pytest.raises(UsageError, match="one shape and dtype"):
        add_rms_norm(x, torch.randn(2, 7), torch.ones(8), 1e-6)
    with pytest.raises(UsageError, match="one shape and dtype"):
        add_rms_norm(x, x.double(), torch.ones(8), 1e-6)
    with pytest.raises(UsageError, match="consumers"):
        rms_norm_per_consumer(x, torch.ones(8), 1e-6, consumers=4)
    with pytest.raises(UsageError, match="consumers"):
        add_rms_norm(x, x, torch.ones(8), 1e-6, consumers=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_branch_the_residual_is_handed_back(device, dtype):
    """add_rms_norm(x, None): h is x itself (a view), and its gradient joins the norm's input
    gradient in the backward's pass, as the first layer's residual stream does."""
    residual, _, weight = inputs(device, dtype, shape=(4, 9, 130))
    x, w = leaves(residual, weight)
    h, ys = add_rms_norm(x, None, w, 1e-6, consumers=2)
    assert h._base is x and torch.equal(h, x)
    xr, wr = fp32_leaves(residual, weight)
    y_ref = reference_rms_norm(xr, wr, 1e-6)
    dh, g1, g2 = (torch.randn_like(h) for _ in range(3))
    want = torch.autograd.grad((xr, y_ref), (xr, wr), (dh.float(), (g1 + g2).float()))
    got = torch.autograd.grad((h, *ys), (x, w), (dh, g1, g2))
    for g, g_ref in zip(got, want, strict=True):
        assert rel(g, g_ref) <= TOL[dtype]
