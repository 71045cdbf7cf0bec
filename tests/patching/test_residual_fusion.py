"""Patched pre-norm decoder layers: each residual add runs inside the norm after it (the next
layer's input norm or the final norm for the layer's last add) and each projection reads its own
view of the normalized input. Checked against unpatched HF models wherever the layer's forward is
bypassed or the fusion must step aside."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import memplan.patching as mp
from memplan.families import FAMILIES
from memplan.kernels import rms_norm as norm_kernels
from memplan.patching import engine, forwards

from .tiny_models import batch, build, lockstep, pair, rel_err

# Norms after attention and the MLP: before them too (sandwich, Gemma 2/3) or only there (OLMo 2/3,
# EXAONE 4); the others norm before attention and the MLP only.
POST_NORM_FAMILIES = tuple(
    name
    for name, family in FAMILIES.items()
    if family.config.post_norm or family.config.sandwich_norm
)
# Pre-norm families whose layers keep their forward (Llama 4's MoE block returns its router
# logits beside its output): their norms are patched one by one.
KEPT_PRE_NORM_FAMILIES = tuple(
    name
    for name, family in FAMILIES.items()
    if name not in POST_NORM_FAMILIES and family.patch.decoder_layer is None
)
PRE_NORM_FAMILIES = tuple(
    name for name in FAMILIES if name not in POST_NORM_FAMILIES + KEPT_PRE_NORM_FAMILIES
)


@pytest.fixture
def counted(monkeypatch):
    """Counts of fused adds and of norm outputs taken from the previous layer."""
    counts = {"add": 0, "taken": 0}
    add, take = norm_kernels.add_rms_norm, forwards.PrenormedHandoff.take

    def counting_add(*args, **kwargs):
        counts["add"] += 1
        return add(*args, **kwargs)

    def counting_take(handoff, norm, x):
        outputs = take(handoff, norm, x)
        counts["taken"] += outputs is not None
        return outputs

    monkeypatch.setattr(norm_kernels, "add_rms_norm", counting_add)
    monkeypatch.setattr(forwards.PrenormedHandoff, "take", counting_take)
    return counts


def handoffs(model) -> dict[str, forwards.PrenormedHandoff]:
    """The patch's handoffs by the name of the norm they belong to."""
    by_id = getattr(model, engine._STATE_ATTR).handoffs
    return {name: by_id[id(m)] for name, m in model.named_modules() if id(m) in by_id}


def leftover_entries(model) -> list[str]:
    return [name for name, handoff in handoffs(model).items() if not handoff.empty]


@pytest.mark.parametrize(
    "family",
    [
        f if f in ("llama", "phi3") else pytest.param(f, marks=pytest.mark.slow)
        for f in PRE_NORM_FAMILIES
    ],
)
def test_every_residual_add_is_fused_and_nothing_is_left_behind(family, counted):
    reference, patched = pair(family, torch.float32, num_hidden_layers=3)
    applied = mp.apply(patched)
    layers = [n for n in applied.modules["rms_norm"] if n.endswith(tuple("012"))]
    assert layers == ["model.layers.0", "model.layers.1", "model.layers.2"]
    lockstep(reference, patched, steps=1, loss_tol=1e-5, grad_tol=1e-5)
    # 2 adds per layer, and layer 0's input norm handing the residual stream back (no add);
    # layers 1, 2 and the final norm take their input norm from the layer before
    assert counted == {"add": 7, "taken": 3}
    assert leftover_entries(patched) == []


def test_the_registry_says_which_layers_are_fused():
    fused = {name for name, family in FAMILIES.items() if family.patch.decoder_layer is not None}
    assert fused == set(PRE_NORM_FAMILIES)
    assert set(FAMILIES) - fused == set(POST_NORM_FAMILIES + KEPT_PRE_NORM_FAMILIES)
    for family in KEPT_PRE_NORM_FAMILIES:  # the patch says why
        assert any("decoder layers keep their forward" in n for n in FAMILIES[family].patch.notes)


@pytest.mark.parametrize("family", KEPT_PRE_NORM_FAMILIES)
def test_kept_pre_norm_layers_patch_each_norm(family):
    reference, patched = pair(family, torch.float32)
    applied = mp.apply(patched)
    assert "model.layers.0.input_layernorm" in applied.modules["rms_norm"]
    assert "model.layers.1.post_attention_layernorm" in applied.modules["rms_norm"]
    assert all("forward" not in layer.__dict__ for layer in patched.model.layers)
    lockstep(reference, patched, steps=2, loss_tol=1e-5, grad_tol=1e-5)


def test_post_norm_families_keep_their_layers():
    """A norm on a branch's output feeds the residual add: no add feeds a norm to run in it, and
    the norm's output gradient is the residual's too, which its backward must not overwrite."""
    for family in POST_NORM_FAMILIES:
        model = build(family)
        applied = mp.apply(model)
        assert not any("layers." in n and n.count(".") == 2 for n in applied.modules["rms_norm"])
        assert "model.layers.0.post_attention_layernorm" in applied.modules["rms_norm"]
        assert not FAMILIES[family].patch.norm.in_place_backward
        assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_gradient_checkpointing_keeps_each_add_in_its_own_layer(counted):
    """Recomputing a layer must not find its input norm computed by the layer before: under
    checkpointing only the add inside each layer is fused; and the layers are still
    checkpointed (their MLP runs again in backward)."""
    reference, patched = pair("llama", torch.float32)
    for model in (reference, patched):
        model.gradient_checkpointing_enable()
    mp.apply(patched)
    mlp_calls = []
    patched.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    lockstep(reference, patched, steps=2, loss_tol=1e-5, grad_tol=1e-5)
    assert len(mlp_calls) == 2 * 2  # (forward + recompute) x 2 steps
    assert counted["taken"] == 0
    if forwards.layers_checkpoint_in_forward():
        # transformers checkpoints the class's forward: the family's own layer forward runs
        assert counted["add"] == 0
    else:
        # (input norm + the add inside) x 2 layers x (forward + recompute) x 2 steps
        assert counted["add"] == 2 * 2 * 2 * 2


def test_a_hook_between_layers_gets_the_norm_computed_again(counted):
    """A forward hook that replaces a layer's output: the next layer's norm must read the new
    tensor, not the one the fused add normalized."""
    reference, patched = pair("llama", torch.float32)
    for model in (reference, patched):
        model.model.layers[0].register_forward_hook(lambda module, args, out: out * 1.5)
    mp.apply(patched)
    lockstep(reference, patched, steps=1, loss_tol=1e-5, grad_tol=1e-5)
    assert counted["taken"] == 1  # the final norm only
    assert leftover_entries(patched) == []


def test_positional_arguments_run_the_familys_forward():
    reference, patched = pair("llama", torch.float32)
    mp.apply(patched)
    hidden = torch.randn(2, 5, 64)
    rotary = reference.model.rotary_emb(hidden, torch.arange(5)[None].expand(2, -1))
    layer_ref, layer_pat = reference.model.layers[1], patched.model.layers[1]
    want = layer_ref(hidden, position_embeddings=rotary)
    by_keyword = layer_pat(hidden, position_embeddings=rotary)
    by_position = layer_pat(hidden, None, None, None, False, rotary)
    assert rel_err(by_keyword, want) <= 1e-5 and rel_err(by_position, want) <= 1e-5


def test_autocast_residual_stream_takes_the_plain_add():
    """Under autocast the residual stream is fp32 and the branches bf16: torch's add promotes,
    the fused add (one dtype) steps aside; losses match HF's under the same autocast."""
    reference, patched = pair("llama", torch.float32)
    mp.apply(patched)
    inputs = batch(seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref, loss_pat = reference(**inputs).loss, patched(**inputs).loss
    assert rel_err(loss_pat, loss_ref) <= 1e-2
    assert leftover_entries(patched) == []


def test_revert_restores_the_layers_and_drops_the_handoffs():
    """Nothing of the patch outlives revert: the handoffs, even one left holding activations,
    were referenced only by the patch's forwards."""
    model = build("llama")
    inputs = {k: v for k, v in batch(seed=0).items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        before = model(**inputs).logits
    mp.apply(model)
    handoff = handoffs(model)["model.layers.1.input_layernorm"]
    handoff.leave(torch.zeros(1), (torch.zeros(1),))  # as if left behind
    left = weakref.ref(handoff)
    del handoff
    mp.revert(model)
    gc.collect()
    assert left() is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


def test_a_handoff_gives_its_entry_to_exactly_its_source_once():
    norm = nn.Module()
    handoff = forwards.PrenormedHandoff(norm)
    h, views = torch.zeros(2), (torch.ones(2), torch.ones(2))
    handoff.leave(h, views)
    assert handoff.take(nn.Module(), h) is None and not handoff.empty  # another norm (a copy's)
    assert handoff.take(norm, h.clone()) is None and handoff.empty  # another tensor: dropped
    handoff.leave(h, views)
    assert handoff.take(norm, h) is views and handoff.take(norm, h) is None


def test_the_embedding_kernel_computes_a_patched_models_embedding_gradient(monkeypatch):
    """The token embedding's weight is an nn.Parameter: its gradient must come from memplan's
    kernel, and match HF's."""
    import memplan.kernels.embedding as embedding_kernels

    calls = []
    backward = embedding_kernels.embedding_backward

    def counting(*args, **kwargs):
        calls.append(args[2])
        return backward(*args, **kwargs)

    monkeypatch.setattr(embedding_kernels, "embedding_backward", counting)
    reference, patched = pair("llama", torch.float32, tie_word_embeddings=False)
    applied = mp.apply(patched)
    assert "embedding" in applied.kernels
    assert applied.modules["embedding"] == ("model.embed_tokens",)
    lockstep(reference, patched, steps=1, loss_tol=1e-5, grad_tol=1e-5)
    assert calls == [256]  # one backward, over the 256-row table
