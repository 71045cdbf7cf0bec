"""The patched causal-LM loss: HF's label shift and ignore_index, num_items_in_batch, the
cross-entropy-only path, MoE aux loss, logits_to_keep, positional and tuple calling."""

from __future__ import annotations

import pytest
import torch

import memplan.patching as mp
from memplan.errors import UsageError
from memplan.schema import Plan

from .tiny_models import assert_grads_close, batch, pair, rel_err


def loss_and_grads(reference, patched, **extra):
    inputs = {**batch(), **extra}
    out_ref, out_pat = reference(**inputs), patched(**inputs)
    out_ref.loss.backward()
    out_pat.loss.backward()
    return out_ref, out_pat


def test_num_items_in_batch_matches_hf():
    reference, patched = pair("llama")
    mp.apply(patched)
    # as the Trainer passes it under gradient accumulation: the token count of all micro-batches
    out_ref, out_pat = loss_and_grads(reference, patched, num_items_in_batch=torch.tensor(40))
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    plain = reference(**batch()).loss
    assert abs(out_ref.loss.item() - plain.item()) > 1e-3  # the count changed the normalization
    assert_grads_close(reference, patched, 1e-5)


def test_all_labels_ignored_but_one_row():
    reference, patched = pair("qwen2")
    mp.apply(patched)
    inputs = batch()
    inputs["labels"][0] = -100
    out_ref, out_pat = reference(**inputs), patched(**inputs)
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cross_entropy_kernel_without_flce(family):
    reference, patched = pair(family)
    applied = mp.apply(patched, kernels=["cross_entropy"])
    assert applied.kernels == ("cross_entropy",)
    out_ref, out_pat = loss_and_grads(reference, patched)
    assert out_pat.logits is None
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)


def test_lm_head_that_is_not_a_linear_goes_through_the_ce_kernel():
    reference, patched = pair("llama")
    mp.apply(patched, kernels=["cross_entropy"])
    for model in (reference, patched):
        model.lm_head = torch.nn.Sequential(model.lm_head)
    out_ref, out_pat = loss_and_grads(reference, patched)
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)


def test_lm_head_replaced_after_apply_gets_the_plain_loss():
    """flce alone, the default: a head that stops being a plain projection after apply gets
    Hugging Face's loss on its logits."""
    reference, patched = pair("llama")
    assert mp.apply(patched).kernels == ("rms_norm", "rope", "swiglu", "flce", "embedding")
    for model in (reference, patched):
        model.lm_head = torch.nn.Sequential(model.lm_head)
    out_ref, out_pat = loss_and_grads(reference, patched)
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)


def test_both_loss_kernels_are_refused_as_on_the_command_line():
    """apply switched on cross_entropy and flce together, which `memplan advise` refuses."""
    model = pair("llama")[1]
    with pytest.raises(UsageError, match="cross_entropy and flce both compute the loss"):
        mp.apply(model, kernels=["cross_entropy", "flce"])
    with pytest.raises(UsageError, match="cross_entropy and flce both compute the loss"):
        mp.apply(model, Plan(kernels=("rms_norm", "cross_entropy", "flce")))
    assert mp.applied_patch(model) is None


def test_tied_embeddings_get_both_gradients():
    reference, patched = pair("llama")  # llama-3.2-1b ties lm_head to the embeddings
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    mp.apply(patched)
    loss_and_grads(reference, patched)
    assert_grads_close(reference, patched, 1e-5)


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_moe_aux_loss_is_added_as_hf_does(family):
    reference, patched = pair(family)
    mp.apply(patched)
    out_ref, out_pat = loss_and_grads(reference, patched)
    assert out_pat.aux_loss is not None
    assert rel_err(out_pat.aux_loss, out_ref.aux_loss) <= 1e-6
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert len(out_pat.router_logits) == len(out_ref.router_logits)
    assert_grads_close(reference, patched, 1e-5)
    out_pat = patched(**batch(), output_router_logits=False)
    assert out_pat.aux_loss is None


def test_logits_to_keep_and_return_dict_false():
    reference, patched = pair("mistral")
    mp.apply(patched)
    inputs = batch()
    keep = 5
    inputs["labels"] = inputs["labels"][:, -keep:]
    out_ref = reference(**inputs, logits_to_keep=keep)
    out_pat = patched(**inputs, logits_to_keep=keep, return_dict=False)
    assert isinstance(out_pat, tuple)
    assert rel_err(out_pat[0], out_ref.loss) <= 1e-5


def test_positional_arguments_bind_like_hf():
    reference, patched = pair("llama")
    mp.apply(patched)
    inputs = batch()
    # forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels)
    args = (inputs["input_ids"], inputs["attention_mask"], None, None, None, inputs["labels"])
    out_ref, out_pat = reference(*args), patched(*args)
    assert out_pat.logits is None
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
