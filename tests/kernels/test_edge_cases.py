"""Defects found by a ninth review of the kernels, each pinned by a test that failed before its
fix: rows of 0 elements, non-integer targets, in-place results over elements that several rows
or positions share, and second derivatives that were silently missing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memplan.kernels.fused_linear_cross_entropy as flce_module
from memplan.errors import UsageError
from memplan.kernels.cross_entropy import cross_entropy, reference_cross_entropy
from memplan.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    reference_fused_linear_cross_entropy,
)
from memplan.kernels.geglu import geglu, reference_geglu
from memplan.kernels.layer_norm import layer_norm, reference_layer_norm
from memplan.kernels.rms_norm import reference_rms_norm, rms_norm
from memplan.kernels.rope import reference_rope, rope
from memplan.kernels.swiglu import reference_swiglu, swiglu


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# (fused, reference) over x (N, H) and a weight w (H,); H = 0 allowed.
ROW_OPS = {
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: reference_rms_norm(x, w, 1e-6)),
    "rms_norm_gemma": (
        lambda x, w: rms_norm(x, w, 1e-6, offset=1.0, casting="gemma"),
        lambda x, w: reference_rms_norm(x, w, 1e-6, offset=1.0, casting="gemma"),
    ),
    "layer_norm": (
        lambda x, w: layer_norm(x, w, w * 0.5, 1e-5),
        lambda x, w: reference_layer_norm(x, w, w * 0.5, 1e-5),
    ),
    "swiglu": (
        lambda x, w: swiglu(x, (x * w).flip(0)),
        lambda x, w: reference_swiglu(x, (x * w).flip(0)),
    ),
    "geglu": (
        lambda x, w: geglu(x, (x * w).flip(0)),
        lambda x, w: reference_geglu(x, (x * w).flip(0)),
    ),
    "geglu_exact": (
        lambda x, w: geglu(x, (x * w).flip(0), approximate="none"),
        lambda x, w: reference_geglu(x, (x * w).flip(0), "none"),
    ),
}


@pytest.mark.parametrize("op", list(ROW_OPS))
def test_rows_of_zero_elements_give_empty_results_as_torch(device, op):
    """A last dim of 0 was a raw `view` error; torch's ops return empty outputs and gradients."""
    fused, reference = ROW_OPS[op]
    x = torch.randn(2, 3, 0, device=device, requires_grad=True)
    w = torch.randn(0, device=device, requires_grad=True)
    out, ref = fused(x, w), reference(x, w)
    assert out.shape == ref.shape == (2, 3, 0) and out.dtype == ref.dtype
    dx, dw = torch.autograd.grad(out, (x, w), torch.empty_like(out))
    assert dx.shape == x.shape and dw.shape == w.shape


def test_zero_d_inputs(device):
    """A 0-d tensor has no last dim: the norms say so; the GLUs treat it as one element."""
    scalar = torch.tensor(0.7, device=device)
    with pytest.raises(UsageError, match="0-d"):
        rms_norm(scalar, torch.ones(1, device=device), 1e-6)
    with pytest.raises(UsageError, match="0-d"):
        layer_norm(scalar, torch.ones(1, device=device), None, 1e-5)
    up = torch.tensor(-1.3, device=device)
    assert rel(swiglu(scalar, up), reference_swiglu(scalar, up)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_loss_refuses_targets_that_are_not_class_indices(device, dtype):
    """A bool target was cast to classes 0/1 (torch refuses it); FLCE also took float ones."""
    target = torch.ones(3, dtype=dtype, device=device)
    with pytest.raises(UsageError, match="integer class targets"):
        cross_entropy(torch.randn(3, 5, device=device), target)
    with pytest.raises(UsageError, match="integer class targets"):
        fused_linear_cross_entropy(
            torch.randn(3, 4, device=device), torch.randn(5, 4, device=device), target
        )


def test_loss_refuses_empty_classes_and_integer_inputs(device):
    target = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(UsageError, match="at least one class"):
        cross_entropy(torch.randn(3, 0, device=device), target)
    for hidden, weight in [((3, 4), (0, 4)), ((3, 0), (5, 0))]:  # was a ZeroDivisionError
        with pytest.raises(UsageError, match="at least 1"):
            fused_linear_cross_entropy(
                torch.randn(hidden, device=device), torch.randn(weight, device=device), target
            )
    ints = torch.ones(3, 4, dtype=torch.int64, device=device)  # gave a loss on CPU
    with pytest.raises(UsageError, match="floating-point"):
        fused_linear_cross_entropy(ints, torch.ones(5, 4, dtype=torch.int64), target)


def test_in_place_cross_entropy_over_expanded_logits(device):
    """Rows that share their elements (stride 0) each wrote their gradient over the logits the
    others still read: loss 20% off, gradient 127% off."""
    row = torch.randn(1, 37, device=device, requires_grad=True)
    ref_row = row.detach().clone().requires_grad_()
    target = torch.tensor([0, 5, 36, 5, 11], device=device)
    loss = cross_entropy((row * 1).expand(5, 37), target, inplace_grad=True, label_smoothing=0.1)
    ref = reference_cross_entropy(ref_row.expand(5, 37), target, label_smoothing=0.1)
    loss.backward()
    ref.backward()
    assert rel(loss, ref) <= 1e-5 and rel(row.grad, ref_row.grad) <= 1e-5


@pytest.mark.parametrize("shared", ["batch", "seq"])
def test_in_place_rope_over_expanded_q(device, shared):
    """An expanded q (one batch row or one position for all) was rotated once per position,
    each rotation reading another's output, and the caller's tensor changed."""
    batch, heads, seq, head_dim = 2, 2, 4, 8
    shape = (1, heads, seq, head_dim) if shared == "batch" else (batch, heads, 1, head_dim)
    base = torch.randn(shape, device=device)
    kept = base.clone()
    q = base.expand(batch, heads, seq, head_dim)
    k = torch.randn(batch, heads, seq, head_dim, device=device)
    angle = torch.randn(batch, seq, head_dim // 2, device=device).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()
    ref_q, ref_k = reference_rope(q, k, cos, sin)
    out_q, out_k = rope(q, k.clone(), cos, sin, in_place=True)
    assert rel(out_q, ref_q) <= 1e-6 and rel(out_k, ref_k) <= 1e-6
    assert torch.equal(base, kept)


def _ops_of_x(device):
    """name -> (fused f(x), reference f(x)) for x (4, 8): every op as a function of one input."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=gen).to(device)
    weight = torch.randn(11, 8, generator=gen).to(device)
    target = torch.tensor([0, 3, -100, 10], device=device)
    angle = torch.randn(1, 4, 4, generator=gen).to(device).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()

    def heads(x):
        return x.view(1, 4, 1, 8).transpose(1, 2)

    def of_x(fused, ref):
        return (lambda x: fused(x, w)), (lambda x: ref(x, w))

    ops = {name: of_x(*pair) for name, pair in ROW_OPS.items()}
    return ops | {
        "rope": (
            lambda x: rope(heads(x), heads(x * 2), cos, sin)[0],
            lambda x: reference_rope(heads(x), heads(x * 2), cos, sin)[0],
        ),
        "cross_entropy": (
            lambda x: cross_entropy(x @ weight.t(), target, reduction="none"),
            lambda x: reference_cross_entropy(x @ weight.t(), target, reduction="none"),
        ),
        "cross_entropy_inplace": (
            lambda x: cross_entropy(x @ weight.t(), target, inplace_grad=True),
            lambda x: reference_cross_entropy(x @ weight.t(), target),
        ),
        "flce": (
            lambda x: fused_linear_cross_entropy(x, weight, target, softcap=3.0),
            lambda x: reference_fused_linear_cross_entropy(x, weight, target, softcap=3.0),
        ),
        "flce_none": (
            lambda x: fused_linear_cross_entropy(x, weight, target, reduction="none"),
            lambda x: reference_fused_linear_cross_entropy(x, weight, target, reduction="none"),
        ),
    }


OP_NAMES = [*ROW_OPS, "rope", "cross_entropy", "cross_entropy_inplace", "flce", "flce_none"]


@pytest.mark.parametrize("name", OP_NAMES)
def test_second_derivative_through_a_kernel_raises(device, name):
    """create_graph=True took the kernels' gradients as constants: a gradient penalty through
    any op lost that op's curvature without a word (x.grad up to 15 apart from the reference).
    The first derivatives under create_graph are still exact."""
    fused, reference = _ops_of_x(device)[name]
    x = torch.randn(4, 8, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    loss = (fused(x * 1) ** 2).sum() + (x**3).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (g_ref,) = torch.autograd.grad((reference(x_ref * 1) ** 2).sum() + (x_ref**3).sum(), x_ref)
    assert rel(g, g_ref) <= 1e-5
    probe = torch.linspace(-1.0, 2.0, 32, device=device).view(4, 8)
    with pytest.raises(RuntimeError, match="differentiate twice|first derivatives only"):
        (g * probe).sum().backward()


def test_second_derivative_through_rope_without_curvature_is_kept(device):
    """RoPE is linear in q and k: where its gradient output is a constant, its gradient is
    one too, and a double backward through the rest of the graph stays allowed (and exact)."""
    fused, reference = _ops_of_x(device)["rope"]
    results = []
    for f in (fused, reference):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)
        x.requires_grad_()
        (g,) = torch.autograd.grad((f(x * 1) * 3.0).sum() + (x**3).sum(), x, create_graph=True)
        (g * torch.linspace(-1.0, 2.0, 32, device=device).view(4, 8)).sum().backward()
        results.append(x.grad)
    assert rel(*results) <= 1e-6


def _leaf_cases(device):
    """name -> (leaves, fused loss, reference loss) for the in-place options."""
    gen = torch.Generator().manual_seed(3)

    def leaf(*shape):
        return torch.randn(shape, generator=gen).to(device).requires_grad_()

    angle = torch.randn(1, 3, 4, generator=gen).to(device).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()
    target = torch.tensor([0, 4, 2], device=device)
    return {
        "swiglu": (
            [leaf(3, 10), leaf(3, 10)],
            lambda g, u: swiglu(g, u, in_place_backward=True).sum(),
            lambda g, u: reference_swiglu(g, u).sum(),
        ),
        "swiglu_views_of_a_leaf": (
            [leaf(2, 10)],
            lambda p: swiglu(*p.chunk(2), in_place_backward=True).square().sum(),
            lambda p: reference_swiglu(*p.chunk(2)).square().sum(),
        ),
        "rope": (
            [leaf(1, 2, 3, 8), leaf(1, 1, 3, 8)],
            lambda q, k: sum(t.square().sum() for t in rope(q, k, cos, sin, in_place=True)),
            lambda q, k: sum(t.square().sum() for t in reference_rope(q, k, cos, sin)),
        ),
        "cross_entropy": (
            [leaf(3, 5)],
            lambda x: cross_entropy(x, target, inplace_grad=True),
            lambda x: reference_cross_entropy(x, target),
        ),
    }


@pytest.mark.parametrize("case", ["swiglu", "swiglu_views_of_a_leaf", "rope", "cross_entropy"])
def test_in_place_options_leave_leaves_that_require_grad_alone(device, case):
    """A leaf that requires grad (a parameter), or a view of one, took the values of its
    gradient: swiglu's in-place backward made `gate` its own `.grad` (an optimizer step then
    read the gradient as the weight), in-place RoPE and cross entropy overwrote the leaf.
    torch refuses its own in-place ops there; the kernels now work out of place instead."""
    leaves, run, reference = _leaf_cases(device)[case]
    kept = [t.detach().clone() for t in leaves]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    run(*leaves).backward()
    reference(*twins).backward()
    for t, before, twin in zip(leaves, kept, twins, strict=True):
        assert torch.equal(t.detach(), before)
        assert t.grad.data_ptr() != t.data_ptr() and rel(t.grad, twin.grad) <= 1e-5


# hypothesis draws outside pytest's fixtures: the device is fixed here as the fixture fixes it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    schedule=st.sampled_from(["one_pass", "one_pass_fp32_acc", "two_pass"]),
    has_bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    num_items=st.sampled_from([None, 5, "tensor"]),
    all_options=st.booleans(),
    needs_grad=st.sampled_from([(1, 1, 1), (1, 0, 1), (0, 1, 0), (0, 0, 1)]),
    ignored=st.sampled_from(["some", "first_chunk", "all"]),
    chunk=st.sampled_from([2, 4, 9]),
    per_token=st.booleans(),
)
def test_flce_option_combinations(
    schedule, has_bias, reduction, num_items, all_options, needs_grad, ignored, chunk, per_token
):
    """Every schedule with bias, per-row scales ('none'), kept rows, frozen inputs, chunks that
    do not divide the rows or hold no target, and num_items_in_batch, against the reference."""
    if reduction != "mean":
        num_items = None
    gen = torch.Generator().manual_seed(chunk)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(37, 8, generator=gen) / 2
    bias = torch.randn(37, generator=gen) / 2 if has_bias else None
    target = torch.randint(0, 37, (9,), generator=gen)
    target[{"some": slice(5, 6), "first_chunk": slice(0, 4), "all": slice(None)}[ignored]] = -100
    hidden, weight, target = hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE)
    bias = bias.to(DEVICE) if bias is not None else None
    options = {
        "reduction": reduction,
        "num_items_in_batch": torch.tensor(5, device=DEVICE)
        if num_items == "tensor"
        else num_items,
    }
    if all_options:
        options |= {"label_smoothing": 0.2, "softcap": 2.5, "z_loss_scale": 1e-2}
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    leaves = [t.clone().requires_grad_(bool(g)) for t, g in zip(inputs, needs_grad)]
    twins = [t.clone().requires_grad_(bool(g)) for t, g in zip(inputs, needs_grad)]
    if bias is None:
        leaves.append(None)
        twins.append(None)
    original = flce_module.flce_schedule
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            flce_module,
            "flce_schedule",
            lambda *a, **k: schedule if k["weight_requires_grad"] else original(*a, **k),
        )
        out = fused_linear_cross_entropy(
            *leaves[:2], target, leaves[2], chunk_size=chunk, return_per_token_loss=per_token,
            **options,
        )  # fmt: skip
    ref = reference_fused_linear_cross_entropy(*twins[:2], target, twins[2], **options)
    loss = out[0] if per_token else out
    if per_token:
        per_row = options | {"reduction": "none", "num_items_in_batch": None}
        with torch.no_grad():
            rows = reference_fused_linear_cross_entropy(*twins[:2], target, twins[2], **per_row)
        assert torch.allclose(out[1], rows, rtol=1e-5, atol=1e-6)
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    if not ref.requires_grad:  # no input needs a gradient (bias-free, both frozen)
        assert not loss.requires_grad
        return
    grad_out = (torch.rand(ref.shape, generator=gen) + 0.5).to(DEVICE)
    loss.backward(grad_out)
    ref.backward(grad_out)
    for got, want in zip(leaves, twins):
        if got is not None and got.requires_grad:
            assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("count", [torch.tensor([3, 4]), torch.tensor(True)])
def test_num_items_in_batch_tensor_of_one_number(device, count):
    """Two counts were a raw reshape error, a bool tensor counted as 1 token."""
    logits, target = torch.randn(3, 5, device=device), torch.tensor([0, 1, 2], device=device)
    with pytest.raises(UsageError, match="one-element numeric tensor"):
        cross_entropy(logits, target, num_items_in_batch=count.to(device))
    with pytest.raises(UsageError, match="one-element numeric tensor"):
        fused_linear_cross_entropy(
            torch.randn(3, 4, device=device), torch.randn(5, 4, device=device), target,
            num_items_in_batch=count.to(device),
        )  # fmt: skip


@pytest.mark.parametrize("softcap", [0.5, 30.0, 1e6, 1e30])
def test_softcap_tanh_is_accurate_for_large_caps(device, softcap):
    """tanh(x / cap) came from 1 - exp(-2|x| / cap), which cancels for a small argument: a cap
    of 1e6 gave gradients 0.6% off (1e8: 28%); now within fp32 rounding of the reference."""
    torch.manual_seed(7)
    logits = torch.randn(6, 70, device=device) * 3
    target = torch.randint(0, 70, (6,), device=device)
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy(leaf, target, softcap=softcap)
    ref = reference_cross_entropy(ref_leaf, target, softcap=softcap)
    loss.backward()
    ref.backward()
    assert rel(loss, ref) <= 1e-6 and rel(leaf.grad, ref_leaf.grad) <= 1e-5
    hidden = torch.randn(6, 8, device=device, requires_grad=True)
    weight = torch.randn(70, 8, device=device, requires_grad=True)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref_weight = weight.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, target, softcap=softcap)
    ref = reference_fused_linear_cross_entropy(ref_hidden, ref_weight, target, softcap=softcap)
    loss.backward()
    ref.backward()
    assert rel(loss, ref) <= 1e-6
    assert rel(hidden.grad, ref_hidden.grad) <= 1e-5 and rel(weight.grad, ref_weight.grad) <= 1e-5
