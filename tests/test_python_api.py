"""The Python API as a notebook user meets it: what advise takes as a model, errors in the API's
own names, the same rules as the command line, and a package whose dir() shows the API."""

from __future__ import annotations

import pytest

import memplan
from memplan.catalog import catalog_model
from memplan.errors import UsageError

LLAMA = catalog_model("llama-3.2-1b").spec.hf_config


def test_dir_shows_the_public_api() -> None:
    names = dir(memplan)
    for name in ("advise", "apply", "revert", "verify", "track", "Advice", "Plan", "MemplanError"):
        assert name in names
    assert "importlib" not in names and "Any" not in names


def test_advise_takes_a_config_dict_a_transformers_config_or_model() -> None:
    """Each raised AttributeError: 'dict' object has no attribute 'strip'."""
    transformers = pytest.importorskip("transformers")
    by_name = memplan.advise("llama-3.2-1b", 2, 512)
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    for model in (dict(LLAMA), config):
        advice = memplan.advise(model, 2, 512)
        assert advice.peak_bytes == by_name.peak_bytes and advice.warnings == []
    tiny = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=256,
    )  # fmt: skip
    built = transformers.AutoModelForCausalLM.from_config(tiny)
    from_model = memplan.advise(built, 2, 64)
    assert from_model.estimate.params == sum(p.numel() for p in built.parameters())
    assert from_model.peak_bytes == memplan.advise(tiny, 2, 64).peak_bytes


@pytest.mark.parametrize("model", [42, None, ["llama"]])
def test_advise_says_what_it_takes(model) -> None:
    with pytest.raises(UsageError) as caught:
        memplan.advise(model, 1, 64)
    assert str(caught.value).startswith(
        "the model must be a catalog name, a config.json path or folder, a hub id, a config "
        "dict, a transformers config or model, or a memplan ModelSpec; got "
    )


def test_python_errors_name_python_arguments_and_the_cli_its_flags() -> None:
    with pytest.raises(UsageError) as caught:
        memplan.advise("llama-3.2-1b", 0, 64)
    assert str(caught.value) == "batch must be a positive integer, got 0"
    assert caught.value.cli_message == "--batch must be a positive integer, got 0"
    with pytest.raises(UsageError) as caught:
        memplan.advise("llama-3.2-1b", 1, 64, kernels="all,none")
    assert str(caught.value) == "kernels all stands alone, not in a list with other names"
    assert caught.value.cli_message.startswith("--kernels all stands alone")


def test_lora_targets_need_a_rank_as_on_the_command_line() -> None:
    """Python accepted lora_targets without lora_rank (no LoRA, targets ignored); the CLI
    refused --lora-targets without --lora-rank."""
    with pytest.raises(UsageError, match=r"^lora_targets needs lora_rank"):
        memplan.advise("llama-3.2-1b", 1, 64, lora_targets=["q_proj"])


def test_revert_names_itself_in_its_error() -> None:
    pytest.importorskip("torch")
    with pytest.raises(UsageError, match=r"^memplan.revert takes a transformers causal LM"):
        memplan.revert("x")
    with pytest.raises(UsageError, match=r"^memplan.apply takes a transformers causal LM"):
        memplan.apply("x")
