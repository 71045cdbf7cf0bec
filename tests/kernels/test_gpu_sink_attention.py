"""Sink attention on the GPU: flash attention (bf16, fp16) and the memory-efficient kernel
(fp32) against the plain-PyTorch reference in fp64, forward and the gradients of q, k, v and
the sinks, at gpt-oss's head layout (64 query heads, 8 KV heads, head_dim 64), with and without
its 128-token window; and what autograd saves: q, k, v, the output, the logsumexp and the
philox state, nothing (seq x seq)-sized."""

from __future__ import annotations

import pytest
import torch

from memplan.estimators import kernel_contracts as kc
from memplan.kernels.sink_attention import (
    kernel_for,
    lse_rows,
    reference_sink_attention,
    sink_attention,
)

pytestmark = pytest.mark.gpu

# bf16 / fp16 outputs are rounded once (rel ~4e-3 / 5e-4); the gradients go through bf16 dO
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(b, s, h, kv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, s, kv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, s, kv, d, device="cuda", generator=gen).to(dtype)
    sinks = (torch.randn(h, device="cuda", generator=gen) * 2).to(dtype)
    grad = torch.randn(b, s, h, d, device="cuda", generator=gen).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, sinks)], grad


@pytest.mark.parametrize(
    "dtype,kernel",
    [(torch.bfloat16, "flash"), (torch.float16, "flash"), (torch.float32, "efficient")],
)
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("shape", [(2, 1024, 64, 8, 64), (1, 1000, 16, 2, 64), (3, 300, 8, 8, 32)])
def test_kernel_matches_reference(dtype, kernel, window, shape):
    tensors, grad = make(*shape, dtype)
    assert kernel_for(tensors[0], tensors[2]) == kernel
    exact = [t.detach().double().requires_grad_() for t in tensors]
    scale = shape[-1] ** -0.5
    out = sink_attention(*tensors, window, scale)
    got = (out, *torch.autograd.grad(out, tensors, grad))
    ref_out = reference_sink_attention(*exact, window, scale)
    ref = (ref_out, *torch.autograd.grad(ref_out, exact, grad.double()))
    for name, a, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, strict=True):
        assert a.dtype == dtype and a.shape == r.shape, name
        assert rel(a, r) <= TOL[dtype], (name, rel(a, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transposed_views_take_no_copy(dtype):
    """q, k, v as the patched attention hands them: (batch, seq, heads, head_dim) projections
    seen through (batch, heads, seq, head_dim) transposes and back; the same result as
    contiguous inputs."""
    (q, k, v, sinks), grad = make(2, 256, 16, 4, 64, dtype)
    out = sink_attention(q, k, v, sinks, 128)
    views = [t.detach().transpose(1, 2).transpose(1, 2) for t in (q, k, v)]
    again = sink_attention(*views, sinks.detach(), 128)
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_saved_tensors_are_the_contract(dtype, kernel):
    """What autograd keeps on the GPU is what the estimator's contract counts
    (kernel_contracts.sink_attention_saved: q, k, v, the output, the fp32 logsumexp with
    32-padded rows for the memory-efficient kernel), the philox state (at most 16 bytes each;
    the contract counts SDPA's figure) and the sinks parameter itself."""
    b, s, h, kv, d = 2, 1000, 16, 2, 64
    (q, k, v, sinks), _ = make(b, s, h, kv, d, dtype)
    assert kernel_for(q, v) == kernel
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sink_attention(q, k, v, sinks, 128)
    sizes = [t.numel() * t.element_size() for t in saved if t is not sinks]
    contract = kc.sink_attention_saved(s, h, kv, d, q.element_size(), kernel)
    tensors = sorted(int(per_token * b * s) for name, per_token, _ in contract if per_token)
    assert sorted(n for n in sizes if n > 16) == tensors
    assert all(n <= 16 for n in sizes if n not in tensors)
    assert lse_rows(s, kernel) == (1024 if kernel == "efficient" else s)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_backward_peak_within_the_contract(dtype, kernel):
    """The backward's peak above what is alive before it (the saved tensors, the incoming
    gradient) is at most the contract's transient (kernel_contracts.
    sink_attention_backward_transient) plus the sinks' small row-sum tensors, and not less
    than the contract less 1%: the contract names the kernel's scratch."""
    b, s, h, kv, d = 2, 2048, 64, 8, 64
    (q, k, v, sinks), grad = make(b, s, h, kv, d, dtype)
    out = sink_attention(q, k, v, sinks, None)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(out, (q, k, v, sinks), grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    p = q.element_size()
    contract = sum(kc.sink_attention_backward_transient(b * s, s, h, kv, d, p, kernel))
    small = 4 * b * s * h * 4  # row sums, r, r - 1 and their product, fp32 per row and head
    assert contract * 0.99 <= peak <= contract + small, (peak, contract)
