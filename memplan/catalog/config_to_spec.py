"""A Hugging Face config.json (a plain dict) -> memplan.schema.ModelSpec, without transformers.

Each family entry (memplan/families) lists the defaults of its transformers config class (5.x)
for the keys that decide memory, so a config.json that leaves them out (the text_config of a
multimodal Gemma 3 checkpoint leaves out most) means what transformers would build.
tests/test_catalog.py checks these defaults against the installed transformers and the derived
fields against the modules a real model has."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from memplan.catalog.vision_tower import vision_tower_tensors
from memplan.errors import MemplanError
from memplan.families import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    TEXT_FAMILIES_OF,
    WRAPPERS,
    ConfigRules,
)
from memplan.schema import ModelSpec

_COMMON: dict[str, Any] = {
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_cache": True,
    "attention_dropout": 0.0,
}

_LAYER_TYPES = ("full_attention", "sliding_attention")


def spec_from_config(config: dict[str, Any], name: str | None = None) -> ModelSpec:
    """The ModelSpec of a causal LM described by a Hugging Face config.json dict.

    A multimodal config (model_type "gemma3" or "mistral3": memplan.families.wrappers) resolves
    to its text_config, with the parameters of its vision tower and projector beside it. A value
    of the wrong type or range is one MemplanError naming its key, never a guess."""
    if not isinstance(config, dict):
        raise MemplanError(f"a model config must be a JSON object, not {type(config).__name__}")
    if config.get("model_type") is None:
        raise MemplanError("the model config has no 'model_type' key")
    model_type = _string(config, "model_type")
    multimodal = config if model_type in WRAPPERS else None
    if multimodal is not None:
        config = _text_config(multimodal, model_type)
        model_type = config["model_type"]
    family = FAMILIES.get(model_type)
    if family is None:
        raise MemplanError(
            f"model_type {model_type!r} is not supported; supported model types: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    rules = family.config

    cfg = {**_COMMON, **rules.defaults}
    # For these keys a null in config.json means the class default, as in transformers.
    cfg.update({k: v for k, v in config.items() if v is not None or k not in _NULL_MEANS_DEFAULT})

    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    layers = _positive_int(cfg, "num_hidden_layers")
    kv_heads = _optional_positive_int(cfg, "num_key_value_heads") or heads
    latent = _latent_attention(rules, cfg, model_type, heads, kv_heads)
    head_dim = latent.get("head_dim") or _optional_positive_int(cfg, "head_dim") or hidden // heads
    if head_dim == 0:
        raise MemplanError(
            f"hidden_size ({hidden}) is smaller than num_attention_heads ({heads}) and no "
            "head_dim is given"
        )
    if heads % kv_heads:
        raise MemplanError(
            f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )

    _check_modelled(rules, cfg, model_type)
    attention_bias, attention_out_bias = _attention_biases(rules, cfg)
    if rules.llama4_query_scale:
        _check_llama4_scale(cfg, model_type)
    if rules.attention_sinks:
        _check_sinks_dropout(cfg, model_type)
    nope_layers = _nope_layers(rules, cfg, layers)
    sliding_window, layer_types = _attention_windows(rules, cfg, layers, nope_layers)
    num_experts, experts_per_tok, moe_intermediate = _experts(rules, cfg, config, model_type)
    dense_layers, shared_width = _dense_and_shared(rules, cfg, layers, moe_intermediate)
    llama4 = _llama4_attention(rules, cfg, layers, nope_layers)
    deltanet = _gated_deltanet(rules, cfg, layers)

    fields = {
        "name": name,
        "model_type": model_type,
        "vocab_size": _positive_int(cfg, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": _dense_width(rules, cfg, shared_width),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _positive_int(cfg, "max_position_embeddings"),
        "tie_word_embeddings": _boolean(cfg, "tie_word_embeddings"),
        "use_cache": _boolean(cfg, "use_cache"),
        # The original Gemma releases say "gelu", which transformers builds as exact (erf) GELU:
        # kept as given (geglu with approximate="none"; the patch checks the module's act_fn).
        "hidden_act": _string(cfg, rules.act_key),
        "norm": "rms",
        "attention_bias": attention_bias,
        "attention_out_bias": attention_out_bias,
        "mlp_bias": _boolean(cfg, "mlp_bias") if rules.mlp_bias else False,
        "qk_norm": _qk_norm(rules, cfg),
        "qk_norm_scope": rules.qk_norm_scope,
        "sandwich_norm": rules.sandwich_norm,
        "post_norm": rules.post_norm,
        "rope_in_fp32": rules.rope_in_fp32,
        "rope_tables": _rope_tables(rules, cfg, layers),
        "rotary_dim": latent.get("rotary_dim") or _rotary_dim(rules, cfg, head_dim),
        "kv_lora_rank": latent.get("kv_lora_rank", 0),
        "q_lora_rank": latent.get("q_lora_rank", 0),
        "v_head_dim": latent.get("v_head_dim", 0),
        "rope_half_tables": rules.rope_half_tables,
        "attention_sinks": rules.attention_sinks,
        "fused_qkv": rules.fused,
        "fused_gate_up": rules.fused,
        "final_logit_softcapping": _optional_positive_float(cfg, "final_logit_softcapping"),
        "attn_logit_softcapping": _optional_positive_float(cfg, "attn_logit_softcapping"),
        "llama4_query_scale": rules.llama4_query_scale,
        "attention_dropout": _probability(cfg, "attention_dropout"),
        "residual_dropout": _probability(cfg, rules.residual_dropout_key)
        if rules.residual_dropout_key
        else 0.0,
        "sliding_window": sliding_window,
        "layer_types": layer_types,
        "nope_layers": nope_layers,
        **_global_layers(rules, cfg, layers, head_dim, kv_heads),
        "v_norm": rules.v_norm,
        "layer_scalar": rules.layer_scalar,
        "kv_kept_layers": _kv_kept_layers(rules, cfg, layers),
        **_multipliers(rules, cfg),
        **llama4,
        **deltanet,
        "attention_output_gate": rules.attention_output_gate,
        "rope_per_batch_row": rules.rope_per_batch_row,
        "num_experts": num_experts,
        "num_experts_per_tok": experts_per_tok,
        "moe_intermediate_size": moe_intermediate,
        "dense_layers": dense_layers,
        "shared_expert_intermediate_size": shared_width,
        **_moe_router(rules),
        "wrapper_model_type": None if multimodal is None else multimodal["model_type"],
        "vision_tower_tensors": ()
        if multimodal is None
        else vision_tower_tensors(WRAPPERS[multimodal["model_type"]], multimodal, hidden),
        "hf_config": dict(config),
    }
    try:
        return ModelSpec(**fields)
    except ValidationError as e:
        # A safety net: the readers above check every field ModelSpec's types would refuse.
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise MemplanError(
            f"the model config gives an invalid {field} ({first['msg']}, got "
            f"{_show(first.get('input'))})"
        ) from e


_NULL_MEANS_DEFAULT = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "use_cache",
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


# ----------------------------------------------------------------------------- typed readers
# Every value read from a config goes through one of these: a wrong type or range is one
# MemplanError naming the key and the value, as config.json spells it.


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad_value(key: str, value: Any, expected: str) -> MemplanError:
    return MemplanError(f"config key {key!r} must be {expected}, got {_show(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not _is_int(value) or value <= 0:
        raise _bad_value(key, value, "a positive integer")
    return value


def _optional_positive_int(cfg: dict[str, Any], key: str) -> int | None:
    """None when the key is absent or null (the caller derives the value)."""
    return None if cfg.get(key) is None else _positive_int(cfg, key)


def _non_negative_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not _is_int(value) or value < 0:
        raise _bad_value(key, value, "an integer >= 0")
    return value


def _optional_positive_float(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not (_is_int(value) or isinstance(value, float)) or not 0 < value < math.inf:
        raise _bad_value(key, value, "a positive number or null")
    return float(value)


def _number(cfg: dict[str, Any], key: str) -> float:
    value = cfg.get(key)
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise _bad_value(key, value, "a finite number")
    return float(value)


def _positive_number(cfg: dict[str, Any], key: str) -> float:
    value = _number(cfg, key)
    if value <= 0:
        raise _bad_value(key, cfg[key], "a positive number")
    return value


def _probability(cfg: dict[str, Any], key: str) -> float:
    value = cfg.get(key)
    if not (_is_int(value) or isinstance(value, float)) or not 0 <= value < 1:
        raise _bad_value(key, value, "a number >= 0 and < 1")
    return float(value)


def _boolean(cfg: dict[str, Any], key: str) -> bool:
    value = cfg.get(key)
    if not isinstance(value, bool):
        raise _bad_value(key, value, "true or false (a JSON boolean, not a string or number)")
    return value


def _string(cfg: dict[str, Any], key: str) -> str:
    value = cfg.get(key)
    if not isinstance(value, str) or not value:
        raise _bad_value(key, value, "a non-empty string")
    return value


def _optional_list(cfg: dict[str, Any], key: str) -> list[Any]:
    """An empty list when the key is absent or null."""
    value = cfg.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad_value(key, value, "a list or null")
    return value


# ----------------------------------------------------------------------------- family rules


def _text_config(config: dict[str, Any], wrapper: str) -> dict[str, Any]:
    """The text_config of a multimodal config, with the model_type its config class gives it."""
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        raise MemplanError(f"this {wrapper} config has no text_config object to read")
    families = TEXT_FAMILIES_OF[wrapper]
    text_type = text_config.get("model_type", WRAPPERS[wrapper].default_text)
    if text_type not in families:
        raise _bad_value(
            "text_config.model_type", text_type, " or ".join(f'"{f}"' for f in families)
        )
    return {**text_config, "model_type": text_type}


def _check_modelled(rules: ConfigRules, cfg: dict[str, Any], model_type: str) -> None:
    """One line for the first key whose value builds what memplan does not model."""
    for rule in rules.unmodelled:
        value = cfg.get(rule.key)
        if value not in rule.modelled or isinstance(value, bool) != isinstance(
            rule.modelled[0], bool
        ):
            allowed = " or ".join(_show(v) for v in rule.modelled)
            raise MemplanError(
                f"{model_type} with {rule.key} {_show(value)} ({rule.what}) is not modelled; "
                f"memplan models {rule.key} {allowed}"
            )


def _global_layers(
    rules: ConfigRules, cfg: dict[str, Any], layers: int, head_dim: int, kv_heads: int
) -> dict[str, Any]:
    """Gemma 4's full-attention layers and the geometry they take: per_layer_config's entries
    where the config gives one (transformers 5.17 writes it), else global_head_dim (512 by
    default, as Gemma4TextConfig pops it) and, with attention_k_eq_v,
    num_global_key_value_heads; with attention_k_eq_v they have no v_proj."""
    if not rules.global_layers:
        return {}
    types = _model_layer_types(rules, cfg, layers)
    full = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    k_eq_v = _boolean(cfg, "attention_k_eq_v")
    if cfg.get("per_layer_config") is not None:
        global_head_dim, global_kv = _per_layer_geometry(cfg, full, head_dim, kv_heads)
    else:
        global_head_dim = _positive_int(cfg, "global_head_dim")
        global_kv = _optional_positive_int(cfg, "num_global_key_value_heads") if k_eq_v else None
        global_kv = global_kv or kv_heads
    heads = _positive_int(cfg, "num_attention_heads")
    if heads % global_kv:
        raise MemplanError(
            f"num_attention_heads ({heads}) is not a multiple of the full-attention layers' "
            f"key-value heads ({global_kv})"
        )
    return {
        "global_layers": full,
        "global_head_dim": global_head_dim,
        "global_key_value_heads": global_kv,
        "global_values_from_keys": k_eq_v,
    }


def _kv_kept_layers(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The last layer of each attention type, which Gemma 4 keeps the k and v of."""
    if not rules.keeps_last_kv_per_type:
        return ()
    types = _model_layer_types(rules, cfg, layers)
    return tuple(sorted({kind: i for i, kind in enumerate(types)}.values()))


def _per_layer_geometry(
    cfg: dict[str, Any], full: tuple[int, ...], head_dim: int, kv_heads: int
) -> tuple[int, int]:
    """The one head_dim / num_key_value_heads override per_layer_config gives every
    full-attention layer (and no other layer)."""
    entries = cfg["per_layer_config"]
    expected = "an object of layer index -> {head_dim, num_key_value_heads}, the same for every "
    expected += "full-attention layer and none for the others"
    if not isinstance(entries, dict):
        raise _bad_value("per_layer_config", entries, expected)
    overrides = {}
    for key, entry in entries.items():
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(entry, dict):
            raise _bad_value("per_layer_config", entries, expected)
        if set(entry) - {"head_dim", "num_key_value_heads"}:
            raise _bad_value("per_layer_config", entries, expected)
        overrides[int(key)] = (
            _optional_positive_int(entry, "head_dim") or head_dim,
            _optional_positive_int(entry, "num_key_value_heads") or kv_heads,
        )
    geometries = {overrides.get(i, (head_dim, kv_heads)) for i in full}
    if set(overrides) - set(full) or len(geometries) > 1:
        raise _bad_value("per_layer_config", entries, expected)
    return geometries.pop() if geometries else (head_dim, kv_heads)


def _check_llama4_scale(cfg: dict[str, Any], model_type: str) -> None:
    """transformers' attention reads rope_parameters' llama_4_scaling_beta and
    original_max_position_embeddings for the query scale (its config class writes both when
    rope_parameters is not given), and fails without them."""
    rope = cfg.get("rope_parameters")
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise _bad_value("rope_parameters", rope, "an object or null")
    for key in ("llama_4_scaling_beta", "original_max_position_embeddings"):
        if rope.get(key) is None:
            raise MemplanError(
                f"{model_type} scales its queries by rope_parameters' llama_4_scaling_beta and "
                f"original_max_position_embeddings, and this config's rope_parameters gives no "
                f"{key}: transformers' {model_type} attention cannot run it"
            )


def _latent_attention(
    rules: ConfigRules, cfg: dict[str, Any], model_type: str, heads: int, kv_heads: int
) -> dict[str, int]:
    """DeepSeek-V3's multi-head latent attention (ConfigRules.latent_attention): q and k heads of
    qk_nope_head_dim + qk_rope_head_dim (the config's head_dim, which transformers sets to the
    rotated width, is not theirs), v heads of v_head_dim, the latents' ranks (q_lora_rank null:
    a plain q_proj); empty for other families."""
    if not rules.latent_attention:
        return {}
    if kv_heads != heads:
        raise MemplanError(
            f"{model_type} with num_key_value_heads {kv_heads} and num_attention_heads {heads} "
            "is not modelled: its latent attention builds k and v for every head (eager "
            "attention fails on transformers 5.17 unless the two are equal)"
        )
    if _probability(cfg, "attention_dropout"):
        raise MemplanError(
            f"{model_type} with attention_dropout {_show(cfg['attention_dropout'])} is not "
            "supported: memplan models its latent attention without dropout (attention_dropout 0)"
        )
    rope = _positive_int(cfg, "qk_rope_head_dim")
    if rope % 2:
        raise _bad_value("qk_rope_head_dim", rope, "an even positive integer")
    tables = _optional_positive_int(cfg, "head_dim")
    if tables is not None and tables != rope:
        raise MemplanError(
            f"{model_type} with head_dim {tables} and qk_rope_head_dim {rope}: transformers' "
            "rotary tables are head_dim wide and its latent attention rotates qk_rope_head_dim "
            "dims, so the two must be equal (the config class sets head_dim to it)"
        )
    return {
        "head_dim": _positive_int(cfg, "qk_nope_head_dim") + rope,
        "rotary_dim": rope,
        "kv_lora_rank": _positive_int(cfg, "kv_lora_rank"),
        "q_lora_rank": _optional_positive_int(cfg, "q_lora_rank") or 0,
        "v_head_dim": _positive_int(cfg, "v_head_dim"),
    }


def _check_sinks_dropout(cfg: dict[str, Any], model_type: str) -> None:
    """Dropout on attention probabilities that sit beside a sink column is not modelled."""
    if _probability(cfg, "attention_dropout"):
        raise MemplanError(
            f"{model_type} with attention_dropout {_show(cfg['attention_dropout'])} is not "
            "supported: memplan models its sink attention without dropout (attention_dropout 0)"
        )


def _attention_biases(rules: ConfigRules, cfg: dict[str, Any]) -> tuple[bool, bool]:
    rule = rules.attention_bias
    if rule == "never":
        return False, False
    if rule == "qkv":
        return True, False
    if rule == "qkv_config":
        return _boolean(cfg, "attention_bias"), False
    if rule == "out_key":
        return _boolean(cfg, "attention_bias"), _boolean(cfg, "attention_out_bias")
    bias = _boolean(cfg, "attention_bias")
    return bias, bias


def _qk_norm(rules: ConfigRules, cfg: dict[str, Any]) -> bool:
    """The family's q/k norms, or the config's switch for them (qk_norm_key)."""
    if rules.qk_norm_key is None:
        return rules.qk_norm
    return _boolean(cfg, rules.qk_norm_key)


def _rotary_dim(rules: ConfigRules, cfg: dict[str, Any], head_dim: int) -> int | None:
    """The leading dims of each head RoPE rotates: head_dim x partial_rotary_factor, the factor
    rope_parameters gives, else the config's own key (transformers copies that one into
    rope_parameters only where they give none); None where every dim rotates."""
    if not rules.partial_rotary:
        return None
    rope = cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise _bad_value("rope_parameters", rope, "an object or null")
    if rope is not None and rope.get("partial_rotary_factor") is not None:
        factor = _number(rope, "partial_rotary_factor")
    else:
        factor = _number(cfg, "partial_rotary_factor")
    # cos and sin hold one angle per even dim below int(head_dim x factor), each twice
    rotated = int(head_dim * factor)
    rotary = rotated + rotated % 2
    if not 0 < rotary <= head_dim:
        raise MemplanError(
            f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotated} dims; "
            "transformers' RoPE needs between 1 and head_dim (rounded up to even)"
        )
    return None if rotary == head_dim else rotary


def _multipliers(rules: ConfigRules, cfg: dict[str, Any]) -> dict[str, float | None]:
    """Granite's embedding and residual multipliers and its logits divisor, or none."""
    keys = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
    if not rules.multipliers:
        return dict.fromkeys(keys)
    return {
        "embedding_multiplier": _number(cfg, "embedding_multiplier"),
        "residual_multiplier": _number(cfg, "residual_multiplier"),
        "logits_scaling": _positive_number(cfg, "logits_scaling"),
    }


def _nope_layers(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The layers that apply no RoPE: the 0 entries of no_rope_layers (one per layer at least),
    else every no_rope_layer_interval-th layer, as SmolLM3Config derives them; EXAONE 4's full
    layers (_full_attention_layers)."""
    if rules.nope_full_layers:
        return _full_attention_layers(rules, cfg, layers)
    if not rules.nope_layers:
        return ()
    if cfg.get("no_rope_layers") is None:
        interval = _positive_int(cfg, "no_rope_layer_interval")
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    flags = _optional_list(cfg, "no_rope_layers")
    if len(flags) < layers or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise _bad_value(
            "no_rope_layers",
            cfg["no_rope_layers"],
            f"a list of at least {layers} entries, each 0 or 1",
        )
    return tuple(i for i in range(layers) if not flags[i])


def _full_attention_layers(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The full-attention layers where a sliding window is set (all of them if no layer
    slides), none without a window: EXAONE 4 rotates only in its sliding layers."""
    if _optional_positive_int(cfg, "sliding_window") is None:
        return ()
    if cfg.get("layer_types") is not None:
        types = _layer_types(cfg, layers)
    else:
        types = _pattern_layer_types(rules, cfg, layers)
    return tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def _attention_windows(
    rules: ConfigRules, cfg: dict[str, Any], layers: int, nope_layers: tuple[int, ...] = ()
) -> tuple[int | None, tuple[str, ...] | None]:
    """The sliding window and, when any layer uses it, every layer's attention type."""
    rule = rules.windowed_layers
    if rule == "never":
        return None, None
    if rule in ("from_max_window_layers", "all_if_enabled") and not _boolean(
        cfg, "use_sliding_window"
    ):
        return None, None
    window = _optional_positive_int(cfg, "sliding_window")
    if window is None:
        return None, None

    if rules.reads_layer_types and cfg.get("layer_types") is not None:
        types = _layer_types(cfg, layers, rules)
    elif rule == "pattern":
        types = _pattern_layer_types(rules, cfg, layers)
    elif rule == "nope_if_enabled":
        if not _boolean(cfg, "use_sliding_window"):
            return None, None
        types = tuple(
            "sliding_attention" if i in nope_layers else "full_attention" for i in range(layers)
        )
    elif rule == "from_max_window_layers":
        first = _non_negative_int(cfg, "max_window_layers")
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        )
    else:
        types = ("sliding_attention",) * layers
    if "sliding_attention" not in types:
        return None, None
    return window, types


def _layer_types(
    cfg: dict[str, Any], layers: int, rules: ConfigRules | None = None
) -> tuple[str, ...]:
    return _last_layer_made_full(rules, _listed_layer_types(cfg, layers, _LAYER_TYPES))


def _listed_layer_types(
    cfg: dict[str, Any], layers: int, kinds: tuple[str, str]
) -> tuple[str, ...]:
    """cfg's layer_types: one entry a layer, each one of `kinds`."""
    types = tuple(_optional_list(cfg, "layer_types"))
    if len(types) != layers or not set(types) <= set(kinds):
        raise _bad_value(
            "layer_types",
            cfg["layer_types"],
            f'a list of {layers} entries, each "{kinds[0]}" or "{kinds[1]}"',
        )
    return types


def _last_layer_made_full(rules: ConfigRules | None, types: tuple[str, ...]) -> tuple[str, ...]:
    """Gemma 4's config class makes the last layer a full-attention one."""
    if rules is None or not rules.last_layer_full:
        return types
    return (*types[:-1], "full_attention")


def _model_layer_types(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Every layer's attention type as the config class builds it, window or not."""
    if cfg.get("layer_types") is not None:
        return _layer_types(cfg, layers, rules)
    return _pattern_layer_types(rules, cfg, layers)


def _pattern_layer_types(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Every sliding_window_pattern-th layer full, the others sliding."""
    pattern = _optional_positive_int(cfg, "sliding_window_pattern") or rules.sliding_window_pattern
    assert pattern is not None  # ConfigRules requires one with this rule
    types = tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    )
    return _last_layer_made_full(rules, types)


def _rope_tables(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> int:
    """The cos/sin pairs one forward computes: one per layer type the config lists, where the
    family keeps rotary embeddings per type (whether or not a window is set)."""
    if not rules.rope_per_layer_type:
        return 1
    if cfg.get("layer_types") is not None:
        return len(set(_layer_types(cfg, layers, rules)))
    if rules.windowed_layers == "pattern":
        return len(set(_pattern_layer_types(rules, cfg, layers)))
    return 1


def _gated_deltanet(rules: ConfigRules, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3.5's gated DeltaNet layers and their geometry: those layer_types names
    "linear_attention", else all but every full_attention_interval-th layer."""
    if not rules.gated_deltanet:
        return {}
    kinds = ("linear_attention", "full_attention")
    if cfg.get("layer_types") is not None:
        types = _listed_layer_types(cfg, layers, kinds)
    else:
        interval = _positive_int(cfg, "full_attention_interval")
        types = tuple(kinds[(i + 1) % interval == 0] for i in range(layers))
    geometry = {
        key: _positive_int(cfg, key)
        for key in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    }
    if geometry["linear_num_value_heads"] % geometry["linear_num_key_heads"]:
        raise MemplanError(
            f"linear_num_value_heads ({geometry['linear_num_value_heads']}) is not a multiple of "
            f"linear_num_key_heads ({geometry['linear_num_key_heads']})"
        )
    linear = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    return {"linear_attention_layers": linear, **geometry}


def _experts(
    rules: ConfigRules, cfg: dict[str, Any], config: dict[str, Any], model_type: str
) -> tuple[int, int, int]:
    moe = rules.moe
    if moe is None:
        return 0, 0, 0
    # transformers maps num_experts (or n_routed_experts) <-> num_local_experts, so a config
    # may carry either.
    native = moe.experts_key
    alias = "num_experts" if native == "num_local_experts" else "num_local_experts"
    given_as_alias = config.get(native) is None and config.get(alias) is not None
    experts = _positive_int(cfg, alias if given_as_alias else native)
    per_tok = _positive_int(cfg, "num_experts_per_tok")
    if per_tok > experts:
        raise MemplanError(
            f"num_experts_per_tok ({per_tok}) is more than the number of experts ({experts})"
        )
    if moe.router == "sigmoid_fp32":
        _check_expert_groups(cfg, experts, per_tok)
    if moe.dense_layers_key is not None and (
        _optional_list(cfg, moe.dense_layers_key) or _positive_int(cfg, moe.dense_step_key) != 1
    ):
        raise MemplanError(
            f"{model_type} configs with dense layers ({moe.dense_layers_key} or "
            f"{moe.dense_step_key} > 1) are not supported; every layer must be a mixture of experts"
        )
    if moe.moe_layers_key is not None:
        _check_every_layer_moe(cfg, moe.moe_layers_key, moe.dense_step_key, model_type)
    return experts, per_tok, _positive_int(cfg, moe.expert_width_key)


def _dense_and_shared(
    rules: ConfigRules, cfg: dict[str, Any], layers: int, expert_width: int
) -> tuple[tuple[int, ...], int]:
    """The layers of a DeepSeek-style MoE model with a dense MLP (the first first_k_dense_replace
    ones) and the width of each MoE layer's shared experts (expert width x n_shared_experts;
    Llama 4's one shared expert, as wide as an expert; Qwen3-Next's of its own width)."""
    moe = rules.moe
    if moe is None:
        return (), 0
    dense: tuple[int, ...] = ()
    if moe.first_dense_key is not None:
        dense = tuple(range(min(_non_negative_int(cfg, moe.first_dense_key), layers)))
    shared = 0
    if moe.shared_experts_key is not None:
        shared = expert_width * _positive_int(cfg, moe.shared_experts_key)
    elif moe.router == "sigmoid_every_expert":  # Llama 4: one shared expert, as wide
        shared = expert_width
    elif moe.shared_expert_width_key is not None:
        shared = _positive_int(cfg, moe.shared_expert_width_key)
    return dense, shared


def _dense_width(rules: ConfigRules, cfg: dict[str, Any], shared_width: int) -> int:
    """intermediate_size; Qwen3.5-MoE's config has none (every layer a MoE block): the shared
    expert's width stands in for it, the widest gated MLP the model runs."""
    if cfg.get("intermediate_size") is None and rules.moe and rules.moe.shared_expert_width_key:
        return shared_width
    return _positive_int(cfg, "intermediate_size")


def _check_expert_groups(cfg: dict[str, Any], experts: int, per_tok: int) -> None:
    """A DeepSeek-style router picks topk_group of n_group equal groups of experts by their two
    best scores, then num_experts_per_tok experts among those groups: transformers' router
    fails on any other split."""
    groups = _positive_int(cfg, "n_group")
    chosen = _positive_int(cfg, "topk_group")
    if experts % groups or experts // groups < 2 or chosen > groups:
        raise MemplanError(
            f"{experts} experts in n_group {groups} groups with topk_group {chosen}: the router "
            "needs groups of at least 2 experts and topk_group <= n_group"
        )
    if per_tok > chosen * (experts // groups):
        raise MemplanError(
            f"num_experts_per_tok ({per_tok}) is more than the experts of the topk_group "
            f"({chosen}) groups the router picks ({chosen * (experts // groups)})"
        )


def _check_every_layer_moe(
    cfg: dict[str, Any], moe_layers_key: str, step_key: str, model_type: str
) -> None:
    """Llama 4's MoE layers: those moe_layers lists where given (indices past the last layer
    are ignored, as the model ignores them), else every interleave_moe_layer_step-th layer; a
    layer left out has a dense MLP, which memplan does not model (Maverick's)."""
    layers = _positive_int(cfg, "num_hidden_layers")
    if cfg.get(moe_layers_key) is not None:
        listed = _optional_list(cfg, moe_layers_key)
        every = set(range(layers)) <= {i for i in listed if _is_int(i)}
    else:
        every = _positive_int(cfg, step_key) == 1
    if not every:
        raise MemplanError(
            f"{model_type} configs with dense layers ({moe_layers_key} short of every layer, or "
            f"{step_key} > 1, as Llama 4 Maverick's) are not supported; every layer must be a "
            "mixture of experts"
        )


def _moe_router(rules: ConfigRules) -> dict[str, Any]:
    """How tokens reach the experts (MoeRules.router), for a MoE family."""
    return {} if rules.moe is None else {"moe_router": rules.moe.router}


def _llama4_attention(
    rules: ConfigRules, cfg: dict[str, Any], layers: int, nope_layers: tuple[int, ...]
) -> dict[str, Any]:
    """Llama 4's attention traits (ConfigRules.llama4_attention): the layers that rotate attend
    within chunks (their layer_types say chunked_attention, the others full_attention, as
    Llama4TextConfig derives them), L2-normalize q and k where use_qk_norm; the others scale
    their queries where attn_temperature_tuning."""
    if not rules.llama4_attention:
        return {}
    derived = ["full_attention" if i in nope_layers else "chunked_attention" for i in range(layers)]
    if cfg.get("layer_types") is not None and list(_optional_list(cfg, "layer_types")) != derived:
        raise _bad_value(
            "layer_types",
            cfg["layer_types"],
            '"chunked_attention" where the layer rotates (no_rope_layers) and "full_attention" '
            "elsewhere, or null",
        )
    chunk = _optional_positive_int(cfg, "attention_chunk_size")
    if chunk is None and len(nope_layers) < layers:
        raise MemplanError(
            "llama4 configs whose layers with RoPE have no attention_chunk_size are not "
            "supported: transformers' chunked mask needs one"
        )
    if _probability(cfg, "attention_dropout"):
        raise MemplanError(
            "llama4 configs with attention_dropout above 0 are not supported: its eager "
            "attention's dropout on the bf16 probabilities is not modelled"
        )
    _positive_int(cfg, "intermediate_size_mlp")  # the dense layers' width, none here
    _positive_number(cfg, "floor_scale")
    _number(cfg, "attn_scale")
    return {
        "rope_complex": True,
        "qk_l2_norm": _boolean(cfg, "use_qk_norm"),
        "nope_query_temperature": _boolean(cfg, "attn_temperature_tuning"),
        "attention_chunk_size": chunk,
        "eager_softmax_fp32": False,
    }
