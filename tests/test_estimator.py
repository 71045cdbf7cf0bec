"""The estimator against what it must reproduce: parameter counts of the models transformers
builds, and the peaks measured on an H200 under the protocol (tests/data/reference_h200.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memplan.catalog import list_models, spec_from_config
from memplan.estimators import count_params, estimate
from memplan.estimators.params import lora_params
from memplan.schema import TrainSetup

REFERENCE = json.loads((Path(__file__).parent / "data" / "reference_h200.json").read_text())
GIB = 2**30


@pytest.mark.parametrize("name,spec", list_models(), ids=[n for n, _ in list_models()])
def test_param_count_equals_built_model(name, spec) -> None:
    config = dict(spec.hf_config)
    cfg = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())


def test_lora_param_count_equals_peft() -> None:
    peft = pytest.importorskip("peft")
    spec = dict(list_models())["qwen2.5-0.5b"]
    config = dict(spec.hf_config, num_hidden_layers=2)
    cfg = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=32, target_modules=list(targets))
    )
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    small = spec.model_copy(update={"num_hidden_layers": 2})
    assert lora_params(small, TrainSetup(batch=1, seq=1, lora_rank=8, lora_targets=targets)) == (
        trainable
    )


CASES = [k for k, v in REFERENCE.items() if not k.startswith("_") and not v["options"].get("liger")]


@pytest.mark.parametrize("key", CASES)
def test_reference_h200_peaks(key: str) -> None:
    case = REFERENCE[key]
    spec = spec_from_config(dict(case["config"], model_type=case["model_type"]))
    setup = TrainSetup(
        batch=case["batch"],
        seq=case["seq"],
        grad_checkpointing=bool(case["options"].get("grad_ckpt")),
    )
    result = estimate(spec, setup)
    assert result.params == case["n_params"]
    assert result.peak_bytes / GIB == pytest.approx(case["peak"], rel=1e-3)
    assert result.peak_step1_bytes / GIB == pytest.approx(case["peak_step1"], rel=1e-3)


def test_timeline_peak_is_its_maximum_and_steady_adds_states() -> None:
    spec = dict(list_models())["llama-3.2-1b"]
    result = estimate(spec, TrainSetup(batch=2, seq=512))
    assert result.peak_bytes == max(p.allocated_bytes for p in result.timeline)
    assert sum(result.breakdown.values()) == result.peak_bytes
    # Step 1 creates the states at its optimizer step: a peak there is the steady one too.
    assert result.peak_bytes == result.peak_step1_bytes
    assert result.peak_phase == "optimizer"
    large = estimate(spec, TrainSetup(batch=16, seq=2048))
    assert large.peak_phase != "optimizer"
    assert large.peak_bytes > large.peak_step1_bytes


@pytest.mark.parametrize(
    "change",
    [
        {"batch": 8},
        {"seq": 4096},
        {"precision": "fp32"},
        {"attn": "eager"},
        {"optimizer": "adamw"},
    ],
)
def test_more_work_never_predicts_less(change) -> None:
    spec = dict(list_models())["qwen2.5-1.5b"]
    small = TrainSetup(batch=2, seq=1024, optimizer="sgd")
    assert (
        estimate(spec, small.model_copy(update=change)).peak_bytes
        > estimate(spec, small).peak_bytes
    )


def test_checkpointing_and_kernels_lower_the_peak() -> None:
    spec = dict(list_models())["llama-3.2-1b"]
    plain = TrainSetup(batch=8, seq=2048)
    base = estimate(spec, plain).peak_bytes
    ckpt = estimate(spec, plain.model_copy(update={"grad_checkpointing": True})).peak_bytes
    fused = estimate(
        spec, plain.model_copy(update={"kernels": ("rms_norm", "rope", "swiglu", "flce")})
    ).peak_bytes
    assert ckpt < base and fused < base


def test_gradient_accumulation_holds_every_gradient_in_later_micro_steps() -> None:
    """Micro-steps after the first run their forward and backward over the gradients of the
    earlier ones: measured on an H200 (llama-3.2-1b, batch 2 x 1024, bf16, kernels none),
    16.70e9 bytes at 4 accumulation steps against 14.23e9 at 1, the bf16 gradients' 2.47e9."""
    spec = dict(list_models())["llama-3.2-1b"]
    one = TrainSetup(batch=2, seq=1024)
    single = estimate(spec, one)
    accumulated = estimate(spec, one.model_copy(update={"grad_accum": 4}))
    assert accumulated.peak_bytes - single.peak_bytes == 2 * single.params
    assert accumulated.breakdown["gradients"] == 2 * single.params
    # step 1's peak is its optimizer step (states allocated over every gradient) either way
    assert accumulated.peak_step1_bytes == single.peak_step1_bytes
    lora = one.model_copy(update={"lora_rank": 16})
    lora_gain = estimate(spec, lora.model_copy(update={"grad_accum": 2})).peak_bytes
    assert lora_gain - estimate(spec, lora).peak_bytes < 2 * single.params / 100


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": -2048}, "greater than 0"),
        ({"num_attention_heads": 0}, "greater than 0"),
        ({"vocab_size": 0}, "greater than 0"),
        ({"num_key_value_heads": 5}, "must be a multiple of num_key_value_heads"),
        ({"num_experts": 4, "num_experts_per_tok": 8}, "exceeds num_experts"),
        ({"layer_types": ("full_attention",)}, "layer_types has 1 entries for 16 layers"),
    ],
)
def test_impossible_model_numbers_are_refused(change, message) -> None:
    from pydantic import ValidationError

    from memplan.schema import ModelSpec

    spec = dict(list_models())["llama-3.2-1b"]
    with pytest.raises(ValidationError, match=message):
        ModelSpec(**{**spec.model_dump(), **change})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kernels": ("bogus",)}, "unknown kernel 'bogus'"),
        ({"kernels": ("cross_entropy", "flce")}, "both compute the loss"),
        ({"flce_chunk": 128, "flce_memory_budget": 2**20}, "not both"),
        ({"precision": "fp16"}, "precision: Input should be"),
    ],
)
def test_impossible_setups_are_one_usage_error(fields, message) -> None:
    from memplan.errors import UsageError
    from memplan.schema import make_setup

    with pytest.raises(UsageError, match=message):
        make_setup(batch=1, seq=8, **fields)


def test_data_parallelism_is_refused_where_layers_differ() -> None:
    """GLM-4.5's dense first layers and fp32 router are modelled on one GPU: a strategy is one
    UsageError, and advise offers no GPU counts (rather than a walk that shards one layer's
    parameters for every layer)."""
    from memplan.advisor import advise
    from memplan.catalog import resolve_model
    from memplan.errors import UsageError

    spec = resolve_model("glm-4.5-air")
    with pytest.raises(UsageError, match="estimated on one GPU only"):
        estimate(spec, TrainSetup(batch=1, seq=256, gpus=8, strategy="fsdp2"))
    advice = advise(spec, batch=1, seq=256, gpu="H100")
    assert not advice.fits and advice.gpu_counts == []
    assert any("estimated on one GPU only" in warning for warning in advice.warnings)
