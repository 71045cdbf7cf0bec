"""The shipped model and GPU catalogs, and name/path resolution (memplan.catalog)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memplan.advisor import advise
from memplan.catalog import (
    SUPPORTED_MODEL_TYPES,
    catalog_model,
    list_gpus,
    list_model_entries,
    list_models,
    parse_memory,
    resolve_gpu,
    resolve_model,
    spec_from_config,
)
from memplan.catalog.gpus import _GPUS_JSON
from memplan.catalog.models import _MODELS_JSON
from memplan.errors import MemplanError, UsageError
from memplan.estimators import count_params, estimate
from memplan.estimators.params import latent_attention_tensors
from memplan.families import FAMILIES
from memplan.schema import TrainSetup

ENTRIES = {entry.key: entry for entry in list_model_entries()}
RAW = json.loads(_MODELS_JSON.read_text())
GIB = 2**30


def _fields(spec):
    return spec.model_dump(exclude={"name", "hf_config"})


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


# ----------------------------------------------------------------------------- the catalog


def test_catalog_covers_the_required_checkpoints():
    required = {
        "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
        "llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b-v0.1",
        "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b",
        "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
        "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "gemma-2b", "gemma-7b",
        "gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b",
        "gemma-3-27b", "phi-3-mini", "phi-3-medium", "smollm2-135m", "smollm2-360m",
        "smollm2-1.7b", "olmo-2-0425-1b", "olmo-2-1124-7b", "olmo-2-1124-13b",
        "olmo-3-7b-instruct", "olmo-3-32b-think",
    }  # fmt: skip
    assert required <= set(ENTRIES)
    assert len(ENTRIES) >= 30
    assert [key for key, _ in list_models()] == list(ENTRIES)
    assert {spec.model_type for _, spec in list_models()} == set(FAMILIES)


def test_catalog_import_stays_free_of_torch_and_transformers():
    code = (
        "import memplan.catalog, sys; memplan.catalog.resolve_model('gemma-7b'); "
        "memplan.catalog.list_models(); memplan.catalog.resolve_gpu('h200'); "
        "assert 'torch' not in sys.modules, 'torch'; "
        "assert 'transformers' not in sys.modules, 'transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_known_values_of_a_few_checkpoints():
    gemma = resolve_model("gemma-7b")
    assert (gemma.hidden_size, gemma.intermediate_size, gemma.num_hidden_layers) == (
        3072, 24576, 28
    )  # fmt: skip
    assert (gemma.num_attention_heads, gemma.num_key_value_heads, gemma.head_dim) == (16, 16, 256)
    assert (gemma.vocab_size, gemma.tie_word_embeddings, gemma.hidden_act) == (
        256000, True, "gelu"
    )  # fmt: skip
    llama = resolve_model("llama-3.2-1b")
    assert llama.tie_word_embeddings and llama.intermediate_size == 8192
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads) == (
        16, 32, 8
    )  # fmt: skip
    qwen = resolve_model("qwen2.5-1.5b")
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.tie_word_embeddings
    qwen3 = resolve_model("qwen3-8b")
    assert qwen3.head_dim == 128 and qwen3.qk_norm
    moe = resolve_model("qwen3-30b-a3b")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    mixtral = resolve_model("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 14336
    seed = resolve_model("seed-oss-36b-instruct")
    assert seed.attention_bias and not seed.attention_out_bias and seed.head_dim == 128
    assert (seed.attention_dropout, seed.residual_dropout) == (0.1, 0.1)
    smol = resolve_model("smollm3-3b")
    assert smol.nope_layers == tuple(range(3, 36, 4)) and smol.tie_word_embeddings
    assert smol.layer_types is None and not smol.use_cache
    granite = resolve_model("granite-3.3-8b-instruct")
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert granite.logits_scaling == 16.0 and granite.tie_word_embeddings
    phi = resolve_model("phi-3-mini")
    assert phi.fused_qkv and phi.fused_gate_up and phi.head_dim == 96
    gemma3 = resolve_model("gemma-3-1b")
    assert gemma3.sandwich_norm and gemma3.qk_norm and gemma3.sliding_window == 512
    assert gemma3.layer_types.count("full_attention") == 26 // 6
    olmo2 = resolve_model("olmo-2-1124-7b")
    assert olmo2.post_norm and not olmo2.sandwich_norm and olmo2.rope_in_fp32
    assert (olmo2.qk_norm, olmo2.qk_norm_scope, olmo2.head_dim) == (True, "projection", 128)
    assert olmo2.layer_types is None and olmo2.rope_tables == 1 and olmo2.use_cache
    exaone = resolve_model("exaone-4.0-32b")
    assert (exaone.num_hidden_layers, exaone.head_dim, exaone.sliding_window) == (64, 128, 4096)
    assert exaone.post_norm and exaone.qk_norm and exaone.qk_norm_scope == "head"
    assert (
        exaone.nope_layers
        == tuple(range(3, 64, 4))
        == tuple(i for i, kind in enumerate(exaone.layer_types) if kind == "full_attention")
    )
    air = resolve_model("glm-4.5-air")
    assert (air.num_hidden_layers, air.dense_layers, air.num_experts) == (46, (0,), 128)
    assert (air.moe_intermediate_size, air.shared_expert_intermediate_size) == (1408, 1408)
    assert (air.head_dim, air.rotary_dim, air.rotated_dim) == (128, 64, 64)
    assert (air.attention_bias, air.attention_out_bias, air.qk_norm) == (True, False, False)
    assert count_params(air).total == 106852245504  # "106 billion total parameters"
    gemma4 = resolve_model("gemma-4-31b")
    full = tuple(range(5, 60, 6))
    assert gemma4.global_layers == full and gemma4.kv_kept_layers == (58, 59)
    assert (gemma4.head_dim, gemma4.num_key_value_heads, gemma4.sliding_window) == (256, 16, 1024)
    layer = gemma4.layer(5)
    assert (layer.head_dim, layer.num_key_value_heads, layer.values_from_keys) == (512, 4, True)
    assert gemma4.layer(4) is gemma4 and gemma4.rope_tables == 2 and gemma4.v_norm
    olmo3 = resolve_model("olmo-3-32b-think")
    assert (olmo3.num_key_value_heads, olmo3.sliding_window, olmo3.rope_tables) == (8, 4096, 2)
    assert olmo3.layer_types.count("full_attention") == 64 // 4 and not olmo3.use_cache


# ----------------------------------------------------------------------------- name lookup


@pytest.mark.parametrize(
    ("query", "key"),
    [
        ("gemma-7b", "gemma-7b"),
        ("GEMMA-7B", "gemma-7b"),
        ("google/gemma-7b", "gemma-7b"),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("  llama-3.2-1b ", "llama-3.2-1b"),
        # A catalog key inside a longer name (gpt-fast's rule).
        ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
        ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
        ("google/gemma-2-27b-it", "gemma-2-27b"),
        ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "smollm2-1.7b"),
        # A unique part of a catalog key.
        ("mixtral", "mixtral-8x7b"),
        ("qwen3-30b", "qwen3-30b-a3b"),
        ("phi-3-med", "phi-3-medium"),
    ],
)
def test_resolve_model_by_name(query, key):
    spec = resolve_model(query)
    assert spec.name == key
    assert spec == ENTRIES[key].spec


@pytest.mark.parametrize(
    ("query", "candidates"),
    [
        ("gemma", ["gemma-2b", "gemma-7b", "gemma-2-9b", "gemma-3-27b"]),
        ("mistral-7b", ["mistral-7b-v0.1", "mistral-7b-v0.3"]),
        ("qwen3-1", ["qwen3-1.7b", "qwen3-14b"]),
    ],
)
def test_ambiguous_name_lists_the_candidates(query, candidates):
    with pytest.raises(UsageError) as error:
        resolve_model(query)
    message = _one_line(error)
    assert "ambiguous" in message
    for candidate in candidates:
        assert candidate in message


@pytest.mark.parametrize("query", ["no-such-model", "llama-9", ""])
def test_unknown_name_is_an_error(query):
    with pytest.raises(MemplanError) as error:
        resolve_model(query)
    assert "memplan models" in _one_line(error)


def test_catalog_model_rejects_a_non_key():
    with pytest.raises(UsageError):
        catalog_model("gemma")


# ----------------------------------------------------------------------------- config files


def _write_config(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_resolve_model_from_file_and_folder(tmp_path):
    config = RAW["qwen2.5-0.5b"]["config"]
    folder = _write_config(tmp_path / "ckpt", config)
    from_folder = resolve_model(str(folder))
    from_file = resolve_model(str(folder / "config.json"))
    assert from_folder.name == str(folder)
    assert _fields(from_folder) == _fields(from_file) == _fields(ENTRIES["qwen2.5-0.5b"].spec)
    assert from_folder.hf_config == config


def test_an_existing_folder_wins_over_a_catalog_name_inside_it(tmp_path):
    folder = _write_config(tmp_path / "llama-3.2-1b-finetune", RAW["smollm2-135m"]["config"])
    assert _fields(resolve_model(str(folder))) == _fields(ENTRIES["smollm2-135m"].spec)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"hidden_size": 64}), "model_type"),
        (json.dumps({"model_type": "llama", "hidden_size": -8}), "positive integer"),
        (json.dumps({"model_type": "llama", "hidden_size": "big"}), "positive integer"),
        (
            json.dumps({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4}),
            "multiple",
        ),
    ],
)
def test_malformed_config_file_is_one_clear_error(tmp_path, content, message):
    file = tmp_path / "config.json"
    file.write_text(content)
    with pytest.raises(MemplanError) as error:
        resolve_model(str(file))
    assert message in _one_line(error)


TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}  # fmt: skip
POSITIVE_INT = "a positive integer"
BOOLEAN = "true or false (a JSON boolean, not a string or number)"
NUMBER = "a positive number or null"
STRING = "a non-empty string"
LIST = "a list or null"
PROBABILITY = "a number >= 0 and < 1"
WINDOWED = {"sliding_window": 64}
QWEN2_WINDOWED = {"model_type": "qwen2", "use_sliding_window": True, **WINDOWED}
LAYER_TYPES = 'a list of 2 entries, each "full_attention" or "sliding_attention"'


@pytest.mark.parametrize(
    ("overrides", "key", "must_be", "got"),
    [
        ({"model_type": ["llama"]}, "model_type", STRING, '["llama"]'),
        ({"model_type": ""}, "model_type", STRING, '""'),
        ({"vocab_size": "1000"}, "vocab_size", POSITIVE_INT, '"1000"'),
        ({"intermediate_size": 0}, "intermediate_size", POSITIVE_INT, "0"),
        ({"max_position_embeddings": 512.0}, "max_position_embeddings", POSITIVE_INT, "512.0"),
        ({"num_hidden_layers": True}, "num_hidden_layers", POSITIVE_INT, "true"),
        ({"num_key_value_heads": 0}, "num_key_value_heads", POSITIVE_INT, "0"),
        ({"num_key_value_heads": -2}, "num_key_value_heads", POSITIVE_INT, "-2"),
        ({"head_dim": 16.0}, "head_dim", POSITIVE_INT, "16.0"),
        ({"final_logit_softcapping": "abc"}, "final_logit_softcapping", NUMBER, '"abc"'),
        ({"model_type": "glm4_moe", "n_shared_experts": 0}, "n_shared_experts", POSITIVE_INT, "0"),
        ({"model_type": "glm4_moe", "use_qk_norm": 1}, "use_qk_norm", BOOLEAN, "1"),
        ({"attn_logit_softcapping": "abc"}, "attn_logit_softcapping", NUMBER, '"abc"'),
        ({"final_logit_softcapping": 0}, "final_logit_softcapping", NUMBER, "0"),
        ({"attn_logit_softcapping": float("inf")}, "attn_logit_softcapping", NUMBER, "Infinity"),
        ({"attn_logit_softcapping": True}, "attn_logit_softcapping", NUMBER, "true"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings", BOOLEAN, '"false"'),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings", BOOLEAN, "0"),
        ({"mlp_bias": "no"}, "mlp_bias", BOOLEAN, '"no"'),
        ({"attention_bias": "true"}, "attention_bias", BOOLEAN, '"true"'),
        ({"hidden_act": ["silu"]}, "hidden_act", STRING, '["silu"]'),
        ({"model_type": "gemma2", "hidden_activation": 1}, "hidden_activation", STRING, "1"),
        ({"model_type": "gemma2", "sliding_window_pattern": 0}, "sliding_window_pattern",
         POSITIVE_INT, "0"),
        ({"model_type": "gemma2", "sliding_window_pattern": "2"}, "sliding_window_pattern",
         POSITIVE_INT, '"2"'),
        ({"model_type": "mistral", "sliding_window": 64.0}, "sliding_window", POSITIVE_INT,
         "64.0"),
        ({**QWEN2_WINDOWED, "layer_types": ["foo", "bar"]}, "layer_types",
         LAYER_TYPES, '["foo", "bar"]'),
        ({**QWEN2_WINDOWED, "layer_types": ["sliding_attention"]},
         "layer_types", LAYER_TYPES, '["sliding_attention"]'),
        ({**QWEN2_WINDOWED, "layer_types": "sliding_attention"},
         "layer_types", LIST, '"sliding_attention"'),
        ({"model_type": "qwen2", "use_sliding_window": "false", **WINDOWED},
         "use_sliding_window", BOOLEAN, '"false"'),
        ({**QWEN2_WINDOWED, "max_window_layers": "1"}, "max_window_layers", "an integer >= 0",
         '"1"'),
        ({**QWEN2_WINDOWED, "max_window_layers": -1}, "max_window_layers", "an integer >= 0",
         "-1"),
        ({"model_type": "mixtral", "num_local_experts": 0}, "num_local_experts", POSITIVE_INT,
         "0"),
        ({"model_type": "mixtral", "num_experts": "8"}, "num_experts", POSITIVE_INT, '"8"'),
        ({"model_type": "qwen3_moe", "decoder_sparse_step": "1"}, "decoder_sparse_step",
         POSITIVE_INT, '"1"'),
        ({"model_type": "qwen3_moe", "mlp_only_layers": "0"}, "mlp_only_layers", LIST, '"0"'),
        ({"model_type": "qwen3_moe", "moe_intermediate_size": -1}, "moe_intermediate_size",
         POSITIVE_INT, "-1"),
        ({"model_type": "gemma3", "text_config": {"model_type": "llama"}},
         "text_config.model_type", '"gemma3_text"', '"llama"'),
        ({"model_type": "mistral3", "text_config": {"model_type": "llama"}},
         "text_config.model_type", '"mistral" or "ministral3"', '"llama"'),
        ({"model_type": "mistral3", "text_config": {}, "vision_config": {"patch_size": 0}},
         "vision_config.patch_size", POSITIVE_INT, "0"),
        ({"model_type": "gemma3", "text_config": {}, "vision_config": {"hidden_size": "1152"}},
         "vision_config.hidden_size", POSITIVE_INT, '"1152"'),
        ({"model_type": "mistral3", "text_config": {}, "vision_feature_layer": []},
         "vision_feature_layer", "an integer or a non-empty list", "[]"),
        ({"model_type": "gemma3", "text_config": {}, "vision_config": {"num_hidden_layers": 513}},
         "vision_config.num_hidden_layers", "at most 512 (4x a text model's largest)", "513"),
        ({"attention_dropout": 1.0}, "attention_dropout", PROBABILITY, "1.0"),
        ({"model_type": "seed_oss", "residual_dropout": "0.1"}, "residual_dropout", PROBABILITY,
         '"0.1"'),
        ({"model_type": "seed_oss", "attention_out_bias": None}, "attention_out_bias", BOOLEAN,
         "null"),
        ({"model_type": "smollm3", "no_rope_layers": [1]}, "no_rope_layers",
         "a list of at least 2 entries, each 0 or 1", "[1]"),
        ({"model_type": "smollm3", "no_rope_layers": [1, 0.0]}, "no_rope_layers",
         "a list of at least 2 entries, each 0 or 1", "[1, 0.0]"),
        ({"model_type": "smollm3", "no_rope_layers": "1,0"}, "no_rope_layers", LIST, '"1,0"'),
        ({"model_type": "smollm3", "no_rope_layer_interval": 0}, "no_rope_layer_interval",
         POSITIVE_INT, "0"),
        ({"model_type": "granite", "logits_scaling": 0}, "logits_scaling", "a positive number",
         "0"),
        ({"model_type": "granite", "residual_multiplier": "0.22"}, "residual_multiplier",
         "a finite number", '"0.22"'),
        ({"model_type": "granite", "embedding_multiplier": float("nan")}, "embedding_multiplier",
         "a finite number", "NaN"),
    ],
)  # fmt: skip
def test_bad_config_value_is_one_error_naming_the_key(overrides, key, must_be, got):
    with pytest.raises(MemplanError) as error:
        spec_from_config({**TINY_LLAMA, **overrides})
    assert type(error.value) is MemplanError
    assert _one_line(error) == f"config key {key!r} must be {must_be}, got {got}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 128, "num_key_value_heads": 128},
         "hidden_size (64) is smaller than num_attention_heads (128) and no head_dim is given"),
        ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 8},
         "num_experts_per_tok (8) is more than the number of experts (2)"),
        ({"model_type": "glm4_moe", "n_routed_experts": 6, "n_group": 4, "num_experts_per_tok": 2},
         "6 experts in n_group 4 groups with topk_group 1: the router needs groups of at least 2 "
         "experts and topk_group <= n_group"),
        ({"model_type": "glm4_moe", "n_routed_experts": 8, "n_group": 4, "topk_group": 1,
          "num_experts_per_tok": 4},
         "num_experts_per_tok (4) is more than the experts of the topk_group (1) groups the "
         "router picks (2)"),
        ({"model_type": "glm4_moe", "partial_rotary_factor": 0.0},
         "partial_rotary_factor 0.0 of head_dim 16 rotates 0 dims; transformers' RoPE needs "
         "between 1 and head_dim (rounded up to even)"),
    ],
)  # fmt: skip
def test_inconsistent_config_values_are_one_error(overrides, message):
    with pytest.raises(MemplanError) as error:
        spec_from_config({**TINY_LLAMA, **overrides})
    assert _one_line(error) == message


def test_a_long_bad_value_is_cut_short():
    with pytest.raises(MemplanError) as error:
        spec_from_config({**TINY_LLAMA, "vocab_size": "x" * 1000})
    assert len(_one_line(error)) < 140


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"tie_word_embeddings": False}, {"tie_word_embeddings": False}),
        ({"tie_word_embeddings": None}, {"tie_word_embeddings": False}),
        ({"mlp_bias": True}, {"mlp_bias": True}),
        ({"num_key_value_heads": None, "head_dim": None},
         {"num_key_value_heads": 4, "head_dim": 16}),
        ({"final_logit_softcapping": 30}, {"final_logit_softcapping": 30.0}),
        ({"model_type": "gemma2", **WINDOWED, "sliding_window_pattern": None},
         {"layer_types": ("sliding_attention", "full_attention")}),
        ({**QWEN2_WINDOWED, "max_window_layers": 0},
         {"layer_types": ("sliding_attention", "sliding_attention")}),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": "unread"},
         {"sliding_window": None}),
        ({"model_type": "qwen3_moe", "num_local_experts": 16, "mlp_only_layers": None},
         {"num_experts": 16}),
        # OLMo 3 computes one cos/sin pair per layer type its config lists, window or not
        ({"model_type": "olmo3"},
         {"rope_tables": 1, "layer_types": ("sliding_attention", "sliding_attention")}),
        ({"model_type": "olmo3", "num_hidden_layers": 4},
         {"rope_tables": 2, "sliding_window": 4096}),
        ({"model_type": "olmo3", "layer_types": ["full_attention", "sliding_attention"]},
         {"rope_tables": 2, "layer_types": ("full_attention", "sliding_attention")}),
        ({"model_type": "olmo3", "sliding_window": None, "num_hidden_layers": 4},
         {"rope_tables": 2, "layer_types": None}),
        ({"model_type": "olmo2", "attention_bias": True},
         {"attention_bias": True, "attention_out_bias": True, "rope_tables": 1}),
        ({"model_type": "seed_oss", "attention_out_bias": True, "attention_bias": False},
         {"attention_bias": False, "attention_out_bias": True}),
        ({"model_type": "seed_oss", "residual_dropout": 0, "attention_dropout": 0.25},
         {"residual_dropout": 0.0, "attention_dropout": 0.25}),
        ({"attention_dropout": 0.1, "residual_dropout": 0.5}, {"residual_dropout": 0.0}),
        ({"model_type": "smollm3", "no_rope_layer_interval": 2}, {"nope_layers": (1,)}),
        ({"model_type": "smollm3", "no_rope_layers": [0, 1, 1], "use_sliding_window": True,
          **WINDOWED},
         {"nope_layers": (0,), "layer_types": ("sliding_attention", "full_attention"),
          "sliding_window": 64}),
        ({"model_type": "smollm3", "no_rope_layers": [0, 1], **WINDOWED},
         {"layer_types": None, "sliding_window": None}),
        ({"model_type": "smollm3", "no_rope_layers": [True, False], **WINDOWED,
          "layer_types": ["full_attention", "sliding_attention"]},
         {"nope_layers": (1,), "layer_types": ("full_attention", "sliding_attention")}),
        # EXAONE 4 rotates only in its sliding layers where a window is set
        ({"model_type": "exaone4", "num_hidden_layers": 4},
         {"nope_layers": (3,), "sliding_window": 4096}),
        ({"model_type": "exaone4", "num_hidden_layers": 2, "sliding_window_pattern": 1},
         {"nope_layers": (0, 1), "sliding_window": None, "layer_types": None}),
        ({"model_type": "exaone4", "sliding_window": None,
          "layer_types": ["full_attention", "sliding_attention"]},
         {"nope_layers": (), "sliding_window": None, "layer_types": None}),
        ({"model_type": "granite"},
         {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}),
        ({"model_type": "granite", "logits_scaling": 8},
         {"logits_scaling": 8.0, "embedding_multiplier": 1.0}),
        ({"logits_scaling": 8.0}, {"logits_scaling": None}),
        # GLM-4.5: the first first_k_dense_replace layers dense, half of each head rotated (the
        # factor in rope_parameters first), q/k norms and q/k/v biases by the config, no window
        ({"model_type": "glm4_moe", "num_hidden_layers": 3},
         {"dense_layers": (0,), "shared_expert_intermediate_size": 1408, "rotary_dim": 8,
          "qk_norm": False, "attention_bias": False, "sliding_window": None}),
        ({"model_type": "glm4_moe", "first_k_dense_replace": 5, "n_shared_experts": 2,
          "moe_intermediate_size": 32},
         {"dense_layers": (0, 1), "shared_expert_intermediate_size": 64}),
        ({"model_type": "glm4_moe", "first_k_dense_replace": 0, "partial_rotary_factor": 1.0},
         {"dense_layers": (), "rotary_dim": None}),
        ({"model_type": "glm4_moe", "partial_rotary_factor": 1.0,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.25}},
         {"rotary_dim": 4}),
        ({"model_type": "glm4_moe", "use_qk_norm": True, "attention_bias": True,
          "sliding_window": 8},
         {"qk_norm": True, "attention_bias": True, "attention_out_bias": False,
          "sliding_window": None, "layer_types": None}),
    ],
)  # fmt: skip
def test_valid_edge_values_are_read_as_transformers_reads_them(overrides, expected):
    spec = spec_from_config({**TINY_LLAMA, **overrides})
    assert {key: getattr(spec, key) for key in expected} == expected


GEMMA4 = {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0}


@pytest.mark.parametrize(
    ("overrides", "key", "value", "what"),
    [
        ({"model_type": "gemma4_text"}, "hidden_size_per_layer_input", "256",
         "per-layer embeddings into every layer"),
        ({**GEMMA4, "num_kv_shared_layers": 20}, "num_kv_shared_layers", "20",
         "layers that reuse an earlier layer's keys/values"),
        ({**GEMMA4, "enable_moe_block": True}, "enable_moe_block", "true",
         "a mixture-of-experts block beside the MLP"),
        ({**GEMMA4, "use_bidirectional_attention": "all"}, "use_bidirectional_attention",
         '"all"', "bidirectional text attention"),
    ],
)  # fmt: skip
def test_unmodelled_gemma4_traits_are_refused_in_one_line(overrides, key, value, what):
    with pytest.raises(MemplanError) as error:
        spec_from_config({**TINY_LLAMA, **overrides})
    assert _one_line(error).startswith(f"gemma4_text with {key} {value} ({what}) is not modelled")


def test_gemma4_per_layer_config_reads_as_the_global_keys():
    """transformers 5.17 writes the full layers' geometry as per_layer_config (to_dict); the
    published configs give global_head_dim and num_global_key_value_heads: the same spec."""
    from transformers import AutoConfig

    given = {**TINY_LLAMA, **GEMMA4, "num_hidden_layers": 7, "head_dim": 16}
    given.update(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True)
    reference = AutoConfig.for_model(**given).to_dict()
    spec = spec_from_config(given)
    assert _fields(spec) == _fields(spec_from_config(reference))
    full = {"head_dim": 32, "num_key_value_heads": 1}
    written = {k: v for k, v in given.items() if k not in ("global_head_dim",)}
    written["per_layer_config"] = {"5": full, "6": full}
    assert _fields(spec_from_config(written)) == _fields(spec)
    # the pattern's sixth layer and, forced, the last are full
    assert spec.global_layers == (5, 6) and spec.kv_kept_layers == (4, 6)
    assert (spec.layer(6).head_dim, spec.layer(6).num_key_value_heads) == (32, 1)
    uneven = {**written, "per_layer_config": {"5": {"head_dim": 32}, "6": {"head_dim": 64}}}
    with pytest.raises(MemplanError) as error:
        spec_from_config(uneven)
    assert "config key 'per_layer_config' must be" in _one_line(error)


def test_gemma4_layers_of_two_geometries_are_refused_under_a_strategy():
    spec = resolve_model("gemma-4-31b")
    with pytest.raises(UsageError) as error:
        estimate(spec, TrainSetup(batch=1, seq=64, gpus=2, strategy="ddp"))
    assert _one_line(error) == (
        "gemma4_text's layers of two attention geometries are modelled on one GPU only, "
        "not under ddp"
    )
    advice = advise(spec, batch=1, seq=2048, gpu="h100")  # far beyond one H100: no GPU count
    assert not advice.fits and advice.gpu_counts == []
    assert any("modelled on one GPU only" in warning for warning in advice.warnings)


def test_a_spec_pydantic_refuses_is_one_memplan_error():
    with pytest.raises(MemplanError) as error:
        spec_from_config(TINY_LLAMA, name=123)
    assert _one_line(error).startswith("the model config gives an invalid name (")


def test_bad_config_value_is_one_error_line_through_the_cli(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**TINY_LLAMA, "tie_word_embeddings": "false"}))
    run = subprocess.run(
        [sys.executable, "-m", "memplan", "advise", "--model", str(file), "--batch", "1"]
        + ["--seq", "64"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"Error: config key 'tie_word_embeddings' must be {BOOLEAN}, got \"false\""
    ]


def test_missing_config_is_one_clear_error(tmp_path):
    with pytest.raises(MemplanError) as error:
        resolve_model(str(tmp_path))
    assert "has no config.json" in _one_line(error)
    with pytest.raises(MemplanError) as error:
        resolve_model("./no/such/config.json")
    assert "no such file" in _one_line(error)


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    with pytest.raises(MemplanError) as error:
        resolve_model(str(file))
    message = _one_line(error)
    assert "'gpt2'" in message
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in message


def test_qwen3_moe_with_dense_layers_is_refused():
    config = dict(RAW["qwen3-30b-a3b"]["config"], mlp_only_layers=[0, 1])
    with pytest.raises(MemplanError, match="dense layers"):
        spec_from_config(config)


def test_gpt_oss_with_attention_dropout_is_refused():
    """Dropout beside the sink column is not modelled: one MemplanError naming the value."""
    config = dict(RAW["gpt-oss-20b"]["config"])
    assert spec_from_config({**config, "attention_dropout": 0}).attention_sinks
    with pytest.raises(MemplanError) as error:
        spec_from_config({**config, "attention_dropout": 0.1})
    assert "attention_dropout 0.1" in _one_line(error) and "gpt_oss" in _one_line(error)


def test_gpt_oss_configs_read_as_published():
    """gpt-oss-20b and -120b differ only in layers and experts; every other layer slides over
    128 positions; cos/sin are half a head wide; the config's swiglu_limit is the experts' own
    constant (transformers reads it not)."""
    small, large = ENTRIES["gpt-oss-20b"].spec, ENTRIES["gpt-oss-120b"].spec
    assert (small.num_hidden_layers, small.num_experts) == (24, 32)
    assert (large.num_hidden_layers, large.num_experts) == (36, 128)
    for spec in (small, large):
        assert spec.sliding_window == 128 and spec.num_experts_per_tok == 4
        assert spec.layer_types == ("sliding_attention", "full_attention") * (
            spec.num_hidden_layers // 2
        )
        assert spec.rope_half_tables and spec.attention_sinks
        assert spec.attention_bias and spec.attention_out_bias
        assert spec.moe_intermediate_size == spec.intermediate_size == 2880


def llama4_text_config(**overrides) -> dict:
    """Llama 4 Scout's text_config as the catalog holds it, with `overrides`."""
    return {**RAW["llama-4-scout-17b-16e"]["config"]["text_config"], **overrides}


def test_llama4_scout_reads_as_transformers_builds_it():
    spec = ENTRIES["llama-4-scout-17b-16e"].spec
    assert spec.model_type == "llama4_text" and spec.wrapper_model_type == "llama4"
    assert spec.nope_layers == tuple(range(3, 48, 4))  # every fourth layer applies no RoPE
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (16, 1, 8192)
    assert spec.moe_router == "sigmoid_every_expert"
    assert spec.shared_expert_intermediate_size == 8192
    assert spec.rope_complex and spec.qk_l2_norm and spec.nope_query_temperature
    assert spec.attention_chunk_size == 8192 and not spec.eager_softmax_fp32
    assert spec.sliding_window is None and spec.layer_types is None
    # the derived keys left out read as the config class derives them
    derived = ("moe_layers", "no_rope_layers", "layer_types")
    text = {k: v for k, v in llama4_text_config().items() if k not in derived}
    text_model = spec.model_copy(update={"wrapper_model_type": None, "vision_tower_tensors": ()})
    assert _fields(spec_from_config(text)) == _fields(text_model)
    # moe_layers past the last layer are ignored, as the model ignores them
    assert spec_from_config(llama4_text_config(num_hidden_layers=2)).num_experts == 16


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Llama 4 Maverick's interleaved dense layers
        ({"moe_layers": None, "interleave_moe_layer_step": 2}, "dense layers"),
        ({"moe_layers": list(range(1, 48, 2))}, "dense layers"),
        ({"attention_dropout": 0.1}, "attention_dropout above 0"),
        ({"attention_chunk_size": None}, "no attention_chunk_size"),
        ({"layer_types": ["full_attention"] * 48}, "'layer_types' must be"),
        ({"attn_temperature_tuning": 4}, "'attn_temperature_tuning' must be true or false"),
    ],
)
def test_llama4_configs_memplan_cannot_model_are_refused(overrides, message):
    with pytest.raises(MemplanError) as error:
        spec_from_config(llama4_text_config(**overrides))
    assert message in _one_line(error)


def test_llama4_with_a_data_parallel_strategy_is_refused():
    spec = ENTRIES["llama-4-scout-17b-16e"].spec
    with pytest.raises(UsageError, match="one GPU"):
        estimate(spec, TrainSetup(batch=1, seq=256, gpus=2, strategy="ddp"))
    advice = advise(spec, 1, 256, gpu="h100")  # 200 GiB of weights: no GPU count is searched
    assert not advice.fits and advice.gpu_counts == []
    assert any("on one GPU only" in warning for warning in advice.warnings)


def test_multimodal_gemma3_config_resolves_to_its_text_config(tmp_path):
    # google/gemma-3-4b-pt's config.json as published (vision_config abridged).
    published = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
    }
    spec = resolve_model(str(_write_config(tmp_path / "gemma-3-4b-it", published)))
    assert spec.model_type == "gemma3_text"
    multimodal = {"wrapper_model_type", "vision_tower_tensors"}
    assert _fields(spec.model_copy(update=dict.fromkeys(multimodal))) == _fields(
        ENTRIES["gemma-3-4b"].spec.model_copy(update=dict.fromkeys(multimodal))
    )
    assert spec.hf_config["model_type"] == "gemma3_text"
    assert "vision_config" not in spec.hf_config
    assert spec.wrapper_model_type == "gemma3" and spec.vision_tower_params > 0


def test_a_mistral3_text_config_without_model_type_is_mistral():
    """Mistral3Config builds a MistralConfig from a text_config that names no model_type."""
    config = {**RAW["mistral-small-3.1-24b"]["config"]}
    config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    spec = spec_from_config(config)
    assert spec.model_type == "mistral" and spec == spec_from_config(
        RAW["mistral-small-3.1-24b"]["config"]
    )


def test_ministral3_without_the_query_scale_keys_is_refused():
    """transformers' Ministral3Attention reads both keys of rope_parameters and fails without
    them (a TypeError in forward); rope_parameters left out gets the config class's, with them."""
    config = dict(RAW["ministral-3-8b"]["config"])
    assert spec_from_config({**config, "rope_parameters": None}).llama4_query_scale
    for key in ("llama_4_scaling_beta", "original_max_position_embeddings"):
        rope = {k: v for k, v in config["rope_parameters"].items() if k != key}
        with pytest.raises(MemplanError) as error:
            spec_from_config({**config, "rope_parameters": rope})
        assert key in _one_line(error) and "ministral3" in _one_line(error)


@pytest.mark.parametrize("model_type", ["mistral", "ministral3"])
def test_layer_types_are_ignored_where_transformers_ignores_them(model_type):
    """Mistral's and Ministral 3's models slide every layer when a window is given, whatever
    config.layer_types says: the same logits with and without it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    sizes = {**TINY_LLAMA, "model_type": model_type, "sliding_window": 4}
    layer_types = ["full_attention", "sliding_attention"]
    spec = spec_from_config({**sizes, "layer_types": layer_types})
    assert spec.layer_types == ("sliding_attention",) * 2 and spec.sliding_window == 4
    logits = []
    for extra in ({}, {"layer_types": layer_types}):
        torch.manual_seed(0)
        config = AutoConfig.for_model(**{**sizes, **extra})
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        logits.append(model(input_ids=torch.arange(12)[None] % 1000).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------- hub ids


def _hub_http():
    """The HTTP library huggingface_hub raises from: httpx up to huggingface_hub 1.x, its fork
    httpx2 from 2.x (what the latest transformers installs)."""
    import importlib

    import huggingface_hub.errors

    return importlib.import_module(huggingface_hub.errors.Response.__module__.split(".")[0])


def _fake_autoconfig(monkeypatch, *, cached: bool, on_hub: bool):
    """AutoConfig.from_pretrained and the hub's HEAD request, recording their calls."""
    import huggingface_hub
    import transformers

    calls = []

    def from_pretrained(name, trust_remote_code=False, local_files_only=False):
        calls.append((name, trust_remote_code, local_files_only))
        if local_files_only and not cached:
            raise OSError(f"{name} is not in the cache")
        return transformers.AutoConfig.for_model(
            "qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
        )  # fmt: skip

    def get_hf_file_metadata(url, timeout=None):
        calls.append(("HEAD", url))
        if not on_hub:
            raise _hub_http().ConnectError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", get_hf_file_metadata)
    return calls


def test_hub_id_is_read_from_the_cache_first(monkeypatch):
    calls = _fake_autoconfig(monkeypatch, cached=True, on_hub=False)
    spec = resolve_model("some-org/brand-new-model", trust_remote_code=True)
    assert calls == [("some-org/brand-new-model", True, True)]
    assert spec.name == "some-org/brand-new-model"
    assert (spec.model_type, spec.hidden_size, spec.head_dim, spec.qk_norm) == (
        "qwen3", 256, 64, True
    )  # fmt: skip


def test_hub_id_not_cached_is_fetched_after_one_request(monkeypatch):
    calls = _fake_autoconfig(monkeypatch, cached=False, on_hub=True)
    spec = resolve_model("some-org/other-model")
    assert calls == [
        ("some-org/other-model", False, True),
        ("HEAD", "https://huggingface.co/some-org/other-model/resolve/main/config.json"),
        ("some-org/other-model", False, False),
    ]
    assert spec.model_type == "qwen3"


def test_unreachable_hub_id_fails_after_one_request(monkeypatch):
    calls = _fake_autoconfig(monkeypatch, cached=False, on_hub=False)
    with pytest.raises(MemplanError) as error:
        resolve_model("some-org/brand-new-model")
    assert [call[0] for call in calls] == ["some-org/brand-new-model", "HEAD"]
    assert _one_line(error) == (
        "unknown model 'some-org/brand-new-model': not a catalog name, not a local path, and "
        "not reachable on the Hugging Face hub (the hub cannot be reached); run `memplan models` "
        "for the catalog names"
    )


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_makes_no_request(monkeypatch, variable):
    calls = _fake_autoconfig(monkeypatch, cached=False, on_hub=True)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(MemplanError) as error:
        resolve_model("some-org/brand-new-model")
    assert [call[0] for call in calls] == ["some-org/brand-new-model"]
    assert "(offline mode is on, and it is not cached)" in _one_line(error)


def test_hub_config_that_cannot_be_read_says_why(monkeypatch):
    import transformers

    calls = _fake_autoconfig(monkeypatch, cached=False, on_hub=True)

    def from_pretrained(name, trust_remote_code=False, local_files_only=False):
        calls.append((name, trust_remote_code, local_files_only))
        raise ValueError("The repository {x} contains custom code.\nPass trust_remote_code=True.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    with pytest.raises(MemplanError) as error:
        resolve_model("org/custom")
    assert len(calls) == 3
    assert _one_line(error) == (
        "the hub's config of 'org/custom' cannot be read (The repository {x} contains custom code.)"
    )


def test_invalid_hub_id_makes_no_request(monkeypatch):
    calls = _fake_autoconfig(monkeypatch, cached=False, on_hub=True)
    with pytest.raises(MemplanError) as error:
        resolve_model("org/{bad}")
    assert [call[0] for call in calls] == ["org/{bad}"]
    assert "unknown model 'org/{bad}'" in _one_line(error)
    assert "(not a valid repository id)" in _one_line(error)


def _http_error(kind, status):
    import huggingface_hub.errors

    http = _hub_http()
    request = http.Request("HEAD", "https://huggingface.co/a/b/resolve/main/config.json")
    error_type = getattr(huggingface_hub.errors, kind)
    return error_type(kind, response=http.Response(status, request=request))


@pytest.mark.parametrize(
    ("kind", "status", "reason"),
    [
        ("RepositoryNotFoundError", 404, "no such repository, or a private one"),
        ("GatedRepoError", 403, "the repository is gated"),
        ("RemoteEntryNotFoundError", 404, "the repository has no config.json"),
        ("HfHubHTTPError", 503, "HfHubHTTPError"),
    ],
)
def test_hub_failure_reason(monkeypatch, kind, status, reason):
    import huggingface_hub

    _fake_autoconfig(monkeypatch, cached=False, on_hub=True)

    def get_hf_file_metadata(url, timeout=None):
        raise _http_error(kind, status)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", get_hf_file_metadata)
    with pytest.raises(MemplanError) as error:
        resolve_model("a/b")
    assert f"({reason}" in _one_line(error)


# a process that imports transformers and asks a real (closed) port;
# test_unreachable_hub_id_fails_after_one_request checks the message in this one
@pytest.mark.slow
def test_unreachable_hub_id_is_one_line_through_the_cli(tmp_path):
    # Nothing listens on port 9: the request is refused at once, with or without a network.
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", "memplan", "advise", "--model", "foo/bar", "--batch", "1"]
        + ["--seq", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        "Error: unknown model 'foo/bar': not a catalog name, not a local path, and not reachable "
        "on the Hugging Face hub (the hub cannot be reached); run `memplan models` for the "
        "catalog names"
    ]


# ----------------------------------------------------------------------------- vs transformers


# Sizes unlike every family's defaults, so a head_dim default cannot hide behind hidden/heads.
ODD_SIZES = {"hidden_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("sizes", [{}, ODD_SIZES], ids=["defaults", "odd-sizes"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_defaults_match_transformers(model_type, sizes):
    """Beside the sizes, each key whose class default builds what memplan does not model
    (ConfigRules.unmodelled: Gemma 4's per-layer embeddings) takes its first modelled value;
    latent attention (deepseek_v3) has as many KV heads as heads."""
    from transformers import AutoConfig

    if sizes and FAMILIES[model_type].config.latent_attention:
        sizes = {**sizes, "num_key_value_heads": sizes["num_attention_heads"]}
    modelled = {rule.key: rule.modelled[0] for rule in FAMILIES[model_type].config.unmodelled}
    reference = AutoConfig.for_model(model_type, **sizes, **modelled).to_dict()
    assert _fields(spec_from_config({"model_type": model_type, **sizes, **modelled})) == _fields(
        spec_from_config(reference)
    )


@pytest.mark.parametrize(
    "model_type", [name for name, family in FAMILIES.items() if family.config.unmodelled]
)
def test_unmodelled_class_defaults_are_refused_in_one_line(model_type):
    """A config that leaves the unmodelled keys at their class defaults is refused, as the
    class's own to_dict() is (Gemma4TextConfig's defaults build per-layer embeddings)."""
    from transformers import AutoConfig

    reference = AutoConfig.for_model(model_type).to_dict()
    for config in ({"model_type": model_type}, reference):
        with pytest.raises(MemplanError) as error:
            spec_from_config(config)
        assert "is not modelled" in _one_line(error)


def text_config_of(config: dict) -> dict:
    """The config of an entry's text model: a multimodal entry's text_config."""
    return spec_from_config(config).hf_config if "text_config" in config else config


@pytest.fixture(scope="module")
def meta_models():
    """Each catalog entry built by transformers on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    built = {}

    def build(key):
        if key not in built:
            config = dict(text_config_of(RAW[key]["config"]))
            hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
            with torch.device("meta"):
                built[key] = (hf_config, AutoModelForCausalLM.from_config(hf_config))
        return built[key]

    return build


@pytest.mark.parametrize("key", list(ENTRIES))
def test_entry_matches_the_model_transformers_builds(key, meta_models):
    from transformers.activations import ACT2FN

    hf_config, model = meta_models(key)
    spec = ENTRIES[key].spec
    raw = RAW[key]["config"]
    assert hf_config.model_type == spec.model_type == text_config_of(raw)["model_type"]
    if spec.wrapper_model_type is None:
        assert type(model).__name__ == raw["architectures"][0]
    else:  # the multimodal checkpoint's text model (its vision tower: test_vision_tower.py)
        assert spec.wrapper_model_type == raw["model_type"]
        assert type(model).__name__ == FAMILIES[spec.model_type].patch.causal_lm.classes[0]

    published = ENTRIES[key].params
    if published is not None:
        assert sum(p.numel() for p in model.parameters()) == published

    embed = model.model.embed_tokens.weight
    assert tuple(embed.shape) == (spec.vocab_size, spec.hidden_size)
    assert (model.lm_head.weight is embed) == spec.tie_word_embeddings
    assert len(model.model.layers) == spec.num_hidden_layers
    assert hf_config.max_position_embeddings == spec.max_position_embeddings

    # the first full-attention layer (Qwen3.5's gated DeltaNet layers have none)
    first = next(i for i in range(spec.num_hidden_layers) if i not in spec.linear_attention_layers)
    layer = model.model.layers[first]
    attn = layer.self_attn
    gate = 2 if spec.attention_output_gate else 1  # q_proj's gate half
    q_width, kv_width = (
        spec.num_attention_heads * spec.head_dim * gate,
        spec.num_key_value_heads * spec.head_dim,
    )
    assert hasattr(attn, "qkv_proj") == spec.fused_qkv
    if spec.mla:  # latent attention's projections and norms, by module, in registration order
        built = [(name.split(".")[0], p.numel()) for name, p in attn.named_parameters()]
        assert built == [(n, rows * cols) for n, rows, cols in latent_attention_tensors(spec)]
    elif spec.fused_qkv:
        assert attn.qkv_proj.out_features == q_width + 2 * kv_width
        assert (attn.qkv_proj.bias is not None) == spec.attention_bias
    else:
        assert (attn.q_proj.out_features, attn.k_proj.out_features) == (q_width, kv_width)
        assert (attn.q_proj.bias is not None) == spec.attention_bias
    assert (attn.o_proj.bias is not None) == spec.attention_out_bias
    assert hasattr(attn, "q_norm") == spec.qk_norm
    if spec.qk_norm:
        over_projection = spec.qk_norm_scope == "projection"
        assert attn.q_norm.weight.numel() == (q_width if over_projection else spec.head_dim)
        assert attn.k_norm.weight.numel() == (kv_width if over_projection else spec.head_dim)
    assert hasattr(layer, "post_feedforward_layernorm") == (spec.sandwich_norm or spec.post_norm)
    assert hasattr(layer, "input_layernorm") != spec.post_norm
    if FAMILIES[spec.model_type].config.rope_per_layer_type:
        assert spec.rope_tables == len(model.model.rotary_emb.layer_types)
    assert hasattr(layer, "layer_scalar") == spec.layer_scalar
    if not (spec.fused_qkv or spec.mla):  # each layer's geometry (Gemma 4's global layers)
        for index, built in enumerate(model.model.layers):
            view = spec.layer(index)
            assert hasattr(built, "linear_attn") == view.deltanet
            if view.deltanet:
                delta = built.linear_attn
                assert (delta.num_k_heads, delta.num_v_heads) == (
                    spec.linear_num_key_heads,
                    spec.linear_num_value_heads,
                )
                assert (delta.head_k_dim, delta.head_v_dim, delta.conv_kernel_size) == (
                    spec.linear_key_head_dim,
                    spec.linear_value_head_dim,
                    spec.linear_conv_kernel_dim,
                )
                continue
            built_attn = built.self_attn
            assert built_attn.q_proj.out_features == spec.num_attention_heads * view.head_dim * gate
            assert built_attn.k_proj.out_features == view.num_key_value_heads * view.head_dim
            assert (getattr(built_attn, "v_proj", None) is None) == view.values_from_keys
            assert hasattr(built_attn, "v_norm") == spec.v_norm

    mlp = layer.feed_forward if spec.moe_router == "sigmoid_every_expert" else layer.mlp
    assert hasattr(mlp, "gate_up_proj") == spec.fused_gate_up
    acts = [m for name, m in layer.named_modules() if name.endswith(("act_fn", "activation_fn"))]
    # Gemma's "gelu" builds exact GELU up to transformers 5.22 and tanh GELU from 5.23 on (its
    # config rewrites the name): the same memory; the patch reads the built act_fn itself.
    gelus = {type(ACT2FN[name]) for name in ("gelu", "gelu_pytorch_tanh")}
    expected = gelus if spec.hidden_act == "gelu" else {type(ACT2FN[spec.hidden_act])}
    rules = FAMILIES[spec.model_type].config.moe
    if rules is not None and rules.clamped_glu:  # gpt-oss's experts gate with their own formula
        assert not acts and hasattr(mlp.experts, "_apply_gate")
    else:
        assert acts and type(acts[0]) in expected
    assert hasattr(attn, "sinks") == spec.attention_sinks
    tables = model.model.rotary_emb.named_buffers()
    angles = {b.numel() for name, b in tables if name.split(".")[-1].endswith("inv_freq")}
    assert angles == {layer.rotated_dim // 2 for layer in spec.layers()}  # Gemma 4: two widths
    if spec.moe_router == "sigmoid_every_expert":  # Llama 4: (experts, hidden, 2 x width)
        shape = (spec.num_experts, spec.hidden_size, 2 * spec.moe_intermediate_size)
        assert tuple(mlp.experts.gate_up_proj.shape) == shape
        assert mlp.shared_expert.up_proj.out_features == spec.shared_expert_intermediate_size
        assert hf_config.num_experts_per_tok == spec.num_experts_per_tok
        assert all(layer.is_moe_layer for layer in model.model.layers)
        sparse = [True] * spec.num_hidden_layers
    else:
        sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert sparse == [spec.moe_layer(i) for i in range(spec.num_hidden_layers)]
    if spec.num_experts and any(sparse) and spec.moe_router != "sigmoid_every_expert":
        moe = model.model.layers[sparse.index(True)].mlp
        gate_up = moe.experts.gate_up_proj
        assert gate_up.shape[0] == spec.num_experts
        # gpt-oss stores each expert's weights transposed: (hidden, 2 x moe_intermediate)
        width_dim = 2 if getattr(moe.experts, "is_transposed", False) else 1
        assert gate_up.shape[width_dim] == 2 * spec.moe_intermediate_size
        biased = getattr(moe.experts, "gate_up_proj_bias", None) is not None
        assert biased == rules.expert_biases
        router = moe.router if hasattr(moe, "router") else moe.gate
        assert (getattr(router, "bias", None) is not None) == rules.router_bias
        assert hf_config.num_experts_per_tok == spec.num_experts_per_tok
        shared = getattr(moe, "shared_experts", getattr(moe, "shared_expert", None))
        width = shared.up_proj.out_features if shared is not None else 0
        assert width == spec.shared_expert_intermediate_size
        # Qwen3-Next's sigmoid gate on the shared expert's output
        assert hasattr(moe, "shared_expert_gate") == (rules.shared_expert_width_key is not None)
    if not spec.moe_layer(0):
        assert not hasattr(mlp, "experts")
        if not spec.fused_gate_up:
            assert mlp.up_proj.out_features == spec.intermediate_size
            assert (mlp.up_proj.bias is not None) == spec.mlp_bias

    if spec.rope_complex:  # Llama 4: which layers rotate, L2-normalize q/k, attend in chunks
        rotating = [layer.self_attn.use_rope for layer in model.model.layers]
        assert [not r for r in rotating] == [i in spec.nope_layers for i in range(len(rotating))]
        qk_norms = [hasattr(layer.self_attn, "qk_norm") for layer in model.model.layers]
        assert qk_norms == [spec.qk_l2_norm and r for r in rotating]
        assert hf_config.attention_chunk_size == spec.attention_chunk_size
        assert hf_config.attn_temperature_tuning == spec.nope_query_temperature
    assert getattr(hf_config, "sliding_window", None) == spec.sliding_window
    hf_layer_types = getattr(hf_config, "layer_types", None)
    if hf_layer_types and "sliding_attention" in hf_layer_types:
        assert tuple(hf_layer_types) == spec.layer_types
    assert getattr(hf_config, "final_logit_softcapping", None) == spec.final_logit_softcapping
    assert getattr(hf_config, "attn_logit_softcapping", None) == spec.attn_logit_softcapping


# KerasHub's text-only Gemma 3 presets count a 262144-token vocabulary; the text_config of the
# Hugging Face checkpoints has 262208 tokens, 64 more rows in the tied embedding.
KERAS_GEMMA3_TEXT_PARAMS = {
    "gemma-3-4b": 3880099328,
    "gemma-3-12b": 11765788416,
    "gemma-3-27b": 27009002240,
}


@pytest.mark.parametrize("key", sorted(KERAS_GEMMA3_TEXT_PARAMS))
def test_gemma3_text_configs_match_kerashub_counts(key, meta_models):
    _, model = meta_models(key)
    spec = ENTRIES[key].spec
    expected = KERAS_GEMMA3_TEXT_PARAMS[key] + (spec.vocab_size - 262144) * spec.hidden_size
    assert sum(p.numel() for p in model.parameters()) == expected


# ----------------------------------------------------------------------------- GPUs


@pytest.mark.parametrize(
    ("query", "name"),
    [
        (None, "H100 80GB SXM"),
        ("h100", "H100 80GB SXM"),
        ("H100-80GB", "H100 80GB SXM"),
        ("NVIDIA H100 80GB HBM3", "H100 80GB SXM"),
        ("h100-pcie", "H100 80GB PCIe"),
        ("h200", "H200 141GB"),
        ("H200", "H200 141GB"),
        ("a100-40gb", "A100 40GB"),
        ("A100_80GB", "A100 80GB"),
        ("4090", "RTX 4090 24GB"),
        ("rtx 3090", "RTX 3090 24GB"),
        ("a10g", "A10G 24GB"),
        ("l4", "L4 24GB"),
        ("L40S", "L40S 48GB"),
        ("t4", "T4 16GB"),
        ("v100-16gb", "V100 16GB"),
        ("b200", "B200 180GB"),
    ],
)
def test_resolve_gpu_by_name(query, name):
    assert resolve_gpu(query).name == name


def test_gpu_catalog_values():
    gpus = dict(list_gpus())
    assert gpus["h100-80gb"].memory_bytes == 81559 * 2**20
    assert gpus["h200"].memory_bytes == 143771 * 2**20
    assert gpus["h100-80gb"].compute_capability == (9, 0)
    assert gpus["a100-80gb"].compute_capability == (8, 0)
    assert gpus["t4"].compute_capability == (7, 5)
    for key, entry in json.loads(_GPUS_JSON.read_text()).items():
        assert entry["memory_bytes"] == entry["nvidia_smi_mib"] * 2**20, key
        assert resolve_gpu(gpus[key].name) == gpus[key]


@pytest.mark.parametrize("query", ["a100", "v100"])
def test_ambiguous_gpu_lists_the_candidates(query):
    with pytest.raises(UsageError) as error:
        resolve_gpu(query)
    message = _one_line(error)
    assert f"{query}-40gb" in message or f"{query}-16gb" in message


def test_unknown_gpu_lists_known_names():
    with pytest.raises(UsageError) as error:
        resolve_gpu("tpu-v5")
    message = _one_line(error)
    assert "h100-80gb" in message and "rtx-4090" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GIB),
        ("24 GiB", 24 * GIB),
        ("24gib", 24 * GIB),
        ("24GB", 24 * 10**9),
        ("80G", 80 * GIB),
        ("80Gi", 80 * GIB),
        ("1.5TB", 15 * 10**11),
        ("512MiB", 512 * 2**20),
        ("0.5GiB", GIB // 2),
        ("25769803776", 25769803776),
        (25769803776, 25769803776),
    ],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24 XB", "-24GiB", "0", "0GB", "GiB", "2e9", "1.5"])
def test_parse_memory_rejects_bad_input(text):
    with pytest.raises(UsageError) as error:
        parse_memory(text)
    _one_line(error)


def test_gpu_memory_overrides():
    custom = resolve_gpu(memory="24GiB")
    assert custom.memory_bytes == 24 * GIB and "24GiB" in custom.name
    h100 = resolve_gpu("h100", memory="70GiB")
    assert h100.name == "H100 80GB SXM" and h100.memory_bytes == 70 * GIB
    with pytest.raises(UsageError):
        resolve_gpu(memory="big")


@pytest.mark.parametrize(
    "path", ["C:/models/llama-3", "C:\\models\\llama-3", "d:\\ckpt", "..\\ckpt\\config"]
)
def test_a_missing_windows_path_is_no_such_file(path) -> None:
    """A Windows path that does not exist fell through to the hub id check ('C:/x/y': "not a
    valid repository id", exit 2) or the catalog's unknown name ('C:\\x'), where the POSIX
    forms ('/x', './x', '../x', '.\\x') say "no such file or folder" (exit 1)."""
    with pytest.raises(MemplanError, match="no such file or folder") as raised:
        resolve_model(path)
    assert raised.value.exit_code == 1


def test_a_name_replaced_by_a_catalog_entry_is_a_warning() -> None:
    """microsoft/Phi-3-mini-128k-instruct was silently predicted as the catalog's 4k model
    (another sliding window and max_position_embeddings), with nothing saying so."""
    advice = advise("microsoft/Phi-3-mini-128k-instruct", 1, 512)
    assert advice.model == "phi-3-mini"
    assert any("microsoft/Phi-3-mini-4k-instruct" in w for w in advice.warnings)
    for exact in ("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", " PHI-3-MINI "):
        assert not any("catalog" in w for w in advise(exact, 1, 512).warnings)


def test_deepseek_v3_latent_attention_reads_as_transformers_builds_it():
    """DeepSeek-V3 and Moonlight: q/k heads of qk_nope + qk_rope (not the config's head_dim,
    which transformers sets to the rotated width), v heads of v_head_dim, a q latent only where
    q_lora_rank is set, the first first_k_dense_replace layers dense; the parameter counts the
    model cards give (671B without the MTP layer; 16B)."""
    v3 = resolve_model("deepseek-v3")
    assert (v3.head_dim, v3.rotary_dim, v3.v_head_dim) == (192, 64, 128)
    assert (v3.kv_lora_rank, v3.q_lora_rank, v3.num_key_value_heads) == (512, 1536, 128)
    assert (v3.dense_layers, v3.num_experts, v3.shared_expert_intermediate_size) == (
        (0, 1, 2), 256, 2048,
    )  # fmt: skip
    assert count_params(v3).total == 671026404352
    moon = resolve_model("moonlight-16b-a3b-instruct")
    assert (moon.q_lora_rank, moon.dense_layers, moon.num_experts) == (0, (0,), 64)
    assert moon.shared_expert_intermediate_size == 2 * 1408
    assert count_params(moon).total == 15960108544
    printed = spec_from_config({**moon.hf_config, "head_dim": 64, "q_lora_rank": 32})
    assert (printed.head_dim, printed.q_lora_rank) == (192, 32)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"num_key_value_heads": 8}, "num_key_value_heads 8 and num_attention_heads 128 is not"),
        ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
        ({"head_dim": 128}, "head_dim 128 and qk_rope_head_dim 64"),
        ({"qk_rope_head_dim": 63}, "'qk_rope_head_dim' must be an even positive integer, got 63"),
        ({"kv_lora_rank": 0}, "'kv_lora_rank' must be a positive integer, got 0"),
    ],
)
def test_deepseek_v3_configs_memplan_does_not_model_are_one_error(overrides, message):
    with pytest.raises(MemplanError, match=message):
        spec_from_config({"model_type": "deepseek_v3", **overrides})


def qwen3_5_text_config(**overrides) -> dict:
    """Qwen3.5-0.8B's text_config as the catalog holds it, with `overrides`."""
    return {**RAW["qwen3.5-0.8b"]["config"]["text_config"], **overrides}


def test_qwen3_5_reads_its_deltanet_and_full_attention_layers():
    spec = ENTRIES["qwen3.5-0.8b"].spec
    assert spec.model_type == "qwen3_5_text" and spec.wrapper_model_type == "qwen3_5"
    full = tuple(range(3, 24, 4))  # every fourth layer
    assert spec.linear_attention_layers == tuple(i for i in range(24) if i not in full)
    geometry = (
        spec.linear_num_key_heads,
        spec.linear_num_value_heads,
        spec.linear_key_head_dim,
        spec.linear_value_head_dim,
        spec.linear_conv_kernel_dim,
    )
    assert geometry == (16, 16, 128, 128, 4)
    assert spec.attention_output_gate and spec.rope_per_batch_row and spec.qk_norm
    assert spec.rotary_dim == 64 and spec.sliding_window is None  # a quarter of head_dim 256
    # without layer_types, full_attention_interval places the full layers as the config class
    derived = {k: v for k, v in qwen3_5_text_config().items() if k != "layer_types"}
    assert spec_from_config(derived).linear_attention_layers == spec.linear_attention_layers
    every_other = spec_from_config(qwen3_5_text_config(layer_types=None, full_attention_interval=2))
    assert every_other.linear_attention_layers == tuple(range(0, 24, 2))
    assert spec.layer(0).deltanet and not spec.layer(3).deltanet


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"layer_types": ["linear_attention"] * 23}, "a list of 24 entries"),
        ({"layer_types": ["sliding_attention"] * 24}, '"linear_attention" or "full_attention"'),
        ({"linear_num_value_heads": 24}, "not a multiple of linear_num_key_heads"),
        ({"linear_key_head_dim": 0}, "'linear_key_head_dim'"),
    ],
)
def test_qwen3_5_configs_memplan_cannot_read_are_refused(overrides, message):
    with pytest.raises(MemplanError) as error:
        spec_from_config(qwen3_5_text_config(**overrides))
    assert message in _one_line(error)


def test_qwen3_5_with_a_data_parallel_strategy_is_refused():
    spec = ENTRIES["qwen3.5-0.8b"].spec
    with pytest.raises(UsageError, match="one GPU"):
        estimate(spec, TrainSetup(batch=1, seq=256, gpus=2, strategy="fsdp2"))


def test_qwen3_5_moe_reads_its_moe_blocks_and_their_shared_expert():
    """Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig's defaults): every layer a MoE block, the shared
    expert of its own width with a sigmoid gate, the DeltaNet layers as Qwen3.5's; inside a
    qwen3_5_moe wrapper the same text model. The MoE block's parameters in registration order
    (router, experts, the shared expert's gate, up and down, shared_expert_gate) against the
    built layer's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.estimators.param_tensors import numel, param_shapes

    spec = ENTRIES["qwen3.5-35b-a3b"].spec
    assert spec.model_type == "qwen3_5_moe_text" and spec.moe_router == "softmax"
    moe = (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
    assert moe == (256, 8, 512) and spec.shared_expert_intermediate_size == 512
    assert all(spec.moe_layer(i) for i in range(40)) and not spec.dense_layers
    assert spec.linear_attention_layers == tuple(i for i in range(40) if i % 4 != 3)
    text = RAW["qwen3.5-35b-a3b"]["config"]
    wrapped = spec_from_config({"model_type": "qwen3_5_moe", "text_config": text})
    assert wrapped.wrapper_model_type == "qwen3_5_moe"
    # no dense intermediate_size in the config: the experts' width is the one the note wants
    from memplan.catalog.config_notes import config_notes

    assert config_notes(text, spec) == []
    differ = {"name", "wrapper_model_type", "vision_tower_tensors"}  # the tower's defaults
    assert wrapped.model_dump(exclude=differ) == spec.model_dump(exclude=differ)

    small = {**text, "num_hidden_layers": 1, "layer_types": ["full_attention"], "num_experts": 8}
    config = AutoConfig.for_model(**small)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config).model.layers[0].mlp
    shapes = param_shapes(spec_from_config(small)).mlp
    assert [numel(s) for s in shapes] == [p.numel() for p in built.parameters()]


def test_qwen3_next_reads_its_fused_deltanet_and_moe_blocks():
    """Qwen3-Next-80B-A3B (Qwen3NextConfig's defaults): the gated DeltaNet with in_proj_qkvz and
    in_proj_ba, MoE blocks with a gated shared expert, cos/sin for one batch row; a DeltaNet
    layer's and a full attention layer's parameters in registration order against the built
    ones; dense layers (mlp_only_layers, decoder_sparse_step) refused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.estimators.param_tensors import numel, param_shapes

    spec = ENTRIES["qwen3-next-80b-a3b-instruct"].spec
    assert spec.model_type == "qwen3_next" and not spec.rope_per_batch_row
    moe = (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size)
    assert moe == (512, 10, 512) and spec.shared_expert_intermediate_size == 512
    assert spec.linear_attention_layers == tuple(i for i in range(48) if i % 4 != 3)
    assert spec.attention_output_gate and spec.rotary_dim == 64

    text = RAW["qwen3-next-80b-a3b-instruct"]["config"]
    for kinds in (["linear_attention"], ["full_attention"]):
        small = {**text, "num_hidden_layers": 1, "layer_types": kinds, "num_experts": 16}
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
        layer = built.model.layers[0]
        shapes = param_shapes(spec_from_config(small).layer(0))
        mixer = layer.linear_attn if kinds == ["linear_attention"] else layer.self_attn
        assert [numel(s) for s in shapes.attention] == [p.numel() for p in mixer.parameters()]
        assert [numel(s) for s in shapes.mlp] == [p.numel() for p in layer.mlp.parameters()]
    for dense in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        with pytest.raises(MemplanError, match="dense layers"):
            spec_from_config({**text, **dense})
