"""memplan.kernels.rope against transformers' apply_rotary_pos_emb (and the reference copy in
the kernel file), on CPU through the Triton interpreter or on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import rope_saved_bytes
from memplan.kernels import rope as rope_module
from memplan.kernels.rope import reference_rope, rope

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def cos_sin(batch, seq, head_dim, device, dtype, scale=1.0):
    """cat(freqs, freqs) angles like HF's rotary embeddings; `scale` mimics scaled variants."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    # each batch row gets its own positions (offset by its index), as with packed sequences
    pos = torch.arange(seq, device=device) + torch.arange(batch, device=device)[:, None]
    freqs = pos[..., None].float() * inv_freq * scale
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def projections(batch, seq, n_q, n_kv, head_dim, device, dtype, unsqueeze_dim=1):
    """q/k as the attention layer makes them: (B, S, heads * D) projections viewed as
    (B, heads, S, D) (unsqueeze_dim=1) or (B, S, heads, D) (unsqueeze_dim=2)."""
    q_proj = torch.randn(batch, seq, n_q * head_dim, device=device, dtype=dtype)
    k_proj = torch.randn(batch, seq, n_kv * head_dim, device=device, dtype=dtype)
    q_proj.requires_grad_()
    k_proj.requires_grad_()

    def views(qp, kp):
        q = qp.view(batch, seq, n_q, head_dim)
        k = kp.view(batch, seq, n_kv, head_dim)
        return (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)

    return q_proj, k_proj, views


def run_and_compare(q_proj, k_proj, views, cos, sin, dtype, unsqueeze_dim=1):
    qr, kr = (t.detach().float().clone().requires_grad_() for t in (q_proj, k_proj))
    ref = apply_rotary_pos_emb(*views(qr, kr), cos.float(), sin.float(), unsqueeze_dim)
    out = rope(*views(q_proj, k_proj), cos, sin, unsqueeze_dim)
    for o, r, i in zip(out, ref, views(q_proj, k_proj), strict=True):
        assert o.shape == i.shape and o.stride() == i.stride() and o.dtype == i.dtype
        assert rel(o, r) <= TOL[dtype]
    douts = tuple(torch.randn_like(o) for o in out)
    got = torch.autograd.grad(out, (q_proj, k_proj), douts)
    want = torch.autograd.grad(ref, (qr, kr), tuple(d.float() for d in douts))
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= TOL[dtype]


# The default run takes each dtype with each cos batch and each layout; the other four cases run
# under `-m slow`.
@pytest.mark.parametrize(
    "dtype, cos_batch, unsqueeze_dim",
    [
        (torch.float32, 1, 1),
        (torch.float32, 2, 2),
        (torch.bfloat16, 1, 2),
        (torch.bfloat16, 2, 1),
        pytest.param(torch.float32, 1, 2, marks=pytest.mark.slow),
        pytest.param(torch.float32, 2, 1, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 1, 1, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 2, 2, marks=pytest.mark.slow),
    ],
)
def test_matches_hf(device, dtype, cos_batch, unsqueeze_dim):
    torch.manual_seed(0)
    batch, seq, n_q, n_kv, head_dim = 2, 13, 6, 2, 18  # GQA, odd seq, head_dim not 2^k
    q_proj, k_proj, views = projections(batch, seq, n_q, n_kv, head_dim, device, dtype,
                                        unsqueeze_dim)  # fmt: skip
    cos, sin = cos_sin(cos_batch, seq, head_dim, device, dtype, scale=0.37)
    run_and_compare(q_proj, k_proj, views, cos, sin, dtype, unsqueeze_dim)


@pytest.mark.parametrize("cos_batch", [1, 5])
def test_batches_past_one_launch(device, monkeypatch, cos_batch):
    """Batch rows are grid axis 1 (at most 65535 programs): a larger batch takes several
    launches, each from its first row; here 2 rows per launch."""
    monkeypatch.setattr(rope_module, "MAX_GRID_Y", 2)
    torch.manual_seed(2)
    batch, seq, n_q, n_kv, head_dim = 5, 3, 4, 2, 8
    q_proj, k_proj, views = projections(batch, seq, n_q, n_kv, head_dim, device, torch.float32)
    cos, sin = cos_sin(cos_batch, seq, head_dim, device, torch.float32, scale=0.37)
    run_and_compare(q_proj, k_proj, views, cos, sin, torch.float32)


def test_contiguous_inputs_and_unequal_cos_halves(device):
    """Plain contiguous (B, H, S, D) tensors, and cos/sin whose halves differ: both halves are
    read, as HF's formula does."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 9, 16, device=device, requires_grad=True)
    k = torch.randn(2, 1, 9, 16, device=device, requires_grad=True)
    cos, sin = torch.randn(2, 9, 16, device=device), torch.randn(2, 9, 16, device=device)
    out = rope(q, k, cos, sin)
    ref = reference_rope(q, k, cos, sin)
    for o, r in zip(out, ref, strict=True):
        assert rel(o, r) <= 1e-6
    douts = tuple(torch.randn_like(o) for o in out)
    for g, w in zip(
        torch.autograd.grad(out, (q, k), douts), torch.autograd.grad(ref, (q, k), douts)
    ):
        assert rel(g, w) <= 1e-6


@pytest.mark.parametrize("in_place", [False, True])
def test_half_tables_match_gpt_oss(device, in_place):
    """cos/sin of head_dim / 2 (gpt-oss's rotary embedding) rotate both halves with them, as
    gpt-oss's apply_rotary_pos_emb does, forward and backward."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss

    torch.manual_seed(2)
    q_proj, k_proj, views = projections(2, 9, 4, 2, 16, device, torch.float32)
    cos, sin = torch.randn(1, 9, 8, device=device), torch.randn(1, 9, 8, device=device)
    qr, kr = (t.detach().clone().requires_grad_() for t in (q_proj, k_proj))
    ref = gpt_oss(*views(qr, kr), cos, sin)
    out = rope(*views(q_proj.clone(), k_proj.clone()), cos, sin, in_place=in_place)
    for o, r in zip(out, ref, strict=True):
        assert rel(o, r) <= 1e-6
    douts = tuple(torch.randn_like(o) for o in out)
    # the reference first: the in-place backward rotates the output gradients in their memory
    want = torch.autograd.grad(ref, (qr, kr), douts)
    got = torch.autograd.grad(out, (q_proj, k_proj), douts)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= 1e-6


@pytest.mark.parametrize("in_place", [False, True])
def test_head_dim_off_unit_stride_and_cos_sin_of_other_layouts(device, in_place):
    """The kernel reads head_dim at unit stride and sin with cos's strides: q and k whose
    head_dim is strided, a gradient laid out the same way, and cos/sin of different layouts
    are copied first (in place falls back to out of place for such q and k), never misread."""
    torch.manual_seed(3)
    # (B, D, S, H) memory seen as (B, H, S, D): head_dim has stride S * H
    q_mem = torch.randn(2, 10, 7, 3, device=device).requires_grad_()
    k_mem = torch.randn(2, 10, 7, 1, device=device).requires_grad_()
    cos = torch.randn(2, 7, 10, device=device)
    sin = torch.randn(2, 10, 7, device=device).transpose(1, 2)  # same values layout, other strides
    q, k = (m.permute(0, 3, 2, 1) * 1 for m in (q_mem, k_mem))
    assert q.stride(-1) != 1 and cos.stride() != sin.stride()
    out = rope(q, k, cos, sin, in_place=in_place)
    ref = reference_rope(q, k, cos, sin)
    for o, r in zip(out, ref, strict=True):
        assert rel(o, r) <= 1e-6
    douts = tuple(torch.randn(*o.shape[:-1], o.shape[-1] * 2, device=device)[..., ::2]
                  for o in out)  # fmt: skip
    want = torch.autograd.grad(ref, (q_mem, k_mem), douts, retain_graph=True)
    got = torch.autograd.grad(out, (q_mem, k_mem), douts)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= 1e-6


def test_cos_sin_without_batch_dim(device):
    q = torch.randn(1, 2, 5, 8, device=device)
    k = torch.randn(1, 2, 5, 8, device=device)
    cos, sin = torch.randn(5, 8, device=device), torch.randn(5, 8, device=device)
    for o, r in zip(rope(q, k, cos, sin), reference_rope(q, k, cos[None], sin[None])):
        assert rel(o, r) <= 1e-6


def test_only_q_used_gives_zero_k_grad(device):
    q_proj, k_proj, views = projections(2, 5, 4, 2, 8, device, torch.float32)
    cos, sin = cos_sin(1, 5, 8, device, torch.float32)
    q_out, _ = rope(*views(q_proj, k_proj), cos, sin)
    dq, dk = torch.autograd.grad(q_out.sum(), (q_proj, k_proj))
    assert torch.count_nonzero(dk) == 0 and torch.count_nonzero(dq) > 0


@settings(max_examples=5, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 12),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    half=st.integers(1, 40),
)
def test_shapes_property(batch, seq, n_kv, group, half):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q_proj, k_proj, views = projections(batch, seq, n_kv * group, n_kv, 2 * half, device,
                                        torch.float32)  # fmt: skip
    cos, sin = cos_sin(batch, seq, 2 * half, device, torch.float32)
    run_and_compare(q_proj, k_proj, views, cos, sin, torch.float32)


def test_saved_bytes_match_contract(device):
    batch, seq, n_q, n_kv, head_dim = 2, 11, 4, 2, 16
    q_proj, k_proj, views = projections(batch, seq, n_q, n_kv, head_dim, device, torch.bfloat16)
    cos, sin = cos_sin(1, seq, head_dim, device, torch.bfloat16)
    excluded = {t.untyped_storage().data_ptr() for t in (cos, sin)}
    storages: dict[int, int] = {}
    n_saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n_saved
        n_saved += 1
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rope(*views(q_proj, k_proj), cos, sin)
    assert n_saved == 2  # cos and sin, nothing else
    assert sum(storages.values()) == rope_saved_bytes(batch * seq, head_dim, 2)


def test_meta_tensors_take_the_eager_path():
    """On meta tensors the launcher runs (and launches nothing): outputs laid out as on the GPU,
    and with in_place q and k rotated in their own memory, as the traced step records it."""
    q = torch.empty(2, 9, 4, 16, device="meta").transpose(1, 2).requires_grad_()
    k = torch.empty(2, 9, 2, 16, device="meta").transpose(1, 2).requires_grad_()
    cos = sin = torch.empty(1, 9, 16, device="meta")
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.is_meta and q_out.shape == q.shape and q_out.stride() == q.stride()
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.ones_like(q_out),
                                                           torch.ones_like(k_out)))  # fmt: skip
    assert dq.shape == q.shape and dk.shape == k.shape
    fresh_q, fresh_k = q * 1, k * 1  # projection outputs, not leaves: rotated in place
    q_out, k_out = rope(fresh_q, fresh_k, cos, sin, in_place=True)
    assert q_out.untyped_storage() is fresh_q.untyped_storage()
    assert k_out.untyped_storage() is fresh_k.untyped_storage()


def test_bad_shapes_raise_usage_errors():
    q, k = torch.randn(1, 2, 3, 7), torch.randn(1, 2, 3, 7)
    with pytest.raises(UsageError, match="even head_dim"):
        rope(q, k, torch.randn(1, 3, 7), torch.randn(1, 3, 7))
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(UsageError, match="head_dim / 2"):
        rope(q, k, torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    with pytest.raises(UsageError, match="unsqueeze_dim"):
        rope(q, k, torch.randn(1, 3, 8), torch.randn(1, 3, 8), unsqueeze_dim=3)


# in place on the (B, S, H, D) layout (unsqueeze_dim 2) under `-m slow`; test_matches_hf takes
# that layout by default
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("unsqueeze_dim", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_in_place_matches_hf_and_allocates_nothing(device, dtype, unsqueeze_dim):
    """in_place=True: the outputs are q and k themselves, values and gradients as HF's."""
    torch.manual_seed(0)
    q_leaf, k_leaf, views = projections(2, 37, 6, 2, 64, device, dtype, unsqueeze_dim)
    cos, sin = cos_sin(2, 37, 64, device, dtype)
    qr, kr = (t.detach().float().clone().requires_grad_() for t in (q_leaf, k_leaf))
    ref = apply_rotary_pos_emb(*views(qr, kr), cos.float(), sin.float(), unsqueeze_dim)
    q_proj, k_proj = q_leaf * 1, k_leaf * 1  # projection outputs (not leaves), as in a model
    q, k = views(q_proj, k_proj)
    out = rope(q, k, cos, sin, unsqueeze_dim, in_place=True)
    assert out[0].data_ptr() == q.data_ptr() and out[1].data_ptr() == k.data_ptr()
    for o, r in zip(out, ref, strict=True):
        assert rel(o, r) <= TOL[dtype]
    douts = tuple(torch.randn_like(o) for o in out)
    want = torch.autograd.grad(ref, (qr, kr), tuple(d.float() for d in douts))
    got = torch.autograd.grad(out, (q_leaf, k_leaf), douts)  # overwrites douts
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) <= TOL[dtype]
    # an expanded gradient (a sum's backward) is not written into
    q, k = views(q_leaf * 1, k_leaf * 1)
    q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim, in_place=True)
    (q_out.float().sum() + k_out.float().sum()).backward()
    q_ref, k_ref = (t.detach().float().clone().requires_grad_() for t in (q_leaf, k_leaf))
    ref_q, ref_k = apply_rotary_pos_emb(
        *views(q_ref, k_ref), cos.float(), sin.float(), unsqueeze_dim
    )
    (ref_q.sum() + ref_k.sum()).backward()
    assert rel(q_leaf.grad, q_ref.grad) <= TOL[dtype]
    assert rel(k_leaf.grad, k_ref.grad) <= TOL[dtype]


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
