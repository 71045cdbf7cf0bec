"""A multimodal config's vision tower and projector: their parameters as transformers builds them
(memplan.catalog.vision_tower), and what the estimate does with them (nothing unless asked, their
weights when frozen, weights, gradients and optimizer states when trained), said in a warning
and in the Python API's result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memplan.advisor import advise
from memplan.catalog import spec_from_config
from memplan.catalog.models import _MODELS_JSON
from memplan.errors import MemplanError, UsageError
from memplan.estimators import estimate
from memplan.estimators.timeline import round_block
from memplan.schema import TrainSetup

# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json, as the catalog holds it
PUBLISHED = json.loads(_MODELS_JSON.read_text())["mistral-small-3.1-24b"]["config"]
TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}
TINY_PIXTRAL = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "image_size": 32,
}
TINY_SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "image_size": 32,
}
GEMMA3_4B_VISION = {  # google/gemma-3-4b-pt's vision_config
    "hidden_size": 1152,
    "image_size": 896,
    "intermediate_size": 4304,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "vision_use_head": False,
}

TINY_LLAMA4_VISION = {
    "model_type": "llama4_vision_model",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "image_size": 32,
    "vision_output_dim": 40,
    "projector_input_dim": 24,
    "projector_output_dim": 24,
}
# meta-llama/Llama-4-Scout-17B-16E, as the catalog holds it
SCOUT = json.loads(_MODELS_JSON.read_text())["llama-4-scout-17b-16e"]["config"]


def gemma3(vision: dict | None, **outer) -> dict:
    text = {**TINY_TEXT, "model_type": "gemma3_text", "head_dim": 16}
    return {"model_type": "gemma3", "text_config": text, "vision_config": vision, **outer}


def mistral3(vision: dict | None, text_type: str = "mistral", **outer) -> dict:
    text = {**TINY_TEXT, "model_type": text_type}
    return {"model_type": "mistral3", "text_config": text, "vision_config": vision, **outer}


TINY_GEMMA4_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 4,
    "position_embedding_size": 64,
}


def gemma4(vision: dict | None, **outer) -> dict:
    text = {**TINY_TEXT, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0}
    text.update(layer_types=["sliding_attention", "full_attention"], global_head_dim=32)
    return {"model_type": "gemma4", "text_config": text, "vision_config": vision, **outer}


def llama4(vision: dict | None) -> dict:
    text = {**TINY_TEXT, "model_type": "llama4_text", "num_local_experts": 2}
    return {"model_type": "llama4", "text_config": text, "vision_config": vision}


def qwen3_5_moe(vision: dict | None) -> dict:
    text = {**TINY_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4}
    text.update(num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision}


CONFIGS = {
    "mistral-small-3.1 (published)": PUBLISHED,
    "gemma-3-4b vision_config": gemma3(GEMMA3_4B_VISION, mm_tokens_per_image=256),
    "siglip with its pooling head": gemma3({**TINY_SIGLIP}),
    "siglip, vision_use_head null": gemma3({**TINY_SIGLIP, "vision_use_head": None}),
    "gemma3 without vision_config": gemma3(None, mm_tokens_per_image=196),
    "pixtral, ministral3 text": mistral3(TINY_PIXTRAL, "ministral3"),
    "pixtral, projector biases, two feature layers, merge 1": mistral3(
        TINY_PIXTRAL,
        multimodal_projector_bias=True,
        vision_feature_layer=[-1, -2],
        spatial_merge_size=1,
    ),
    "pixtral, rectangular patches": mistral3({**TINY_PIXTRAL, "patch_size": [4, 2]}),
    "mistral3 without vision_config": mistral3(None),
    "gemma4 vision tower and embedder": gemma4(TINY_GEMMA4_VISION),
    "gemma4, vision_config defaults": gemma4({"model_type": "gemma4_vision"}),
    "gemma4 without vision_config": gemma4(None),
    "llama-4-scout (published)": SCOUT,
    "llama4 vision tower": llama4(TINY_LLAMA4_VISION),
    "llama4 without vision_config": llama4(None),
    # Qwen3.5's tower under the MoE wrapper's names, the merger its projection
    "qwen3_5_moe, vision_config defaults": qwen3_5_moe({"model_type": "qwen3_5_moe_vision"}),
    "qwen3_5_moe without vision_config": qwen3_5_moe(None),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_equal_the_modules_transformers_builds(name: str) -> None:
    """Every parameter of the tower and the projector, in registration order, against the
    multimodal model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = json.loads(json.dumps(CONFIGS[name]))
    spec = spec_from_config(json.loads(json.dumps(config)))
    try:
        built_config = AutoConfig.for_model(**config)
    except Exception as exc:  # later releases validate config fields (5.24 refuses a null here)
        pytest.skip(f"the installed transformers refuses this config: {type(exc).__name__}")
    with torch.device("meta"):
        model = AutoModel.from_config(built_config)
    built = [p.numel() for n, p in model.named_parameters() if not n.startswith("language_model.")]
    assert list(spec.vision_tower_tensors) == built
    assert spec.wrapper_model_type == config["model_type"]


def test_a_vision_model_the_wrapper_does_not_build_is_refused() -> None:
    config = mistral3({**TINY_PIXTRAL, "model_type": "siglip_vision_model"})
    with pytest.raises(MemplanError, match="vision_config model_type 'pixtral', not"):
        spec_from_config(config)


def test_the_text_model_is_predicted_alone_unless_asked() -> None:
    advice = advise(PUBLISHED, 1, 1024, gpu="h200")
    spec = spec_from_config(PUBLISHED)
    assert advice.vision_tower_params == spec.vision_tower_params == 438_958_080
    assert advice.peak_bytes == advise(dict(spec.hf_config), 1, 1024, gpu="h200").peak_bytes
    (warning,) = advice.warnings
    assert warning.startswith("the config is multimodal (model_type 'mistral3'): memplan ")
    assert "(438,958,080 parameters, 0.82 GiB of weights, from vision_config) are not " in warning


def _optimizer_step_bytes(spec, setup) -> int:
    timeline = estimate(spec, setup).timeline
    return next(p.allocated_bytes for p in timeline if p.label == "optimizer step")


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_a_counted_tower_adds_its_weights_and_when_trained_its_gradients_and_states(precision):
    """Each tensor is one allocation: frozen adds its weights everywhere in the step; trained
    adds at the optimizer step its gradients, AdamW's two states and foreach's temporary."""
    spec = spec_from_config(PUBLISHED)
    text = spec.model_copy(update={"vision_tower_tensors": ()})
    param = 2 if precision == "bf16" else 4
    weights = sum(round_block(n * param) for n in spec.vision_tower_tensors)
    setup = TrainSetup(batch=1, seq=512, precision=precision)
    frozen = setup.model_copy(update={"count_vision_tower": "frozen"})
    trained = setup.model_copy(update={"count_vision_tower": "trained"})
    assert estimate(spec, setup) == estimate(text, setup)
    base, with_frozen = estimate(text, setup), estimate(spec, frozen)
    assert with_frozen.peak_bytes - base.peak_bytes == weights
    assert with_frozen.params - base.params == spec.vision_tower_params
    assert with_frozen.trainable_params == base.trainable_params
    step = _optimizer_step_bytes(spec, trained) - _optimizer_step_bytes(spec, frozen)
    assert step == 4 * weights  # gradients, exp_avg, exp_avg_sq, foreach's sqrt(exp_avg_sq)
    assert estimate(spec, trained).trainable_params == spec.vision_tower_params + base.params


def test_under_lora_the_tower_counts_frozen() -> None:
    spec = spec_from_config(PUBLISHED)
    lora = {"lora_rank": 16, "lora_targets": ("q_proj", "v_proj")}
    frozen = advise(PUBLISHED, 1, 1024, count_vision_tower="frozen", **lora)
    alone = advise(PUBLISHED, 1, 1024, **lora)
    # by the walk's tensors (the allocator replay's blocks may round them up)
    walked = [estimate(spec, a.setup, a.gpu).peak_bytes for a in (frozen, alone)]
    assert walked[0] - walked[1] == sum(round_block(2 * n) for n in spec.vision_tower_tensors)
    assert "counts the weights of its vision tower" in frozen.warnings[0]
    with pytest.raises(UsageError, match="under LoRA the vision tower is frozen"):
        advise(PUBLISHED, 1, 1024, count_vision_tower="trained", **lora)


def test_a_lora_suggestion_counts_a_trained_tower_frozen() -> None:
    """peft freezes the base model, the tower with it."""
    advice = advise(PUBLISHED, 8, 4096, count_vision_tower="trained")
    assert not advice.fits and advice.gpu_counts == []
    lora = [s for s in advice.suggestions if s.setup.lora_rank]
    assert lora and all(s.setup.count_vision_tower == "frozen" for s in lora)


@pytest.mark.parametrize(
    "model,options,message",
    [
        ("llama-3.2-1b", {"count_vision_tower": "frozen"}, "llama-3.2-1b is a text model"),
        (PUBLISHED, {"count_vision_tower": "all"}, "must be frozen or trained"),
        (PUBLISHED, {"count_vision_tower": "frozen", "method": "traced"}, "the traced one"),
        (
            PUBLISHED,
            {"count_vision_tower": "frozen", "gpus": 2, "strategy": "fsdp2"},
            "modelled on one GPU",
        ),
    ],
)
def test_a_tower_that_cannot_be_counted_is_a_usage_error(model, options, message) -> None:
    with pytest.raises(UsageError, match=message):
        advise(model, 1, 512, **options)


def test_the_command_line_counts_the_tower_and_says_so() -> None:
    def warnings_of(*extra: str) -> tuple[list[str], list[str]]:
        args = ["--model", "mistral-small-3.1-24b", "--batch", "1", "--seq", "512", *extra]
        run = subprocess.run(
            [sys.executable, "-m", "memplan", "advise", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        return [line for line in lines if line.startswith("Warning:")], lines

    (alone,), _ = warnings_of()
    assert "are not counted" in alone and "--count-vision-tower" in alone
    (trained,), lines = warnings_of("--count-vision-tower", "trained", "--gpu", "h200")
    assert "counts the weights, gradients and optimizer states of its vision tower" in trained
    setup = next(line for line in lines if line.startswith("Setup:"))
    assert setup.startswith("Setup: 24B parameters (24B trainable)")
    assert "vision tower counted, trained" in setup


def test_a_text_only_batch_gives_a_trainable_tower_no_gradient_nor_state() -> None:
    """Why frozen is also the count for a trainable tower under text-only batches: its
    parameters get no gradient, so AdamW makes them no state."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = AutoConfig.for_model(**json.loads(json.dumps(mistral3(TINY_PIXTRAL, "ministral3"))))
    model = AutoModelForImageTextToText.from_config(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tower = [p for n, p in model.named_parameters() if not n.startswith("model.language_model.")]
    tower = [p for p in tower if p is not model.lm_head.weight]
    assert len(tower) == len(
        spec_from_config(mistral3(TINY_PIXTRAL, "ministral3")).vision_tower_tensors
    )
    assert all(p.requires_grad and p.grad is None and p not in optimizer.state for p in tower)
    assert model.lm_head.weight.grad is not None
