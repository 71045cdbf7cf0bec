"""What every kernel must do, checked over all of them: rows of 0 elements and 0-d inputs as
torch treats them, a second derivative through a kernel refused instead of silently missing its
curvature, and in-place options that leave leaves requiring grad alone."""

from __future__ import annotations

import pytest
import torch

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
