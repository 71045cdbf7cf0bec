"""memplan with the rest of the stack: PEFT LoRA, the HF Trainer callback, the Auto class,
accelerate.prepare, nn.DataParallel's replicas, and the specs against the installed
transformers."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch
from torch import nn

import memplan.patching as mp
from memplan.errors import MemplanError, UsageError
from memplan.families import FAMILIES
from memplan.schema import GLU_KERNEL_BY_ACTIVATION

from .tiny_models import assert_grads_close, batch, build, lockstep, pair, rel_err, tiny_config


# LoRA on every linear of llama under `-m slow`; test_patch_applied_before_peft_survives_wrapping
# checks LoRA with FLCE by default
@pytest.mark.parametrize(
    ("family", "targets"),
    [
        pytest.param(
            "llama",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            marks=pytest.mark.slow,
        ),
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]),
        # q and k normalized over the whole projection, after their adapters
        pytest.param("olmo2", ["q_proj", "k_proj", "v_proj", "o_proj"], marks=pytest.mark.slow),
        # q and k normalized per head after their adapters, RoPE in the sliding layer only
        pytest.param("exaone4", ["q_proj", "k_proj", "v_proj", "o_proj"], marks=pytest.mark.slow),
        # half of each head rotated after the adapters; the experts' block keeps its forward
        pytest.param("glm4_moe", ["q_proj", "k_proj", "v_proj", "o_proj"], marks=pytest.mark.slow),
        # latent attention's projections adapted, the latents' norms patched between them
        pytest.param(
            "deepseek_v3",
            ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
            marks=pytest.mark.slow,
        ),
        # v from k_proj in the full layer (no v_proj there), v_norm after the adapters
        pytest.param(
            "gemma4_text", ["q_proj", "k_proj", "v_proj", "o_proj"], marks=pytest.mark.slow
        ),
        # sinks passed to the eager attention, half-width RoPE tables, experts kept
        pytest.param("gpt_oss", ["q_proj", "k_proj", "v_proj", "o_proj"], marks=pytest.mark.slow),
        # the attention keeps its forward; gate/up/down adapt the shared expert
        pytest.param(
            "llama4_text", ["q_proj", "v_proj", "gate_proj", "down_proj"], marks=pytest.mark.slow
        ),
    ],
)
def test_peft_lora_model_trains_like_hf(family, targets):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    base = build(family)
    reference = get_peft_model(copy.deepcopy(base), config)
    patched = get_peft_model(copy.deepcopy(base), config)
    for (_, a), (_, b) in zip(reference.named_parameters(), patched.named_parameters()):
        b.data.copy_(a.data)  # the LoRA B matrices start at zero: make them differ
        if a.requires_grad:
            torch.nn.init.normal_(a.data, std=0.02)
            b.data.copy_(a.data)
    applied = mp.apply(patched)
    mlp = FAMILIES[base.config.model_type].patch.mlp
    # gpt-oss's experts keep their own gate: no MLP module for a GLU kernel
    glus = (
        {GLU_KERNEL_BY_ACTIVATION[getattr(base.config, mlp.activation_config_attr)]}
        if mlp
        else set()
    )
    rope = {"rope"} if FAMILIES[family].patch.attention.classes else set()  # Llama 4: none
    if "lm_head" in targets:  # FLCE needs a plain projection; the loss runs on the logits
        assert {"rms_norm", "cross_entropy"} | glus | rope <= set(applied.kernels)
        assert "flce" not in applied.kernels
        assert applied.skipped["flce"].startswith("lm_head is a peft.tuners.lora.")
    else:
        assert {"rms_norm", "flce"} | glus | rope <= set(applied.kernels)
    lockstep(reference, patched, steps=2, loss_tol=1e-5, grad_tol=1e-5)
    mp.revert(patched)
    assert mp.applied_patch(patched) is None


def test_patch_applied_before_peft_survives_wrapping():
    from peft import LoraConfig, get_peft_model

    base = build("qwen3")
    reference = copy.deepcopy(base)
    mp.apply(base)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    reference, patched = get_peft_model(reference, config), get_peft_model(base, config)
    patched.load_state_dict(reference.state_dict())
    out_ref, out_pat = reference(**batch()), patched(**batch())
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert out_pat.logits is None
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.rows = [batch(seed=i, b=1, pad=0) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.rows[i].items()}


def _training_args(tmp_path, **overrides):
    from transformers import TrainingArguments

    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**options, **overrides})


def _train_with_trainer(model, tmp_path, callbacks, **overrides) -> list[float]:
    from transformers import Trainer

    args = _training_args(tmp_path, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(8), callbacks=callbacks)
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_trainer_callback_patches_the_model_the_trainer_trains(tmp_path):
    reference = build("llama")
    patched = copy.deepcopy(reference)
    callback = mp.MemplanTrainerCallback(kernels=["rms_norm", "rope", "swiglu", "flce"])
    losses_ref = _train_with_trainer(reference, tmp_path / "ref", [])
    losses_pat = _train_with_trainer(patched, tmp_path / "pat", [callback])
    assert callback.applied is not None and callback.applied.kernels[-1] == "flce"
    assert mp.applied_patch(patched) is callback.applied
    assert len(losses_pat) == 2
    # gradient accumulation: the Trainer passes num_items_in_batch to the patched forward; the
    # patched forward shows HF's signature, so the Trainer keeps the input columns
    assert losses_pat == pytest.approx(losses_ref, rel=1e-5)


@pytest.mark.slow
def test_trainer_callback_keeps_the_trainers_autocast(tmp_path):
    """bf16=True over fp32 weights: the patch is in place before accelerate.prepare wraps the
    forward in autocast, so the projections still run in bf16."""
    dtypes: dict[str, list[torch.dtype]] = {"hf": [], "memplan": []}
    losses = {}
    for name, callbacks in (("hf", []), ("memplan", [mp.MemplanTrainerCallback()])):
        model = build("llama")
        model.model.layers[0].self_attn.o_proj.register_forward_hook(
            lambda module, args, out, seen=dtypes[name]: seen.append(out.dtype)
        )
        losses[name] = _train_with_trainer(model, tmp_path / name, callbacks, bf16=True)
    assert set(dtypes["hf"]) == set(dtypes["memplan"]) == {torch.bfloat16}
    assert losses["memplan"] == pytest.approx(losses["hf"], rel=1e-2)


def test_trainer_setup_reads_what_the_model_does_not_show(tmp_path):
    from memplan.advisor import advise
    from memplan.patching.trainer import trainer_setup
    from memplan.schema import SETUP_OPTIONS

    assert set(SETUP_OPTIONS) <= set(inspect.signature(advise).parameters)
    args = _training_args(tmp_path, bf16=True, gradient_checkpointing=True, optim="adafactor")
    assert trainer_setup(args, build("llama")) == {
        "grad_accum": 2,
        "precision": "amp-bf16",
        "grad_checkpointing": True,
        "optimizer": "adafactor",
    }
    bf16_model = build("llama", dtype=torch.bfloat16)
    # the Trainer's default optimizer is torch's fused AdamW
    assert trainer_setup(_training_args(tmp_path, bf16=True), bf16_model) == {
        "grad_accum": 2,
        "optimizer": "adamw-fused",
    }
    foreach = _training_args(tmp_path, bf16=True, optim="adamw_torch")
    assert trainer_setup(foreach, bf16_model)["optimizer"] == "adamw"
    with pytest.warns(UserWarning, match="does not model the memory of optim='lion_8bit'"):
        unknown = trainer_setup(_training_args(tmp_path, optim="lion_8bit"), bf16_model)
    assert "optimizer" not in unknown


def test_apply_setup_reaches_the_advisor():
    from memplan.advisor import advise
    from memplan.catalog import spec_from_config

    model = build("llama")
    setup = {"precision": "amp-bf16", "grad_checkpointing": True, "grad_accum": 4}
    applied = mp.apply(model, batch=2, seq=12, gpu="h100", setup=setup)
    spec = spec_from_config(model.config.to_dict(), "llama")
    expected = advise(spec, 2, 12, gpu="h100", attn="eager", **setup).plan
    assert applied.plan == expected
    with pytest.raises(UsageError, match="unknown setup option dtype; valid: precision"):
        mp.apply(build("llama"), batch=2, seq=12, setup={"dtype": "bf16"})


def test_auto_class_builds_and_patches():
    config = tiny_config("gemma2")
    model = mp.AutoMemplanModelForCausalLM.from_config(config, memplan_kernels=["rms_norm"])
    applied = mp.applied_patch(model)
    assert applied is not None and applied.kernels == ("rms_norm",)
    with pytest.raises(UsageError, match="unknown option memplan_kernel; valid: memplan_plan"):
        mp.AutoMemplanModelForCausalLM.from_config(config, memplan_kernel=["rms_norm"])
    with pytest.raises(TypeError):
        mp.AutoMemplanModelForCausalLM()


def test_auto_class_from_pretrained(tmp_path):
    build("mistral").save_pretrained(tmp_path)
    model = mp.AutoMemplanModelForCausalLM.from_pretrained(tmp_path, memplan_plan=None)
    assert mp.applied_patch(model).kernels == ("rms_norm", "rope", "swiglu", "flce", "embedding")


def test_patch_survives_accelerate_prepare():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    reference = build("llama")
    patched = copy.deepcopy(reference)
    mp.apply(patched)
    try:
        prepared = Accelerator(cpu=True).prepare(patched)
        out_ref, out_pat = reference(**batch()), prepared(**batch())
    finally:  # the accelerator's state is process-wide
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert out_pat.logits is None
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert mp.applied_patch(prepared) is not None


def test_specs_name_classes_transformers_defines():
    """Guards against transformers renaming a class a spec relies on."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert set(mp.SUPPORTED_MODEL_TYPES) == set(FAMILIES)
    for model_type, family in FAMILIES.items():
        spec = family.patch
        assert model_type in CONFIG_MAPPING_NAMES
        package = model_type.removesuffix("_text")  # gemma3_text's classes are gemma3's
        modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        parts = [spec.norm, spec.attention, spec.causal_lm] + ([spec.mlp] if spec.mlp else [])
        for part in parts:
            for cls in part.classes:
                assert hasattr(modeling, cls), f"{model_type}: transformers has no {cls}"
        assert hasattr(modeling, "eager_attention_forward")
        if spec.attention.query_scale == "llama4":
            assert hasattr(modeling, "get_llama_4_attn_scale")
        if spec.causal_lm.moe_aux_loss:
            assert hasattr(modeling, "load_balancing_loss_func")


def test_auto_plan_asks_the_advisor_for_this_model():
    from memplan.advisor import advise
    from memplan.catalog import spec_from_config

    model = build("gemma2")
    applied = mp.apply(model, batch=2, seq=12, gpu="h100")
    spec = spec_from_config(model.config.to_dict(), "gemma2")
    expected = advise(spec, 2, 12, gpu="h100", precision="fp32", attn="eager").plan
    assert applied.plan == expected
    assert expected.kernels and set(applied.kernels) == set(expected.kernels)
    assert applied.flce_chunk == expected.flce_chunk


# torch.compile of a whole model (about 5 s); the default run compiles memplan's custom ops in
# tests/kernels (test_torch_compile_fullgraph in test_flce.py and test_cross_entropy.py)
@pytest.mark.slow
def test_patched_model_compiles_without_graph_breaks():
    """torch.compile traces the instance forwards and memplan's custom ops (their fake
    implementations) in one graph; aot_eager runs the real kernels."""
    reference = build("qwen3")
    patched = copy.deepcopy(reference)
    mp.apply(patched)
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)
    out_ref, out_pat = reference(**batch()), compiled(**batch())
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert rel_err(out_pat.loss, out_ref.loss) <= 1e-5
    assert_grads_close(reference, patched, 1e-5)
    assert mp.applied_patch(compiled) is not None


def test_trainer_callback_late_under_mixed_precision_says_where_to_patch(tmp_path):
    """model_init builds the model inside train(), after on_init_end and before on_train_begin
    sees it inside accelerate's autocast wrapper: one clear error saying where to patch."""
    from transformers import Trainer

    trainer = Trainer(
        model_init=lambda *_: build("llama"),
        args=_training_args(tmp_path, bf16=True),
        train_dataset=_Tokens(8),
        callbacks=[mp.MemplanTrainerCallback()],
    )
    with pytest.raises(MemplanError, match="inside model_init"):
        trainer.train()


def test_trainer_callback_late_without_mixed_precision_patches(tmp_path):
    from transformers import Trainer

    callback = mp.MemplanTrainerCallback(kernels=["rms_norm", "flce"])
    trainer = Trainer(model=build("llama"), args=_training_args(tmp_path), train_dataset=_Tokens(8))
    trainer.add_callback(callback)
    trainer.train()
    assert mp.applied_patch(trainer.model) is callback.applied is not None


def test_trainer_callback_warns_when_another_library_replaces_the_patched_forward(tmp_path):
    """TRL's SFTTrainer (1.x) wraps the causal-LM forward with its own fused LM head after the
    Trainer is built: memplan's loss kernels no longer run, which the callback says."""
    import functools
    import types

    from transformers import Trainer

    callback = mp.MemplanTrainerCallback(kernels=["rms_norm", "flce"])
    model = build("llama")
    trainer = Trainer(
        model=model, args=_training_args(tmp_path), train_dataset=_Tokens(8), callbacks=[callback]
    )
    patched_forward = model.forward

    @functools.wraps(type(model).forward)  # HF's signature: the Trainer keeps the input columns
    def their_forward(self, *args, **kwargs):
        return patched_forward(*args, **kwargs)

    model.forward = types.MethodType(their_forward, model)
    with pytest.warns(UserWarning, match="replaced after the callback patched it"):
        trainer.train()


def test_trainer_callback_does_not_warn_under_accelerates_wrapper(tmp_path, recwarn):
    callback = mp.MemplanTrainerCallback(kernels=["rms_norm", "flce"])
    _train_with_trainer(build("llama"), tmp_path, [callback], bf16=True)
    assert not [w for w in recwarn if "memplan" in str(w.message)]


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
