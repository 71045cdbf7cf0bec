"""Tiny configs for the traced-estimate tests: the catalog families (tests/patching/tiny_models)
and model types the families registry does not hold, at a few thousand parameters, dropout off
(CPU references run torch's unfused dropout, the traced step CUDA's fused one)."""

from __future__ import annotations

from tests.patching import tiny_models

UNREGISTERED: dict[str, dict] = {
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 256,
        "n_positions": 128,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "stablelm": {
        "model_type": "stablelm",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "use_qkv_bias": True,
    },
    "phi": {
        "model_type": "phi",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "partial_rotary_factor": 0.5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    },
    "falcon": {
        "model_type": "falcon",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "alibi": True,
        "bias": True,
        "new_decoder_architecture": False,
        "multi_query": False,
    },
    "olmoe": {
        "model_type": "olmoe",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "granitemoe": {
        "model_type": "granitemoe",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "nemotron": {
        "model_type": "nemotron",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
    },
}


def tiny(family: str) -> dict:
    """The tiny config.json dict of a registry family or of an unregistered model type."""
    if family in UNREGISTERED:
        return dict(UNREGISTERED[family])
    return tiny_models.shrink(tiny_models.catalog_config(tiny_models.FAMILIES[family]))
