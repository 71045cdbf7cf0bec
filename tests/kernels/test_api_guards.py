"""What a direct caller of the kernels' public functions can pass that the fused paths must not
get wrong: weights that are views, gradients the caller still holds, aliased or retained
inputs of the in-place backwards, integer tensors, meta tensors."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from memplan.errors import UsageError
from memplan.kernels.cross_entropy import CrossEntropyLoss, cross_entropy, reference_cross_entropy
from memplan.kernels.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
)
from memplan.kernels.layer_norm import layer_norm, reference_layer_norm
from memplan.kernels.rms_norm import RMSNorm, reference_rms_norm, rms_norm
from memplan.kernels.rope import reference_rope, rope
from memplan.kernels.swiglu import reference_swiglu, swiglu


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_norms_read_weights_that_are_views(device, view):
    x = torch.randn(4, 8, device=device)
    if view == "strided":
        weight, bias = torch.randn(16, device=device)[::2], torch.randn(24, device=device)[::3]
    else:
        weight, bias = (torch.tensor([1.5], device=device).expand(8),) * 2
    assert rel(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6)) <= 1e-6
    got = layer_norm(x, weight, bias, 1e-5)
    assert rel(got, reference_layer_norm(x, weight, bias, 1e-5)) <= 1e-6


def test_rms_norm_leaves_the_callers_gradient_alone_by_default(device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    weight = torch.randn(8, device=device, requires_grad=True)
    grad = torch.randn(4, 8, device=device)
    before = grad.clone()
    rms_norm(x, weight, 1e-6).backward(grad)
    assert torch.equal(grad, before)


def test_rms_norm_on_a_residual_branch_gets_the_residual_gradient_right(device):
    """out = h + norm(lin(h)): the add hands one gradient tensor to both branches."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(device)
    norm = RMSNorm(8, eps=1e-6, offset=1.0, casting="gemma").to(device)
    h = torch.randn(4, 8, device=device, requires_grad=True)
    ((h + norm(lin(h))) ** 2).sum().backward()
    h_ref = h.detach().clone().requires_grad_()
    out_ref = h_ref + reference_rms_norm(lin(h_ref), norm.weight, 1e-6, offset=1.0, casting="gemma")
    (out_ref**2).sum().backward()
    assert rel(h.grad, h_ref.grad) <= 1e-5


def test_in_place_glu_backward_with_gate_and_up_one_tensor(device):
    y = torch.randn(6, 10, device=device)
    leaf, ref_leaf = y.clone().requires_grad_(), y.clone().requires_grad_()
    one = leaf * 1
    swiglu(one, one, in_place_backward=True).sum().backward()
    ref_one = ref_leaf * 1
    reference_swiglu(ref_one, ref_one).sum().backward()
    assert rel(leaf.grad, ref_leaf.grad) <= 1e-5


def test_in_place_glu_backward_refuses_a_second_backward(device):
    gate = torch.randn(6, 10, device=device, requires_grad=True) * 1
    up = torch.randn(6, 10, device=device, requires_grad=True) * 1
    out = swiglu(gate, up, in_place_backward=True).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_in_place_glu_backward_keeps_a_gate_that_needs_no_gradient(device):
    gate = torch.randn(6, 10, device=device)
    kept = gate.clone()
    up = torch.randn(6, 10, device=device, requires_grad=True) * 1
    swiglu(gate, up, in_place_backward=True).sum().backward()
    assert torch.equal(gate, kept)


def test_in_place_rope_backward_with_one_gradient_for_q_and_k(device):
    batch, heads, seq, head_dim = 1, 2, 5, 8
    q = torch.randn(batch, heads, seq, head_dim, device=device, requires_grad=True)
    k = torch.randn(batch, heads, seq, head_dim, device=device, requires_grad=True)
    angle = torch.randn(batch, seq, head_dim // 2, device=device).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()
    grad = torch.randn(batch, heads, seq, head_dim, device=device)
    out_q, out_k = rope(q * 1, k * 1, cos, sin, in_place=True)
    torch.autograd.backward([out_q, out_k], [grad, grad])
    q_ref, k_ref = q.detach().requires_grad_(), k.detach().requires_grad_()
    torch.autograd.backward(list(reference_rope(q_ref, k_ref, cos, sin)), [grad, grad])
    assert rel(q.grad, q_ref.grad) <= 1e-6 and rel(k.grad, k_ref.grad) <= 1e-6


def test_integer_inputs_are_refused(device):
    ints = torch.ones(4, 8, dtype=torch.int64, device=device)
    with pytest.raises(UsageError, match="rms_norm needs floating-point tensors"):
        rms_norm(ints, torch.ones(8, device=device), 1e-6)
    with pytest.raises(UsageError, match="layer_norm needs floating-point tensors"):
        layer_norm(ints, torch.ones(8, device=device), None, 1e-5)
    with pytest.raises(UsageError, match="needs floating-point tensors"):
        swiglu(ints, ints)


def test_flce_on_meta_tensors():
    """Meta targets hold no values: every row is taken to have one. Meta tensors have no
    autocast: the caller names its dtype, and hidden and weight are cast to it, as under CUDA
    autocast."""
    hidden = torch.empty(6, 16, device="meta", requires_grad=True)
    weight = torch.empty(50, 16, device="meta", requires_grad=True)
    target = torch.zeros(6, dtype=torch.long, device="meta")
    loss = fused_linear_cross_entropy(hidden, weight, target)
    assert loss.device.type == "meta" and loss.shape == ()
    (d_weight,) = torch.autograd.grad(loss, weight)
    assert d_weight.dtype == torch.float32
    cast = fused_linear_cross_entropy(hidden, weight, target, autocast=torch.bfloat16)
    inputs = {type(node).__name__ for node, _ in cast.grad_fn.next_functions if node}
    assert inputs == {"ToCopyBackward0"}


def test_meta_tensors_overlap_where_their_storage_spans_do():
    """Meta tensors have no addresses (data_ptr() is 0 for all): overlap is read from their
    storages and offsets."""
    from memplan.kernels._utils import memory_overlaps

    t = torch.empty(8, 4, device="meta")
    assert memory_overlaps(t[:5], t[4:]) and not memory_overlaps(t[:4], t[4:])
    assert not memory_overlaps(t, torch.empty(8, 4, device="meta"))


def test_rope_refuses_cos_sin_that_do_not_fit(device):
    q = torch.randn(2, 4, 5, 8, device=device)
    k = torch.randn(2, 2, 5, 8, device=device)
    angle = torch.randn(3, 5, 8, device=device)
    with pytest.raises(UsageError, match=r"cos/sin of shape \(3, 5, 8\) do not fit"):
        rope(q, k, angle.cos(), angle.sin())
    short = torch.randn(4, 8, device=device)
    with pytest.raises(UsageError, match=r"cos/sin of shape \(4, 8\) do not fit"):
        rope(q, k, short.cos(), short.sin())
    with pytest.raises(UsageError, match="at least one head"):
        rope(q, k[:, :0], angle[:1].cos(), angle[:1].sin())


# Each loss entry point with one option set: the functions and the modules' constructors.
LOSS_ENTRY_POINTS = {
    "cross_entropy": lambda **o: cross_entropy(torch.randn(3, 5), torch.tensor([0, 4, 2]), **o),
    "fused_linear_cross_entropy": lambda **o: fused_linear_cross_entropy(
        torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, 2]), **o
    ),
    "CrossEntropyLoss": lambda **o: CrossEntropyLoss(**o),
    "FusedLinearCrossEntropyLoss": lambda **o: FusedLinearCrossEntropyLoss(**o),
}


@pytest.mark.parametrize("entry", list(LOSS_ENTRY_POINTS))
@pytest.mark.parametrize(
    "softcap",
    [float("inf"), float("-inf"), float("nan"), 0.0, -30.0, True, "30", 3.4e38, 1e31, 1e-31],
)
def test_loss_softcap_must_be_none_or_finite_positive(entry, softcap):
    """softcap=inf gave NaN losses (inf * tanh(x / inf) = inf * 0); True passed as a cap of 1;
    a cap near fp32's max capped every logit to 0 (logits / cap flushed to zero)."""
    with pytest.raises(UsageError, match=r"softcap must be None \(no cap\) or a finite positive"):
        LOSS_ENTRY_POINTS[entry](softcap=softcap)


@pytest.mark.parametrize("entry", list(LOSS_ENTRY_POINTS))
@pytest.mark.parametrize("ignore_index", [True, False, 1.0, "-100", None, 2**64])
def test_loss_ignore_index_must_be_an_int(entry, ignore_index):
    """ignore_index=True passed (bool is an int subclass) and ignored class 1."""
    with pytest.raises(UsageError, match="ignore_index must"):
        LOSS_ENTRY_POINTS[entry](ignore_index=ignore_index)


@pytest.mark.parametrize("entry", list(LOSS_ENTRY_POINTS))
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("z_loss_scale", float("inf")),  # gave an inf or NaN loss
        ("z_loss_scale", "0.1"),  # a TypeError from the comparison
        ("z_loss_scale", True),
        ("label_smoothing", "0.1"),
        ("label_smoothing", True),
    ],
)
def test_loss_numeric_options_are_checked(entry, option, value):
    with pytest.raises(UsageError, match=option):
        LOSS_ENTRY_POINTS[entry](**{option: value})


@pytest.mark.parametrize("entry", ["cross_entropy", "fused_linear_cross_entropy"])
@pytest.mark.parametrize("count", [float("inf"), float("nan"), "4"])
def test_loss_num_items_in_batch_must_be_finite_positive(entry, count):
    """num_items_in_batch=inf gave a loss of 0 and zero gradients; "4" a TypeError."""
    with pytest.raises(UsageError, match="num_items_in_batch"):
        LOSS_ENTRY_POINTS[entry](num_items_in_batch=count)


@pytest.mark.parametrize("entry", ["cross_entropy", "fused_linear_cross_entropy"])
def test_loss_options_as_numpy_scalars_match_python_numbers(device, entry):
    """numpy scalars (a config read with numpy, np.int64 from an array) give the Python
    numbers' loss; ignore_index=np.int64(-100) was refused as not an integer."""
    python = dict(ignore_index=2, label_smoothing=0.1, softcap=30.0, z_loss_scale=1e-4)
    numpy = dict(ignore_index=np.int64(2), label_smoothing=np.float64(0.1),
                 softcap=np.float32(30.0), z_loss_scale=np.float32(1e-4))  # fmt: skip
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 4, device=device), torch.randn(5, 4, device=device)
    target = torch.tensor([0, 4, 2], device=device)
    if entry == "cross_entropy":
        loss, module = (
            functools.partial(cross_entropy, hidden @ weight.t(), target),
            CrossEntropyLoss,
        )
    else:
        loss = functools.partial(fused_linear_cross_entropy, hidden, weight, target)
        module = FusedLinearCrossEntropyLoss
    assert torch.allclose(loss(**numpy), loss(**python), rtol=1e-6)
    options = module(**numpy).options
    assert type(options.ignore_index) is int and type(options.softcap) is float


def test_loss_ignore_index_as_an_integer_and_softcap_none_still_work(device):
    """What the patched causal-LM forward passes: softcap None (a config's
    final_logit_softcapping of None) means no cap; an integer ignore_index of any int type."""
    logits = torch.randn(4, 7, device=device)
    target = torch.tensor([1, 3, -100, 6], device=device)
    ref = reference_cross_entropy(logits, target)
    assert torch.allclose(cross_entropy(logits, target, softcap=None), ref, rtol=1e-5)
    shifted = torch.tensor([1, 3, 5, 6], device=device)
    got = cross_entropy(logits, shifted, ignore_index=5, softcap=30)
    assert torch.allclose(
        got, reference_cross_entropy(logits, shifted, ignore_index=5, softcap=30), rtol=1e-5
    )
    big = 2**40  # beyond int32: the kernels compare int64 targets
    got = cross_entropy(logits, target.masked_fill(target < 0, big), ignore_index=big)
    assert torch.allclose(got, ref, rtol=1e-5)


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
