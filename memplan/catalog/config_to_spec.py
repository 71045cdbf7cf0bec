"""A Hugging Face config.json (a plain dict) -> memplan.schema.ModelSpec, without transformers.

Each family lists the defaults of its transformers config class (5.x) for the keys that decide
memory, so a config.json that leaves them out (the text_config of a multimodal Gemma 3
checkpoint leaves out most) means what transformers would build. tests/test_catalog.py checks
these defaults against the installed transformers and the derived fields against the modules a
real model has."""

from __future__ import annotations

from typing import Any

from memplan.errors import MemplanError
from memplan.schema import ModelSpec

_COMMON: dict[str, Any] = {
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
}

# Per model_type: transformers' defaults, and which architectural traits the family has.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "defaults": {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 2048,
        },
    },
    "mistral": {
        "defaults": {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "sliding_window": 4096,
        },
        "attention_bias": "never",
    },
    "mixtral": {
        "defaults": {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
        "attention_bias": "never",
        "moe": "mixtral",
    },
    "qwen2": {
        "defaults": {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "use_sliding_window": False,
            "max_window_layers": 28,
        },
        # q, k and v have a bias, o_proj has none, whatever the config says.
        "attention_bias": "qkv",
        "windowed_layers": "from_max_window_layers",
    },
    "qwen3": {
        "defaults": {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "head_dim": 128,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "use_sliding_window": False,
            "max_window_layers": 28,
        },
        "qk_norm": True,
        "windowed_layers": "from_max_window_layers",
    },
    "qwen3_moe": {
        "defaults": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "use_sliding_window": False,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "decoder_sparse_step": 1,
        },
        "qk_norm": True,
        "moe": "qwen3_moe",
        "windowed_layers": "all_if_enabled",
    },
    "gemma": {
        "defaults": {
            "vocab_size": 256000,
            "hidden_size": 3072,
            "intermediate_size": 24576,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh",
        },
    },
    "gemma2": {
        "defaults": {
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        "act_key": "hidden_activation",
        "sandwich_norm": True,
        "windowed_layers": "pattern",
        "sliding_window_pattern": 2,
    },
    "gemma3_text": {
        "defaults": {
            "vocab_size": 262208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096,
        },
        "act_key": "hidden_activation",
        "qk_norm": True,
        "sandwich_norm": True,
        "windowed_layers": "pattern",
        "sliding_window_pattern": 6,
    },
    "phi3": {
        "defaults": {
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 4096,
        },
        "attention_bias": "never",
        "fused": True,
    },
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*_FAMILIES, "gemma3")


def spec_from_config(config: dict[str, Any], name: str | None = None) -> ModelSpec:
    """The ModelSpec of a causal LM described by a Hugging Face config.json dict.

    A multimodal Gemma 3 config (model_type "gemma3") resolves to its text_config."""
    if not isinstance(config, dict):
        raise MemplanError(f"a model config must be a JSON object, not {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == "gemma3":
        text_config = config.get("text_config")
        if not isinstance(text_config, dict):
            raise MemplanError("this gemma3 config has no text_config object to read")
        config = {"model_type": "gemma3_text", **text_config}
        model_type = "gemma3_text"
    if model_type is None:
        raise MemplanError("the model config has no 'model_type' key")
    family = _FAMILIES.get(model_type)
    if family is None:
        raise MemplanError(
            f"model_type {model_type!r} is not supported; supported model types: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )

    cfg = {**_COMMON, **family["defaults"]}
    # For these keys a null in config.json means the class default, as in transformers.
    cfg.update({k: v for k, v in config.items() if v is not None or k not in _NULL_MEANS_DEFAULT})

    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    layers = _positive_int(cfg, "num_hidden_layers")
    kv_heads = (
        _positive_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else heads
    )
    head_dim = _positive_int(cfg, "head_dim") if cfg.get("head_dim") else hidden // heads
    if heads % kv_heads:
        raise MemplanError(
            f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )

    attention_bias, attention_out_bias = _attention_biases(family, cfg)
    sliding_window, layer_types = _attention_windows(family, cfg, layers)
    num_experts, experts_per_tok, moe_intermediate = _experts(family, cfg, config)

    return ModelSpec(
        name=name,
        model_type=model_type,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        hidden_act=_activation(model_type, family, cfg),
        norm="rms",
        attention_bias=attention_bias,
        attention_out_bias=attention_out_bias,
        mlp_bias=bool(cfg["mlp_bias"]) if model_type == "llama" else False,
        qk_norm=family.get("qk_norm", False),
        sandwich_norm=family.get("sandwich_norm", False),
        fused_qkv=family.get("fused", False),
        fused_gate_up=family.get("fused", False),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_tok,
        moe_intermediate_size=moe_intermediate,
        hf_config=dict(config),
    )


_NULL_MEANS_DEFAULT = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "hidden_act",
        "hidden_activation",
        "attention_bias",
        "mlp_bias",
        "use_sliding_window",
        "max_window_layers",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
    }
)


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemplanError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _activation(model_type: str, family: dict[str, Any], cfg: dict[str, Any]) -> str:
    act = cfg.get(family.get("act_key", "hidden_act"))
    # The original Gemma releases say "gelu", which transformers 5.17 builds as exact (erf)
    # GELU: kept as given (geglu with approximate="none"; the patch checks the module's act_fn).
    if not isinstance(act, str):
        raise MemplanError(f"the model config's activation must be a string, got {act!r}")
    return act


def _attention_biases(family: dict[str, Any], cfg: dict[str, Any]) -> tuple[bool, bool]:
    rule = family.get("attention_bias", "config")
    if rule == "never":
        return False, False
    if rule == "qkv":
        return True, False
    bias = bool(cfg["attention_bias"])
    return bias, bias


def _attention_windows(
    family: dict[str, Any], cfg: dict[str, Any], layers: int
) -> tuple[int | None, tuple[str, ...] | None]:
    """The sliding window and, when any layer uses it, every layer's attention type."""
    window = cfg.get("sliding_window")
    rule = family.get("windowed_layers", "all")
    if rule in ("from_max_window_layers", "all_if_enabled") and not cfg["use_sliding_window"]:
        window = None
    if window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise MemplanError(
            f"config key 'sliding_window' must be a positive integer, got {window!r}"
        )

    explicit = cfg.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != layers:
            raise MemplanError(
                f"config key 'layer_types' must list one type for each of {layers} layers"
            )
        types = tuple(str(t) for t in explicit)
    elif rule == "pattern":
        pattern = cfg.get("sliding_window_pattern", family["sliding_window_pattern"])
        types = tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        )
    elif rule == "from_max_window_layers":
        first = cfg["max_window_layers"]
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        )
    else:
        types = ("sliding_attention",) * layers
    if "sliding_attention" not in types:
        return None, None
    return window, types


def _experts(
    family: dict[str, Any], cfg: dict[str, Any], config: dict[str, Any]
) -> tuple[int, int, int]:
    kind = family.get("moe")
    if kind is None:
        return 0, 0, 0
    # transformers maps num_experts <-> num_local_experts, so a config may carry either.
    native, alias = (
        ("num_local_experts", "num_experts")
        if kind == "mixtral"
        else ("num_experts", "num_local_experts")
    )
    experts = config.get(native) or config.get(alias) or cfg[native]
    if isinstance(experts, bool) or not isinstance(experts, int) or experts <= 0:
        raise MemplanError(f"the number of experts must be a positive integer, got {experts!r}")
    per_tok = _positive_int(cfg, "num_experts_per_tok")
    if kind == "mixtral":
        return experts, per_tok, _positive_int(cfg, "intermediate_size")
    if cfg.get("mlp_only_layers") or cfg["decoder_sparse_step"] != 1:
        raise MemplanError(
            "qwen3_moe configs with dense layers (mlp_only_layers or decoder_sparse_step > 1) "
            "are not supported; every layer must be a mixture of experts"
        )
    return experts, per_tok, _positive_int(cfg, "moe_intermediate_size")
