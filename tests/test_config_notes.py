"""What a config holds that the estimate does not count, and a GPU that runs the step otherwise
than the estimate assumes: one warning line each, through the Python API and the command line,
and none for a plain config on a recent GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memplan.advisor import advise
from memplan.catalog import catalog_model

LLAMA = catalog_model("llama-3.2-1b").spec.hf_config


def memplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args], capture_output=True, text=True, timeout=120
    )


def test_a_plain_config_on_an_h100_has_no_warning() -> None:
    assert advise(dict(LLAMA), 1, 512).warnings == []
    assert advise("llama-3.2-1b", 1, 512, gpu="a100-40gb").warnings == []


def test_a_quantized_config_says_the_weights_are_predicted_unquantized() -> None:
    quantized = {
        **LLAMA,
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    }
    advice = advise(quantized, 1, 512, lora_rank=16)
    (warning,) = advice.warnings
    assert warning.startswith("the config has a quantization_config (bitsandbytes, 4-bit)")
    assert "predicts unquantized weights" in warning and "4/16 of bf16's bytes" in warning
    # the prediction itself is that of the unquantized model, as the warning says
    assert advice.peak_bytes == advise(dict(LLAMA), 1, 512, lora_rank=16).peak_bytes
    gptq = {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 8}}
    assert "(gptq, 8-bit)" in advise(gptq, 1, 512, lora_rank=16).warnings[0]


def test_a_multimodal_config_says_the_vision_tower_is_not_counted(tmp_path) -> None:
    text = catalog_model("gemma-3-4b").spec.hf_config
    config = {
        "model_type": "gemma3",
        "text_config": {k: v for k, v in text.items() if k != "model_type"},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27},
    }
    config["vision_config"]["hidden_size"] = 1152
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    run = memplan("advise", "--model", str(path), "--batch", "1", "--seq", "512")
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stdout.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1
    assert "multimodal (model_type 'gemma3')" in warnings[0]
    params = advise(config, 1, 512).vision_tower_params
    assert f"its vision tower and multimodal projector ({params:,} parameters" in warnings[0]
    assert "are not counted" in warnings[0] and "--count-vision-tower" in warnings[0]
    assert advise(config, 1, 512).warnings == advise(str(path), 1, 512).warnings
    # a tower memplan does not count itself keeps the generic note
    audio = {**config, "audio_config": {"num_hidden_layers": 32}}
    assert "the audio tower (32 layers)" in advise(audio, 1, 512).warnings[0]


def test_a_config_of_only_model_type_names_the_defaults_it_gets() -> None:
    """{"model_type": "llama"} became Llama-2-7B's sizes without a word."""
    (warning,) = advise({"model_type": "llama"}, 1, 512).warnings
    assert warning.startswith(
        "the config does not give hidden_size, num_hidden_layers, num_attention_heads, "
        "intermediate_size: memplan uses transformers' defaults for model_type 'llama' "
        "(hidden_size 4,096, num_hidden_layers 32, num_attention_heads 32, intermediate_size "
        "11,008)"
    )
    partial = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    (warning,) = advise(partial, 1, 512).warnings
    assert warning.startswith("the config does not give num_hidden_layers:")


@pytest.mark.parametrize(
    "gpu, precision, expected",
    [
        ("t4", "bf16", ["no bf16 arithmetic", "flash attention"]),
        ("v100-32gb", "amp-bf16", ["no bf16 arithmetic", "flash attention"]),
        ("t4", "amp-fp16", ["flash attention"]),
        ("t4", "fp32", []),  # fp32 never runs flash attention; the estimate models that
        ("a10g", "bf16", []),
        ("h100", "bf16", []),
    ],
)
def test_older_gpus_warn_about_bf16_and_flash_attention(gpu, precision, expected) -> None:
    warnings = advise("llama-3.2-1b", 1, 512, gpu=gpu, precision=precision).warnings
    assert len(warnings) == len(expected)
    for warning, words in zip(warnings, expected, strict=True):
        assert words in warning
    if expected and expected[-1] == "flash attention":
        # llama-3.2-1b groups its KV heads: SDPA's math path, far more than predicted
        assert "math path" in warnings[-1]
        assert (
            "math path"
            not in advise(
                {**LLAMA, "num_key_value_heads": LLAMA["num_attention_heads"]},
                1,
                512,
                gpu=gpu,
                precision=precision,
            ).warnings[-1]
        )


def test_the_t4_warning_is_printed_by_advise() -> None:
    run = memplan(
        "advise", "--model", "llama-3.2-1b", "--batch", "1", "--seq", "512", "--gpu", "t4"
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("llama-3.2-1b, batch 1 x seq 512 on T4 16GB: ")
    assert any(line.startswith("Warning: T4 16GB (compute capability 7.5)") for line in lines)


@pytest.mark.parametrize(
    "name, source",
    [
        ("qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig defaults"),
        ("qwen3-next-80b-a3b-instruct", "Qwen3NextConfig defaults"),
    ],
)
def test_a_catalog_entry_written_from_class_defaults_says_so(name: str, source: str) -> None:
    """Entries with no published config.json behind them carry a note the advice repeats; the
    same config given as a dict is the user's own and gets none."""
    notes = [w for w in advise(name, 1, 256, lora_rank=16).warnings if source in w]
    assert len(notes) == 1 and name in notes[0] and "not the checkpoint's config.json" in notes[0]
    config = dict(catalog_model(name).spec.hf_config)
    assert not [w for w in advise(config, 1, 256, lora_rank=16).warnings if source in w]
