"""Fixes from a ninth review of the patcher: nn.DataParallel replicas, LoRA targets read off a
PEFT model for the advisor, re-applying under another plan, and the tuple output's cache slot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memplan.patching as mp
from memplan.schema import Plan

from .tiny_models import batch, build, pair, rel_err


def data_parallel_replica(network: nn.Module, scale: float) -> nn.Module:
    """The replica torch.nn.parallel.replicate builds for another device (it needs CUDA; these
    are the same module copies on the CPU): every module copied by `_replicate_for_data_parallel`,
    children re-linked, each parameter replaced by a non-leaf copy (as Broadcast gives), here
    scaled by `scale` so that running the original's parameters shows."""
    modules = list(network.modules())
    copies = [m._replicate_for_data_parallel() for m in modules]
    index = {id(m): i for i, m in enumerate(modules)}
    for module, replica in zip(modules, copies):
        for key, child in module._modules.items():
            setattr(replica, key, None if child is None else copies[index[id(child)]])
        for key, param in module._parameters.items():
            setattr(replica, key, None if param is None else param * scale)
    return copies[0]


def test_data_parallel_replica_runs_its_own_parameters():
    """The Trainer wraps the model in nn.DataParallel when it sees several GPUs. A replica's
    instance forward, copied with its __dict__, stayed bound to the original module: replicas
    ran the original's parameters (on the first GPU) and their own got no gradient."""
    reference, patched = pair("llama")
    mp.apply(patched)
    losses = []
    for model in (reference, patched):
        loss = data_parallel_replica(model, scale=1.25)(**batch()).loss
        loss.backward()
        losses.append(loss)
    assert rel_err(losses[1], losses[0]) <= 1e-5
    named = dict(patched.named_parameters())
    for name, param in reference.named_parameters():
        assert rel_err(named[name].grad, param.grad) <= 1e-5, name
    assert mp.revert(patched)
    assert not [m for m in patched.modules() if "_replicate_for_data_parallel" in vars(m)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs two GPUs")
def test_data_parallel_on_two_gpus_trains_like_hf():
    reference, patched = pair("llama")
    mp.apply(patched)
    losses = []
    for model in (reference, patched):
        inputs = {k: v.cuda() for k, v in batch().items()}
        loss = nn.DataParallel(model.cuda(), device_ids=[0, 1])(**inputs).loss
        loss.sum().backward()
        losses.append(loss)
    assert losses[1].shape == (2,) and rel_err(losses[1], losses[0]) <= 1e-5
    named = dict(patched.named_parameters())
    for name, param in reference.named_parameters():
        assert rel_err(named[name].grad, param.grad) <= 1e-5, name


@pytest.mark.parametrize(
    ("target_modules", "expected"),
    [
        (r".*\.(q_proj|v_proj)", ("q_proj", "v_proj")),
        (
            "all-linear",
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        ),
        (["v_proj", "down_proj", "lm_head"], ("v_proj", "down_proj")),
    ],
)
def test_auto_plan_reads_lora_targets_off_the_adapted_modules(target_modules, expected):
    """peft's target_modules may be a regex or "all-linear" (which peft expands to qualified
    names), and may include lm_head, which the estimator does not model: the advisor was given
    the regex's characters or the qualified names and refused every one as a target."""
    from peft import LoraConfig, get_peft_model

    from memplan.advisor import advise
    from memplan.catalog import spec_from_config

    model = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=target_modules))
    applied = mp.apply(model, batch=2, seq=12, gpu="h100")
    spec = spec_from_config(model.get_base_model().config.to_dict(), "llama")
    options = dict(gpu="h100", precision="fp32", attn="eager", lora_rank=4)
    assert applied.plan == advise(spec, 2, 12, lora_targets=expected, **options).plan


def test_applying_the_same_kernels_under_another_plan_reports_that_plan():
    """apply returned the first AppliedPatch when the kernels and chunk were the same: its plan,
    what it advises (checkpointing, gradient accumulation) and predicted peak, were stale."""
    model = build("llama")
    first = mp.apply(model, batch=2, seq=12, gpu="h100")
    setup = {"grad_checkpointing": True, "grad_accum": 4}
    second = mp.apply(model, batch=2, seq=12, gpu="h100", setup=setup)
    assert second.kernels == first.kernels and second.flce_chunk == first.flce_chunk
    assert second.plan != first.plan
    assert (second.plan.grad_checkpointing, second.plan.grad_accum) == (True, 4)
    assert "checkpointing on" in str(second) and mp.applied_patch(model) is second
    assert mp.apply(model, batch=2, seq=12, gpu="h100", setup=setup) is second

    plan = Plan(kernels=("rms_norm", "geglu"))
    assert mp.apply(model, plan).skipped.keys() == {"geglu"}
    explicit = mp.apply(model, kernels=["rms_norm"])
    assert explicit.plan is None and explicit.skipped == {}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_tuple_output_keeps_the_cache_slot_hf_fills_in_training(family):
    """In training HF builds a cache (config.use_cache) and its tuple holds it before the
    hidden states; memplan turns that cache off, which moved the hidden states one slot left
    (out[3] was an IndexError or the attentions). Under gradient checkpointing HF has no cache
    either, and the slots agree without it."""
    reference, patched = pair(family)
    mp.apply(patched)
    for checkpointing in (False, True):
        if checkpointing:
            for model in (reference, patched):
                model.gradient_checkpointing_enable()
        kwargs = dict(batch(), return_dict=False, output_hidden_states=True)
        ref, out = reference(**kwargs), patched(**kwargs)
        assert len(out) == len(ref)
        for mine, theirs in zip(out, ref):
            if mine is None:  # the logits and the cache memplan does not build
                assert isinstance(theirs, torch.Tensor) or hasattr(theirs, "get_seq_length")
            elif isinstance(theirs, tuple):  # hidden states, router logits
                assert all(rel_err(a, b) <= 1e-5 for a, b in zip(mine, theirs))
            else:
                assert rel_err(mine, theirs) <= 1e-5
