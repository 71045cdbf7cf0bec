"""Sink attention's decomposition (out = O sigmoid(L - s), the backward through softmax
attention's with grad r and the output) against transformers' own gpt-oss eager attention, on
the CPU, where the op runs its plain-PyTorch path: forward and the gradients of q, k, v and the
sinks, fp64 (to rounding), fp32 and bf16, grouped heads, odd shapes, windows, strided inputs."""

from __future__ import annotations

import types

import pytest
import torch

from memplan.errors import UsageError
from memplan.estimators import kernel_contracts as kc
from memplan.kernels.sink_attention import (
    SINK_ATTENTION,
    kernel_for,
    lse_rows,
    reference_sink_attention,
    sink_attention,
)

modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


def hf_eager(q, k, v, sinks, window, scale):
    """transformers' eager_attention_forward on (batch, seq, heads, head_dim) inputs, with the
    additive mask its masking utils build (0 where attended, the dtype's min elsewhere)."""
    s = q.shape[1]
    module = types.SimpleNamespace(
        sinks=sinks, num_key_value_groups=q.shape[2] // k.shape[2], training=False
    )
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = (j <= i) & (j > i - window if window is not None else True)
    mask = torch.zeros(s, s, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    out, _ = modeling.eager_attention_forward(
        module,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask[None, None].expand(q.shape[0], 1, s, s),
        scaling=scale,
    )
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(b, s, h, kv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen).to(dtype)
    k = torch.randn(b, s, kv, d, generator=gen).to(dtype)
    v = torch.randn(b, s, kv, d, generator=gen).to(dtype)
    sinks = (torch.randn(h, generator=gen) * 2).to(dtype)
    grad = torch.randn(b, s, h, d, generator=gen).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, sinks)], grad


def run(fn, tensors, grad, window, scale):
    out = fn(*tensors, window, scale)
    return (out, *torch.autograd.grad(out, tensors, grad))


SHAPES = [(2, 16, 4, 2, 8), (1, 13, 6, 3, 24), (3, 9, 5, 5, 7), (2, 33, 8, 1, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 1, 4])
def test_fp64_equals_hf_eager_to_rounding(shape, window):
    """In fp64 the decomposition is exact: the forward and all four gradients agree with
    transformers' eager attention to ~1e-13."""
    tensors, grad = inputs(*shape, torch.float64)
    scale = shape[-1] ** -0.5
    ours = run(sink_attention, tensors, grad, window, scale)
    hf = run(hf_eager, tensors, grad, window, scale)
    assert kernel_for(tensors[0], tensors[2]) == "math"
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, hf, strict=True):
        assert rel(a, b) < 1e-12, (name, rel(a, b))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 5])
def test_low_precision_within_hf_eager_error(dtype, tol, window):
    """Against an fp64 reference, the op's error is within `tol`, and no larger than
    transformers' own eager attention's in that dtype (plus tol / 4): its scores and softmax
    run in fp32, HF's in the input dtype."""
    shape = (2, 24, 8, 2, 32)
    tensors, grad = inputs(*shape, dtype)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    scale = shape[-1] ** -0.5
    ours = run(sink_attention, tensors, grad, window, scale)
    hf = run(hf_eager, tensors, grad, window, scale)
    ref = run(hf_eager, exact, grad.double(), window, scale)
    for name, a, b, r in zip(("out", "dq", "dk", "dv", "dsinks"), ours, hf, ref, strict=True):
        assert a.dtype == dtype, name
        assert rel(a, r) <= max(tol, rel(b, r) + tol / 4), (name, rel(a, r), rel(b, r))


def test_reference_is_hf_eager():
    tensors, grad = inputs(2, 11, 4, 2, 8, torch.float32)
    for window in (None, 3):
        a = run(reference_sink_attention, tensors, grad, window, 0.3)
        b = run(hf_eager, tensors, grad, window, 0.3)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_strided_inputs():
    """q, k, v as transposed views of (batch, heads, seq, head_dim) tensors, and with head_dim
    at stride 2 (copied first): the same results as contiguous inputs."""
    (q, k, v, sinks), grad = inputs(2, 10, 4, 2, 8, torch.float64)
    heads_major = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    views = [t.transpose(1, 2) for t in heads_major]
    assert not views[0].is_contiguous()
    wide = [torch.stack([t.detach(), t.detach()], dim=-1).requires_grad_() for t in (q, k, v)]
    strided = [t[..., 0] for t in wide]
    assert strided[0].stride(-1) == 2
    want = run(sink_attention, [q, k, v, sinks], grad, 3, 0.35)
    for leaves, args, back in (
        (heads_major, views, lambda g: g.transpose(1, 2)),
        (wide, strided, lambda g: g[..., 0]),
    ):
        out = sink_attention(*args, sinks, 3, 0.35)
        got = torch.autograd.grad(out, [*leaves, sinks], grad)
        torch.testing.assert_close(out, want[0], rtol=0, atol=1e-14)
        for g, w in zip(got[:3], want[1:4], strict=True):
            torch.testing.assert_close(back(g), w, rtol=0, atol=1e-13)
        torch.testing.assert_close(got[3], want[4], rtol=0, atol=1e-13)


def test_output_is_contiguous_and_saves_no_scores():
    """The output is (batch, seq, heads, head_dim) contiguous (o_proj reshapes it as a view);
    autograd keeps q, k, v, the output, the fp32 logsumexp and the philox state (empty here),
    nothing (seq x seq)-sized."""
    (q, k, v, sinks), _ = inputs(2, 32, 4, 2, 8, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = sink_attention(q, k, v, sinks, 8)
    assert out.is_contiguous() and out.shape == q.shape
    sizes = sorted(t.numel() * t.element_size() for t in saved)
    b, s, h, d = q.shape
    kv = k.numel() * 4
    want = [0, 0, h * 4, b * h * s * 4, kv, kv, q.numel() * 4, q.numel() * 4]
    assert sizes == sorted(want)  # sinks (a parameter) among them
    contract = kc.sink_attention_saved(s, h, k.shape[2], d, 4, "math")
    assert sum(int(n * b * s) + c for _, n, c in contract) == sum(want) - h * 4
    assert lse_rows(s, "math") == s and lse_rows(33, "efficient") == 64


def test_custom_op_matches_eager_path():
    """The torch.library op (torch.compile, meta and fake tensors) and its fake agree with the
    eager path."""
    (q, k, v, sinks), _ = inputs(1, 8, 4, 2, 8, torch.float32)
    torch.library.opcheck(
        SINK_ATTENTION.custom_op,
        (q.detach(), k.detach(), v.detach(), sinks.detach(), 3, 0.3),
        test_utils=("test_schema", "test_faketensor"),
    )
    meta = [torch.empty(t.shape, device="meta", requires_grad=True) for t in (q, k, v, sinks)]
    out = sink_attention(*meta, 3)
    out.sum().backward()
    assert out.shape == q.shape and meta[3].grad.shape == sinks.shape


@pytest.mark.parametrize(
    "shapes,window,match",
    [
        (((2, 8, 4, 8), (2, 8, 3, 8), (2, 8, 3, 8), (4,)), None, "dividing"),
        (((2, 8, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8), (4,)), None, "batch and seq"),
        (((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8), (2,)), None, "one per head"),
        (((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8), (4,)), 0, "at least 1"),
        (((8, 4, 8), (8, 2, 8), (8, 2, 8), (4,)), None, "batch, seq, heads"),
    ],
)
def test_bad_shapes_are_usage_errors(shapes, window, match):
    tensors = [torch.zeros(s) for s in shapes]
    with pytest.raises(UsageError, match=match):
        sink_attention(*tensors, window)
