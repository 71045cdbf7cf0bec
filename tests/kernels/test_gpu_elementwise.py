"""RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU at real sizes on a GPU: forward and backward against
the plain-PyTorch references (fp32: reference in fp64, rel err <= 1e-5; bf16: reference in
fp32, rel err <= 1e-2) and tensors of more than 2**31 elements (int64 offsets). The CPU tests
of tests/kernels (torch.compile over a block with all five ops among them) also run on CUDA:

    python -m pytest -m "gpu or not gpu" tests/kernels/test_rms_norm.py ... (see the report)"""

from __future__ import annotations

import pytest
import torch

from memplan.kernels.geglu import geglu, geglu_backward, reference_geglu
from memplan.kernels.layer_norm import layer_norm, reference_layer_norm
from memplan.kernels.rms_norm import (
    add_rms_norm,
    reference_add_rms_norm,
    reference_rms_norm,
    rms_norm,
)
from memplan.kernels.rope import reference_rope, rope
from memplan.kernels.swiglu import reference_swiglu, swiglu, swiglu_backward

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BIG = 2**31 + 2**20  # elements: past the int32 range


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def grads(outs, inputs, douts):
    return torch.autograd.grad(outs, inputs, douts)


def check(got: tuple, ref: tuple, dtype: torch.dtype) -> None:
    for g, r in zip(got, ref, strict=True):
        assert rel(g, r) <= TOL[dtype], (rel(g, r), g.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("rows,hidden", [(16384, 4096), (4099, 16384), (8191, 896)])
def test_rms_norm(dtype, casting, offset, rows, hidden):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(hidden, device="cuda") * 0.1 + (0 if offset else 1)).to(dtype)
    w.requires_grad_()
    dy = torch.randn_like(x)
    xr, wr = (t.detach().to(ref_dtype(dtype)).requires_grad_() for t in (x, w))
    ref = reference_rms_norm(xr, wr, 1e-6, offset=offset, casting=casting)
    y = rms_norm(x, w, 1e-6, offset=offset, casting=casting, in_place_backward=False)
    check((y,), (ref,), dtype)
    check(grads(y, (x, w), dy), grads(ref, (xr, wr), dy.to(ref.dtype)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("rows,hidden", [(16384, 4096), (4099, 16384), (8191, 896)])
def test_add_rms_norm(dtype, casting, offset, rows, hidden):
    """The fused residual add with its output handed to three consumers (q, k, v): the sum is
    torch's add bit for bit, the gradients those of add + norm with the three summed."""
    residual, branch = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(2))
    w = (torch.randn(hidden, device="cuda") * 0.1 + (0 if offset else 1)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (residual, branch, w)]
    refs = [t.detach().to(ref_dtype(dtype)).requires_grad_() for t in (residual, branch, w)]
    h, ys = add_rms_norm(*leaves[:2], leaves[2], 1e-6, consumers=3, offset=offset, casting=casting)
    h_ref, y_ref = reference_add_rms_norm(*refs, 1e-6, offset=offset, casting=casting)
    assert torch.equal(h, residual + branch)
    check((ys[0],), (y_ref,), dtype)
    dh, *dys = (torch.randn_like(h) for _ in range(4))
    want = grads((h_ref, y_ref), refs, (dh.to(h_ref.dtype), sum(d.to(h_ref.dtype) for d in dys)))
    check(grads((h, *ys), leaves, (dh, *dys)), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(16384, 4096), (4099, 16384)])
def test_layer_norm(dtype, rows, hidden):
    x = (torch.randn(rows, hidden, device="cuda") * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(hidden, device="cuda") * 0.1 + 1).to(dtype).requires_grad_()
    b = (torch.randn(hidden, device="cuda") * 0.1).to(dtype).requires_grad_()
    dy = torch.randn_like(x)
    xr, wr, br = (t.detach().to(ref_dtype(dtype)).requires_grad_() for t in (x, w, b))
    ref = reference_layer_norm(xr, wr, br, 1e-5)
    y = layer_norm(x, w, b, 1e-5)
    check((y,), (ref,), dtype)
    check(grads(y, (x, w, b), dy), grads(ref, (xr, wr, br), dy.to(ref.dtype)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,seq,n_q,n_kv,head_dim", [(2, 4096, 32, 8, 128), (3, 1000, 14, 2, 64)]
)
def test_rope(dtype, batch, seq, n_q, n_kv, head_dim):
    q_proj = torch.randn(batch, seq, n_q * head_dim, device="cuda", dtype=dtype)
    k_proj = torch.randn(batch, seq, n_kv * head_dim, device="cuda", dtype=dtype)
    q_proj.requires_grad_()
    k_proj.requires_grad_()
    angle = torch.rand(batch, seq, head_dim // 2, device="cuda") * 100
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype)

    def qk(qp, kp):
        q = qp.view(batch, seq, n_q, head_dim).transpose(1, 2)
        return q, kp.view(batch, seq, n_kv, head_dim).transpose(1, 2)

    qr, kr = (t.detach().to(ref_dtype(dtype)).requires_grad_() for t in (q_proj, k_proj))
    ref = reference_rope(*qk(qr, kr), cos.to(qr.dtype), sin.to(qr.dtype))
    out = rope(*qk(q_proj, k_proj), cos, sin)
    check(out, ref, dtype)
    douts = tuple(torch.randn_like(o) for o in out)
    ref_douts = tuple(d.to(qr.dtype) for d in douts)
    check(grads(out, (q_proj, k_proj), douts), grads(ref, (qr, kr), ref_douts), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op,reference", [(swiglu, reference_swiglu), (geglu, reference_geglu)])
@pytest.mark.parametrize("in_place", [False, True])
def test_glu(dtype, op, reference, in_place):
    gate = (torch.randn(8192, 14336, device="cuda") * 3).to(dtype).requires_grad_()
    up = torch.randn(8192, 14336, device="cuda", dtype=dtype, requires_grad=True)
    # projection outputs, as in a model (in_place_backward keeps leaves out of place)
    gate, up = gate * 1, up * 1
    dout = torch.randn_like(gate)
    gr, ur = (t.detach().to(ref_dtype(dtype)).requires_grad_() for t in (gate, up))
    ref = reference(gr, ur)
    ref_grads = grads(ref, (gr, ur), dout.to(ref.dtype))
    out = op(gate, up, in_place_backward=in_place)
    check((out,), (ref,), dtype)
    check(grads(out, (gate, up), dout), ref_grads, dtype)


def test_rms_norm_past_int32_offsets():
    hidden = 4096
    x = torch.randn(BIG // hidden, hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    tail = slice(-64, None)
    xt = x[tail].detach().float().requires_grad_()
    ref = reference_rms_norm(xt, w.detach().float(), 1e-6)
    assert rel(y[tail], ref) <= 1e-2
    dy = torch.randn_like(y)
    dy_tail = dy[tail].float()
    # a copy: the in-place backward writes dX over the gradient it is given
    dx, dw = torch.autograd.grad(y, (x, w), dy.clone())
    (dx_ref,) = torch.autograd.grad(ref, xt, dy_tail)
    assert rel(dx[tail], dx_ref) <= 1e-2
    # dW sums over every row, those past 2**31 elements included: an fp64 sum by chunk, of the
    # normalized x rounded to bf16 as the "llama" casting does before the weight multiply.
    dw_ref = torch.zeros(hidden, device="cuda", dtype=torch.float64)
    for start in range(0, x.shape[0], 65536):
        xc = x[start : start + 65536].detach().float()
        normed = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        dw_ref += (dy[start : start + 65536].double() * normed.double()).sum(0)
    assert rel(dw, dw_ref) <= 1e-2


def test_add_rms_norm_past_int32_offsets():
    """Sum, norm and both input gradients at rows past 2**31 elements (two consumers)."""
    hidden = 4096
    shape = (BIG // hidden, hidden)
    residual, branch = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    residual.requires_grad_()
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h, ys = add_rms_norm(residual, branch, w, 1e-6, consumers=2)
    tail = slice(-64, None)
    rt, bt = (t[tail].detach().float().requires_grad_() for t in (residual, branch))
    h_ref, y_ref = reference_add_rms_norm(rt, bt, w.detach().float(), 1e-6)
    assert torch.equal(h[tail], (residual[tail] + branch[tail]).detach())
    assert rel(ys[1][tail], y_ref) <= 1e-2
    del branch
    dh, dy = torch.randn_like(h), torch.randn_like(h)
    want = torch.autograd.grad((h_ref, y_ref), rt, (dh[tail].float(), 2 * dy[tail].float()))[0]
    (dr,) = torch.autograd.grad((h, *ys), residual, (dh, dy, dy))
    assert rel(dr[tail], want) <= 1e-2


def test_layer_norm_past_int32_offsets():
    hidden = 4096
    x = (torch.randn(BIG // hidden, hidden, device="cuda") + 0.5).to(torch.bfloat16)
    x.requires_grad_()
    w = (torch.randn(hidden, device="cuda") * 0.1 + 1).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(hidden, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_()
    y = layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    tail = slice(-64, None)
    xt = x[tail].detach().float().requires_grad_()
    ref = reference_layer_norm(xt, w.detach().float(), b.detach().float(), 1e-5)
    assert rel(y[tail], ref) <= 1e-2
    (dx_ref,) = torch.autograd.grad(ref, xt, dy[tail].float())
    assert rel(dx[tail], dx_ref) <= 1e-2
    # dW and dB sum over every row, those past 2**31 elements included: fp64 sums by chunk.
    dw_ref = torch.zeros(hidden, device="cuda", dtype=torch.float64)
    db_ref = torch.zeros_like(dw_ref)
    for start in range(0, x.shape[0], 65536):
        rows = slice(start, start + 65536)
        xc = x[rows].detach().double()
        var = xc.var(-1, unbiased=False, keepdim=True)
        x_hat = (xc - xc.mean(-1, keepdim=True)) * torch.rsqrt(var + 1e-5)
        dw_ref += (dy[rows].double() * x_hat).sum(0)
        db_ref += dy[rows].double().sum(0)
    assert rel(dw, dw_ref) <= 1e-2 and rel(db, db_ref) <= 1e-2


def test_swiglu_past_int32_offsets():
    cols = 16384
    gate = torch.randn(BIG // cols, cols, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up)
    tail = slice(-64, None)
    gt, ut = (t[tail].detach().float().requires_grad_() for t in (gate, up))
    ref = reference_swiglu(gt, ut)
    assert rel(out[tail], ref) <= 1e-2
    dout = torch.randn_like(out)
    dgate, dup = torch.autograd.grad(out, (gate, up), dout)
    dg_ref, du_ref = torch.autograd.grad(ref, (gt, ut), dout[tail].float())
    assert rel(dgate[tail], dg_ref) <= 1e-2 and rel(dup[tail], du_ref) <= 1e-2


@pytest.mark.parametrize(
    "op,backward,reference",
    [(swiglu, swiglu_backward, reference_swiglu), (geglu, geglu_backward, reference_geglu)],
)
def test_glu_tile_of_narrow_rows_past_int32_offsets(op, backward, reference):
    """Rows of 100 elements, 16 to a tile, 2**28 elements apart (strided views): one tile spans
    more than 2**31 elements."""
    rows, cols = 16, 100
    base = torch.empty(rows, 2**28, device="cuda", dtype=torch.bfloat16)
    base[:, : 3 * cols].normal_()
    gate, up, dout = (base[:, i * cols : (i + 1) * cols] for i in range(3))
    ref_in = [t.float().requires_grad_() for t in (gate, up)]
    ref = reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    assert rel(op(gate, up), ref) <= 1e-2
    check(backward(dout, gate, up), ref_grads, torch.bfloat16)


def test_rope_past_int32_offsets():
    batch, seq, n_q, n_kv, d = BIG // (8192 * 32 * 128) + 1, 8192, 32, 8, 128
    q = torch.randn(batch, seq, n_q, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(batch, seq, n_kv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert q.numel() > 2**31
    angle = torch.rand(1, seq, d // 2, device="cuda") * 100
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    q_out, k_out = rope(q, k, cos, sin)
    q_ref, k_ref = reference_rope(q[-1:].float(), k[-1:].float(), cos.float(), sin.float())
    assert rel(q_out[-1:], q_ref) <= 1e-2 and rel(k_out[-1:], k_ref) <= 1e-2
