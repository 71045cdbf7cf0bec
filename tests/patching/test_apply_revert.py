"""apply/revert mechanics: bit-identical revert, idempotence, atomic failure, error paths,
isolation from unpatched models, plans."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan.patching as mp
from memplan.errors import MemplanError, UsageError
from memplan.patching import engine
from memplan.schema import KERNEL_NAMES, Plan

from .tiny_models import batch, build, pair, rel_err


def instance_forwards(model: nn.Module) -> dict[str, object]:
    """Qualified name -> the forward set on that instance (empty when nothing is patched)."""
    return {
        name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__
    }


def step_outputs(model: nn.Module) -> list[torch.Tensor]:
    """Loss, logits (eval) and every gradient of one forward/backward, for bitwise comparison."""
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(**batch()).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits = model(**batch()).logits
    model.train()
    return [loss.detach(), logits, *grads]


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        *(
            pytest.param(f, marks=pytest.mark.slow)
            for f in (
                "gemma2",
                "phi3",
                "mixtral",
                "olmo2",
                "olmo3",
                "exaone4",
                "glm4_moe",
                "deepseek_v3",
                "gemma4_text",
                "llama4_text",
                "qwen3_5_moe_text",
                "qwen3_next",
            )
        ),
    ],
)
def test_revert_restores_bit_identical_outputs(family):
    model = build(family)
    before = step_outputs(model)
    mp.apply(model)
    assert instance_forwards(model)
    patched = step_outputs(model)
    assert not torch.equal(patched[1], before[1])  # the kernels did run
    assert mp.revert(model) is True
    assert instance_forwards(model) == {}
    after = step_outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert mp.revert(model) is False  # nothing left to revert


def test_apply_twice_is_a_no_op():
    model = build("qwen3")
    first = mp.apply(model)
    forwards = instance_forwards(model)
    second = mp.apply(model)
    assert second is first
    assert instance_forwards(model) == forwards


def test_apply_with_other_kernels_replaces_the_patch():
    model = build("llama")
    before = step_outputs(model)
    mp.apply(model)
    applied = mp.apply(model, kernels=["rms_norm"])
    assert applied.kernels == ("rms_norm",)
    patched = set(instance_forwards(model))
    assert patched == set(applied.modules["rms_norm"])
    mp.revert(model)
    assert all(torch.equal(a, b) for a, b in zip(before, step_outputs(model)))


def test_applied_patch_reports_modules_and_chunk():
    model = build("gemma3_text")
    applied = mp.apply(model, flce_chunk=8)
    assert applied.model_type == "gemma3_text"
    assert applied.kernels == ("rms_norm", "rope", "geglu", "flce", "embedding")
    # 4 norms per layer + q_norm/k_norm per layer + the final norm
    assert len(applied.modules["rms_norm"]) == 2 * 6 + 1
    assert applied.modules["rope"] == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert applied.modules["flce"] == ("Gemma3ForCausalLM",)
    assert applied.flce_chunk == 8
    assert mp.applied_patch(model) is applied
    assert "flce chunk: 8" in str(applied)


def test_failure_midway_restores_every_module(monkeypatch):
    model = build("llama")
    before = step_outputs(model)
    real_install = engine._install
    calls = []

    def failing_install(module, forward):
        calls.append(module)
        if len(calls) == 6:
            raise RuntimeError("injected failure")
        return real_install(module, forward)

    monkeypatch.setattr(engine, "_install", failing_install)
    with pytest.raises(MemplanError, match="injected failure.*unchanged"):
        mp.apply(model)
    assert len(calls) == 6
    assert instance_forwards(model) == {}
    assert mp.applied_patch(model) is None
    assert all(torch.equal(a, b) for a, b in zip(before, step_outputs(model)))


def test_failure_while_replanning_keeps_the_previous_patch(monkeypatch):
    model = build("llama")
    first = mp.apply(model, kernels=["rms_norm", "rope"])
    forwards = instance_forwards(model)
    real_install = engine._install
    calls = []

    def failing_install(module, forward):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_install(module, forward)

    monkeypatch.setattr(engine, "_install", failing_install)
    with pytest.raises(MemplanError, match="injected failure"):
        mp.apply(model)
    monkeypatch.setattr(engine, "_install", real_install)
    assert mp.applied_patch(model) is first
    assert {k: v.__func__ for k, v in instance_forwards(model).items()} == {
        k: v.__func__ for k, v in forwards.items()
    }


def test_unexpected_layout_is_reported_before_anything_changes():
    model = build("llama")
    del model.model.layers[1].self_attn.o_proj
    with pytest.raises(MemplanError, match=r"model\.layers\.1\.self_attn .*o_proj"):
        mp.apply(model)
    assert instance_forwards(model) == {}


def test_a_gated_norm_with_another_activation_is_refused_before_anything_changes():
    """The gated RMSNorm kernel gates with SiLU: a DeltaNet norm set to another activation is
    reported, and the model is left as it was."""
    model = build("qwen3_5_text")
    model.model.layers[0].linear_attn.norm.activation = "gelu"
    with pytest.raises(MemplanError, match=r"layers\.0\.linear_attn\.norm .*'gelu', not silu"):
        mp.apply(model)
    assert instance_forwards(model) == {}


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(MemplanError, match="'gpt2'.*supported: llama, mistral"):
        mp.apply(model)
    assert instance_forwards(model) == {}


def test_not_a_transformers_model():
    with pytest.raises(UsageError, match="not Linear"):
        mp.apply(nn.Linear(4, 4))


def test_unknown_kernel_names_the_valid_ones():
    model = build("llama")
    with pytest.raises(
        UsageError, match="unknown kernel 'rmsnorm'; valid: " + ", ".join(KERNEL_NAMES)
    ):
        mp.apply(model, kernels=["rmsnorm"])
    with pytest.raises(
        UsageError, match="llama cannot use geglu; it supports: rms_norm, rope, swiglu"
    ):
        mp.apply(model, kernels=["rms_norm", "geglu"])
    with pytest.raises(UsageError, match="flce_chunk"):
        mp.apply(model, flce_chunk=0)
    with pytest.raises(UsageError, match="flce_memory_budget"):
        mp.apply(model, flce_memory_budget=-1)
    with pytest.raises(UsageError, match="not both"):
        mp.apply(model, flce_chunk=8, flce_memory_budget=2**20)
    with pytest.raises(UsageError, match="plan must be"):
        mp.apply(model, plan="fast")
    assert instance_forwards(model) == {}


def test_no_gpu_is_an_error_outside_the_interpreter(monkeypatch):
    model = build("llama")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemplanError, match="need a CUDA GPU"):
        mp.apply(model)
    assert instance_forwards(model) == {}


def test_plan_kernels_the_model_cannot_use_are_skipped():
    model = build("llama")
    plan = Plan(kernels=("rms_norm", "geglu", "flce"), flce_chunk=16)
    applied = mp.apply(model, plan)
    assert applied.kernels == ("rms_norm", "flce")
    assert set(applied.skipped) == {"geglu"}
    assert applied.flce_chunk == 16 and applied.plan == plan
    assert mp.apply(model, plan, flce_chunk=32).flce_chunk == 32


def test_plan_memory_budget_reaches_the_loss_kernel(monkeypatch):
    """A plan's FLCE memory budget is what the kernel receives, as memory_budget."""
    import memplan.kernels.fused_linear_cross_entropy as flce_module

    calls = []
    kernel = flce_module.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append((kwargs.get("chunk_size"), kwargs.get("memory_budget")))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(flce_module, "fused_linear_cross_entropy", spy)
    model = build("llama")
    applied = mp.apply(model, Plan(kernels=("flce",), flce_memory_budget=2**20))
    assert applied.flce_memory_budget == 2**20 and applied.flce_chunk is None
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == [(None, 2**20)]


def test_unpatched_model_in_the_same_process_is_unaffected():
    import transformers.models.llama.modeling_llama as modeling_llama

    globals_before = dict(vars(modeling_llama))
    torch_before = (F.cross_entropy, F.silu, F.rms_norm if hasattr(F, "rms_norm") else None)
    class_forwards = {
        cls: cls.forward
        for cls in (
            modeling_llama.LlamaRMSNorm,
            modeling_llama.LlamaAttention,
            modeling_llama.LlamaMLP,
            modeling_llama.LlamaForCausalLM,
        )
    }
    bystander, patched = pair("llama")
    before = step_outputs(bystander)
    mp.apply(patched)
    patched(**batch()).loss.backward()
    assert instance_forwards(bystander) == {}
    assert all(torch.equal(a, b) for a, b in zip(before, step_outputs(bystander)))
    assert dict(vars(modeling_llama)) == globals_before
    assert (F.cross_entropy, F.silu, F.rms_norm if hasattr(F, "rms_norm") else None) == torch_before
    assert {cls: cls.forward for cls in class_forwards} == class_forwards


def test_deepcopy_of_a_patched_model_is_patched_on_its_own_modules():
    model = build("llama")
    mp.apply(model)
    twin = copy.deepcopy(model)
    for name, forward in instance_forwards(twin).items():
        assert forward.__self__ is (twin.get_submodule(name) if name else twin)
    mp.revert(twin)
    assert instance_forwards(twin) == {}
    assert instance_forwards(model)


def test_deepcopy_of_a_patched_model_runs_its_own_weights():
    """The causal-LM forward falls back to HF's in eval and without labels: through the copy's
    own method, not the source model's (which a closure over the bound method would call)."""
    model = build("llama")
    mp.apply(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.5)
    twin.eval()
    model.eval()
    with torch.no_grad():
        patched_logits = twin(**batch()).logits
        mp.revert(twin)
        hf_logits = twin(**batch()).logits
        source_logits = model(**batch()).logits
    assert rel_err(patched_logits, hf_logits) <= 1e-5  # the copy's weights, memplan's kernels
    assert rel_err(patched_logits, source_logits) > 1e-2


def test_patched_forward_shows_hf_signature():
    """The Trainer keeps only the dataset columns the forward names; generate() checks it too."""
    import inspect

    reference, patched = pair("qwen3")
    mp.apply(patched)
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)


def test_tuple_output_keeps_the_logits_slot():
    reference, patched = pair("llama")
    mp.apply(patched)
    kwargs = dict(batch(), return_dict=False, output_hidden_states=True, use_cache=False)
    ref, out = reference(**kwargs), patched(**kwargs)
    assert len(out) == len(ref) and out[1] is None
    assert torch.allclose(out[0], ref[0], rtol=1e-5)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(out[-1], ref[-1]))  # hidden states


def test_accelerate_dispatch_hook_is_refused_and_model_unchanged():
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = build("llama")
    add_hook_to_module(model.model.norm, ModelHook())
    before = instance_forwards(model)
    with pytest.raises(MemplanError, match="model.norm carries an accelerate dispatch hook"):
        mp.apply(model)
    assert instance_forwards(model) == before and mp.applied_patch(model) is None


def test_forward_wrapped_by_accelerate_prepare_is_refused_and_model_unchanged():
    """Patching after accelerate.prepare would drop its autocast wrapper (bf16 runs would train
    in fp32): refused, before anything changes."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    model = build("llama")
    try:
        prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    finally:  # the accelerator's state is process-wide
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    before = instance_forwards(prepared)
    with pytest.raises(MemplanError, match="accelerate's mixed-precision wrapper"):
        mp.apply(prepared)
    assert instance_forwards(prepared) == before and mp.applied_patch(prepared) is None


def test_revert_leaves_a_forward_wrapped_after_apply_and_warns():
    model = build("llama")
    mp.apply(model)
    patched_forward = model.forward
    model.forward = lambda *a, **k: patched_forward(*a, **k)  # e.g. accelerate's autocast
    wrapper = model.forward
    with pytest.warns(UserWarning, match="replaced after memplan.apply"):
        mp.revert(model)
    assert model.forward is wrapper
    assert instance_forwards(model) == {"": wrapper}


def test_a_plan_with_both_flce_settings_is_refused_and_model_unchanged():
    model = build("llama")
    plan = Plan(kernels=("flce",), flce_chunk=64, flce_memory_budget=2**20)
    with pytest.raises(UsageError, match="flce_chunk and flce_memory_budget; give one"):
        mp.apply(model, plan)
    assert instance_forwards(model) == {} and mp.applied_patch(model) is None
    with pytest.raises(ValueError, match="greater than 0"):
        Plan(kernels=("flce",), flce_chunk=-5)


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
