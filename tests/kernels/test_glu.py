"""memplan.kernels.swiglu / geglu against their plain-PyTorch references, on CPU through the
Triton interpreter or on CUDA; and torch.compile(fullgraph=True) over a block that uses all
five elementwise ops."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import glu_saved_bytes
from memplan.kernels.geglu import GeGLU, geglu, reference_geglu
from memplan.kernels.layer_norm import layer_norm, reference_layer_norm
from memplan.kernels.rms_norm import reference_rms_norm, rms_norm
from memplan.kernels.rope import reference_rope, rope
from memplan.kernels.swiglu import SwiGLU, reference_swiglu, swiglu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
geglu_exact = functools.partial(geglu, approximate="none")
reference_geglu_exact = functools.partial(reference_geglu, approximate="none")
OPS = [
    (swiglu, reference_swiglu),
    (geglu, reference_geglu),
    (geglu_exact, reference_geglu_exact),
]
OP_NAMES = ["swiglu", "geglu", "geglu_exact"]
DTYPES = [torch.float32, torch.bfloat16]
# (bias, in_place) of the down-projection cases
DOWN_OPTIONS = [(False, False), (False, True), (True, False), (True, True)]


def matches_cases() -> list:
    """Each op in each dtype in the default run, in place in half of them; the other half
    under `-m slow`."""
    return [
        pytest.param(
            op, reference, dtype, in_place,
            marks=() if in_place == bool((i + j) % 2) else pytest.mark.slow,
            id=f"{OP_NAMES[i]}-{str(dtype).removeprefix('torch.')}-{in_place}",
        )
        for i, (op, reference) in enumerate(OPS)
        for j, dtype in enumerate(DTYPES)
        for in_place in (False, True)
    ]  # fmt: skip


def down_projection_cases() -> list:
    """Each op in each dtype in the default run, the four (bias, in_place) pairs spread over
    them; the other 18 cases under `-m slow`."""
    return [
        pytest.param(
            op, reference, dtype, bias, in_place,
            marks=() if (bias, in_place) == DOWN_OPTIONS[(2 * i + j) % 4] else pytest.mark.slow,
            id=f"{OP_NAMES[i]}-{str(dtype).removeprefix('torch.')}-{bias}-{in_place}",
        )
        for i, (op, reference) in enumerate(OPS)
        for j, dtype in enumerate(DTYPES)
        for bias, in_place in DOWN_OPTIONS
    ]  # fmt: skip


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_and_compare(op, reference, gate, up, dtype, in_place=False):
    gr, ur = (t.detach().float().clone().requires_grad_() for t in (gate, up))
    ref = reference(gr, ur)
    dout = torch.randn(ref.shape, device=ref.device, dtype=dtype)
    want = torch.autograd.grad(ref, (gr, ur), dout.float())
    out = op(gate, up, in_place_backward=in_place)
    assert out.shape == gate.shape and out.dtype == gate.dtype
    assert rel(out, ref) <= TOL[dtype]
    got = torch.autograd.grad(out, (gate, up), dout)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert rel(g, w) <= TOL[dtype]
    return got


@pytest.mark.parametrize("op, reference, dtype, in_place", matches_cases())
def test_matches_reference(device, op, reference, dtype, in_place):
    torch.manual_seed(0)
    gate_leaf = (torch.randn(5, 123, 127, device=device) * 3).to(dtype).requires_grad_()
    up_leaf = torch.randn(5, 123, 127, device=device, dtype=dtype, requires_grad=True)
    # projection outputs, as in a model: leaves that require grad keep their values
    gate, up = gate_leaf * 1, up_leaf * 1
    gate_before = gate.detach().clone()
    d_gate, d_up = run_and_compare(op, reference, gate, up, dtype, in_place)
    # in place, the gradients live in the saved gate/up buffers; otherwise those are untouched
    assert (d_gate.data_ptr() == gate.data_ptr()) == in_place
    assert (d_up.data_ptr() == up.data_ptr()) == in_place
    assert torch.equal(gate, gate_before) != in_place


@pytest.mark.parametrize("op, reference, dtype, bias, in_place", down_projection_cases())
def test_down_projection_recomputes_the_product(device, op, reference, dtype, bias, in_place):
    """op(gate, up, down=linear) == linear(op(gate, up)) in value and in all four gradients,
    with the product not saved (it is recomputed in backward)."""
    torch.manual_seed(0)
    inter, hidden = 127, 65
    down = torch.nn.Linear(inter, hidden, bias=bias).to(device, dtype)
    gate = (torch.randn(3, 37, inter, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(3, 37, inter, device=device, dtype=dtype, requires_grad=True)
    leaves = (gate, up, down.weight) + ((down.bias,) if bias else ())
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in leaves]
    ref = torch.nn.functional.linear(
        reference(ref_leaves[0], ref_leaves[1]), *ref_leaves[2:] if bias else ref_leaves[2:3]
    )
    d_out = torch.randn(ref.shape, device=device, dtype=dtype)
    want = torch.autograd.grad(ref, ref_leaves, d_out.float())

    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        out = op(gate, up, in_place_backward=in_place, down=down)
    weight_bytes = down.weight.untyped_storage().nbytes()
    assert sorted(saved) == sorted([gate.untyped_storage().nbytes()] * 2 + [weight_bytes])
    assert out.dtype == dtype and rel(out, ref) <= TOL[dtype]
    got = torch.autograd.grad(out, leaves, d_out)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and rel(g, w) <= TOL[dtype]


@pytest.mark.parametrize("op,reference", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_weight_gradient_is_bitwise_the_unfused_one(device, op, reference, dtype):
    """The product the backward kernel writes over d_product is the forward's output bit for
    bit, so down_proj's weight gradient equals the one autograd computes from a kept product."""
    torch.manual_seed(1)
    down = torch.nn.Linear(96, 40, bias=False).to(device, dtype)
    gate = (torch.randn(2, 19, 96, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(2, 19, 96, device=device, dtype=dtype, requires_grad=True)
    d_out = torch.randn(2, 19, 40, device=device, dtype=dtype)
    (fused,) = torch.autograd.grad(op(gate, up, down=down), down.weight, d_out)
    (kept,) = torch.autograd.grad(down(op(gate, up)), down.weight, d_out)
    assert torch.equal(fused, kept)


@pytest.mark.parametrize("op,reference", OPS)
@pytest.mark.parametrize("in_place", [False, True])
def test_rows_wider_than_one_tile(device, op, reference, in_place):
    """Rows of several column blocks plus a ragged last block: every tile of the 1-d grid maps
    to its own (row group, column block)."""
    torch.manual_seed(2)
    gate = torch.randn(3, 4100, device=device, requires_grad=True)
    up = torch.randn(3, 4100, device=device, requires_grad=True)
    run_and_compare(op, reference, gate, up, torch.float32, in_place=in_place)


def test_down_projection_with_hooks_keeps_the_module_call(device):
    """A hooked down projection (PEFT, FSDP) is called as a module: the product is saved."""
    down = torch.nn.Linear(48, 32).to(device)
    calls = []
    down.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    gate = torch.randn(5, 48, device=device, requires_grad=True)
    up = torch.randn(5, 48, device=device, requires_grad=True)
    swiglu(gate, up, down=down).sum().backward()
    assert calls == [torch.Size([5, 32])]


@pytest.mark.parametrize("op,reference", OPS)
@pytest.mark.parametrize("in_place", [False, True])
def test_non_contiguous_inputs(device, op, reference, in_place):
    """gate/up as halves of a fused gate_up projection (row stride 2I: read in place) and as
    transposed tensors (copied); in-place backward falls back to new buffers for those."""
    torch.manual_seed(1)
    gate, up = torch.randn(4, 9, 2 * 70, device=device).requires_grad_().chunk(2, dim=-1)
    assert not gate.is_contiguous()
    run_and_compare(op, reference, gate, up, torch.float32, in_place)
    gate_t = torch.randn(70, 36, device=device).t().requires_grad_()
    up_t = torch.randn(70, 36, device=device).t().requires_grad_()
    run_and_compare(op, reference, gate_t, up_t, torch.float32, in_place)


@pytest.mark.parametrize("op,reference", OPS[1:])
def test_geglu_extreme_gates(device, op, reference):
    """Large |gate|: gelu saturates to gate or 0 and its derivative to 1 or 0."""
    gate = torch.tensor([[-30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 3.0]], device=device)
    gate.requires_grad_()
    up = torch.full_like(gate, 2.0, requires_grad=True)
    run_and_compare(op, reference, gate, up, torch.float32)


def test_geglu_rejects_unknown_approximation():
    with pytest.raises(UsageError, match="approximate"):
        geglu(torch.randn(2, 8), torch.randn(2, 8), approximate="erf")


@settings(max_examples=5, deadline=None)
@given(
    lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    cols=st.integers(1, 3000),
    which=st.sampled_from([0, 1, 2]),
)
def test_shapes_property(lead, cols, which):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate = torch.randn(*lead, cols, device=device, requires_grad=True)
    up = torch.randn(*lead, cols, device=device, requires_grad=True)
    run_and_compare(*OPS[which], gate, up, torch.float32)


@pytest.mark.parametrize("module_cls", [SwiGLU, GeGLU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_contract(device, module_cls, dtype, saved_storage_bytes):
    """The fused op saves gate and up only: the MLP saves them plus x (for gate/up's weight
    gradients, shared); down_proj's input, the product, is recomputed in backward."""
    rows, hidden, inter = 13, 32, 48
    mlp = module_cls(hidden, inter).to(device, dtype)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    saved = saved_storage_bytes(lambda: mlp(x), mlp)
    linears = rows * hidden * dtype.itemsize
    assert saved == glu_saved_bytes(rows, inter, dtype.itemsize) + linears


@pytest.mark.parametrize("op", [swiglu, geglu])
def test_meta_tensors_take_the_eager_path(op):
    """On meta tensors the launchers run (and launch nothing), deciding as on the GPU: the
    gradients go over fresh gate and up (their storages tell them apart: meta tensors have no
    addresses), and with `down` the product is recomputed in backward unless autocast is on."""
    gate = torch.empty(3, 40, device="meta", requires_grad=True)
    up = torch.empty(3, 40, device="meta", requires_grad=True)
    out = op(gate, up, in_place_backward=True)
    assert out.is_meta and out.shape == gate.shape
    d_gate, d_up = torch.autograd.grad(out, (gate, up), torch.empty_like(out))
    assert d_gate.shape == gate.shape and d_up.shape == up.shape
    fresh_gate, fresh_up = gate * 1, up * 1
    out = op(fresh_gate, fresh_up, in_place_backward=True)
    d_gate, d_up = torch.autograd.grad(out, (fresh_gate, fresh_up), torch.empty_like(out))
    assert d_gate.untyped_storage() is fresh_gate.untyped_storage()
    assert d_up.untyped_storage() is fresh_up.untyped_storage()
    down = torch.nn.Linear(40, 8, bias=False, device="meta")
    assert type(op(gate, up, down=down).grad_fn).__name__ == "_DownProjectedBackward"
    under_autocast = op(gate, up, down=down, autocast=torch.bfloat16).grad_fn
    assert type(under_autocast).__name__ != "_DownProjectedBackward"


def test_mismatched_inputs_raise_usage_error():
    with pytest.raises(UsageError, match="one shape and dtype"):
        swiglu(torch.randn(2, 8), torch.randn(2, 9))
    with pytest.raises(UsageError, match="one shape and dtype"):
        geglu(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64))


class Block(torch.nn.Module):
    """RMSNorm -> q/k projection + RoPE -> LayerNorm -> gated MLP (SwiGLU + GeGLU halves)."""

    def __init__(self, hidden: int = 64, heads: int = 2, head_dim: int = 32) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.w_rms = torch.nn.Parameter(torch.randn(hidden) * 0.1 + 1)
        self.w_ln = torch.nn.Parameter(torch.randn(hidden) * 0.1 + 1)
        self.b_ln = torch.nn.Parameter(torch.randn(hidden) * 0.1)
        self.qk = torch.nn.Linear(hidden, 2 * heads * head_dim, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin, fused: bool = True):
        rms, rot, ln = (rms_norm, rope, layer_norm) if fused else (
            reference_rms_norm, reference_rope, reference_layer_norm)  # fmt: skip
        swi, geg = (swiglu, geglu) if fused else (reference_swiglu, reference_geglu)
        b, s, hidden = x.shape
        q, k = self.qk(rms(x, self.w_rms, 1e-6)).view(b, s, 2, self.heads, -1).unbind(2)
        q, k = rot(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        h = ln(x + (q * k).transpose(1, 2).reshape(b, s, hidden), self.w_ln, self.b_ln, 1e-5)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        mlp = swi(gate[..., :hidden], up[..., :hidden]) + geg(gate[..., hidden:], up[..., hidden:])
        return self.down(mlp) + x


@pytest.mark.slow
def test_torch_compile_fullgraph_block(device, tmp_path, monkeypatch):
    # A fresh inductor cache: its AOTAutograd entries are keyed on the forward graph, not on
    # the custom ops' registered backward, so an entry compiled before a kernel change is stale.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block().to(device)
    x = torch.randn(2, 7, 64, device=device, requires_grad=True)
    angle = torch.rand(1, 7, 16, device=device) * 10
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out = torch.compile(block, fullgraph=True)(x, cos, sin)
    ref = block(x, cos, sin, fused=False)
    assert rel(out, ref) <= 1e-5
    params = [x, *block.parameters()]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        assert rel(a, b) <= 1e-5
