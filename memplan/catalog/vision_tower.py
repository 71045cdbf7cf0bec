"""The parameters of a multimodal config's vision tower and projector, as transformers builds
them from the config (memplan.families.wrappers): the element count of each parameter tensor,
in registration order (the tower's, then the projector's). No torch here;
tests/test_vision_tower.py checks every count against the modules transformers builds."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from memplan.errors import MemplanError
from memplan.families.wrappers import Wrapper

# The tower config classes' defaults for the keys that decide its parameters (transformers 5).
TOWER_DEFAULTS: dict[str, dict[str, Any]] = {
    # Qwen3_5VisionConfig's
    "qwen3_5": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 3584,
        "num_position_embeddings": 2304,
    },
    "siglip": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
    },
    "gemma4": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "head_dim": 64,
        "patch_size": 16,
        "position_embedding_size": 10240,
    },
    "pixtral": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_channels": 3,
        "image_size": 1024,
        "patch_size": 16,
    },
    "llama4": {
        "hidden_size": 768,
        "intermediate_size": 5632,
        "num_hidden_layers": 34,
        "num_channels": 3,
        "image_size": 448,
        "patch_size": 14,
        "vision_output_dim": 7680,
        "projector_input_dim": 4096,
        "projector_output_dim": 4096,
    },
}


def vision_tower_tensors(
    wrapper: Wrapper, config: dict[str, Any], text_hidden: int
) -> tuple[int, ...]:
    """Elements of each parameter of the vision tower and the projector that transformers
    builds beside the text model of `config` (a multimodal config.json of `wrapper`'s type)
    whose hidden size is `text_hidden`."""
    if config.get("vision_config") is None and wrapper.without_vision_config == "none":
        return ()
    vision = _vision_config(wrapper, config)
    tower = TOWERS[wrapper.tower](vision)
    projector = PROJECTORS[wrapper.model_type](config, vision, text_hidden)
    return (*tower, *projector)


def _vision_config(wrapper: Wrapper, config: dict[str, Any]) -> dict[str, Any]:
    """vision_config over the tower class's defaults, keys prefixed as errors name them."""
    given = config.get("vision_config")
    if given is None:
        given = wrapper.default_vision
    if not isinstance(given, dict):
        raise _bad("vision_config", given, "an object or null")
    if wrapper.tower_model_types:
        tower_type = given.get("model_type", wrapper.tower_model_types[0])
        if tower_type not in wrapper.tower_model_types:
            raise MemplanError(
                f"memplan counts the {wrapper.model_type} vision tower of vision_config "
                f"model_type {' or '.join(map(repr, wrapper.tower_model_types))}, not "
                f"{tower_type!r}"
            )
    merged = {**TOWER_DEFAULTS[wrapper.tower]}
    merged.update({k: v for k, v in given.items() if v is not None or k == "vision_use_head"})
    return {f"vision_config.{k}": v for k, v in merged.items()}


def _bad(key: str, value: Any, expected: str) -> MemplanError:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return MemplanError(f"config key {key!r} must be {expected}, got {shown[:60]}")


def _count(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _bad(key, value, "a positive integer")
    return value


# As a text model's (memplan.limits.SPEC_BOUNDS): the estimate allocates every tower tensor.
MAX_TOWER_LAYERS = 512


def _layers(cfg: dict[str, Any], key: str) -> int:
    layers = _count(cfg, key)
    if layers > MAX_TOWER_LAYERS:
        raise _bad(key, layers, f"at most {MAX_TOWER_LAYERS} (4x a text model's largest)")
    return layers


def _kernel_area(cfg: dict[str, Any], key: str) -> int:
    """A Conv2d kernel's height x width: one size, or a [height, width] pair."""
    value = cfg.get(key)
    if isinstance(value, list | tuple) and len(value) == 2:
        return _count({key: value[0]}, key) * _count({key: value[1]}, key)
    side = _count(cfg, key)
    return side * side


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    if key not in cfg:
        return default
    value = cfg[key]
    if value is not None and not isinstance(value, bool):
        raise _bad(key, value, "true, false or null")
    return bool(value)


# ----------------------------------------------------------------------------- towers


def siglip_tensors(vision: dict[str, Any]) -> tuple[int, ...]:
    """SiglipVisionModel: the patch Conv2d (with bias) and learned position embeddings, the
    encoder layers (LayerNorm, q/k/v/out projections with biases, LayerNorm, fc1/fc2 with
    biases), the post LayerNorm and, unless vision_use_head is given false, the attention
    pooling head (probe, nn.MultiheadAttention, LayerNorm, MLP)."""
    p = "vision_config."
    h, inter = _count(vision, p + "hidden_size"), _count(vision, p + "intermediate_size")
    channels = _count(vision, p + "num_channels")
    patch, image = _count(vision, p + "patch_size"), _count(vision, p + "image_size")
    positions = (image // patch) ** 2
    if positions == 0:
        raise _bad(p + "image_size", image, f"at least patch_size ({patch})")
    layer_norm = (h, h)
    mlp = (inter * h, inter, h * inter, h)
    layer = (*layer_norm, *(h * h, h) * 4, *layer_norm, *mlp)
    tensors = [h * channels * patch * patch, h, positions * h]
    tensors += layer * _layers(vision, p + "num_hidden_layers")
    tensors += layer_norm
    if _flag(vision, p + "vision_use_head", default=True):
        tensors += [h, 3 * h * h, 3 * h, h * h, h, *layer_norm, *mlp]
    return tuple(tensors)


def pixtral_tensors(vision: dict[str, Any]) -> tuple[int, ...]:
    """PixtralVisionModel: the patch Conv2d (no bias), ln_pre, then per layer attention_norm,
    the gated MLP (gate, up, down), k/v/q/o projections (no biases) and ffn_norm."""
    p = "vision_config."
    h, inter = _count(vision, p + "hidden_size"), _count(vision, p + "intermediate_size")
    channels = _count(vision, p + "num_channels")
    layer = (h, inter * h, inter * h, h * inter, *(h * h,) * 4, h)
    tensors = [h * channels * _kernel_area(vision, p + "patch_size"), h]
    tensors += layer * _layers(vision, p + "num_hidden_layers")
    return tuple(tensors)


def gemma4_tensors(vision: dict[str, Any]) -> tuple[int, ...]:
    """Gemma4VisionModel: the patch embedder's two position tables (one parameter, registered
    before its submodule's) and input projection (no bias), then per layer q/k/v/o projections
    (no biases), q_norm and k_norm (one head wide; v_norm has no weight), the gated MLP (gate,
    up, down) and four RMSNorms."""
    p = "vision_config."
    h, inter = _count(vision, p + "hidden_size"), _count(vision, p + "intermediate_size")
    heads, kv = _count(vision, p + "num_attention_heads"), _count(vision, p + "num_key_value_heads")
    head_dim, patch = _count(vision, p + "head_dim"), _count(vision, p + "patch_size")
    positions = _count(vision, p + "position_embedding_size")
    attention = (heads * head_dim * h, kv * head_dim * h, kv * head_dim * h, h * heads * head_dim)
    layer = (*attention, head_dim, head_dim, inter * h, inter * h, h * inter, h, h, h, h)
    tensors = [2 * positions * h, h * 3 * patch * patch]  # the table, a parameter of its own
    tensors += layer * _layers(vision, p + "num_hidden_layers")
    return tuple(tensors)


def llama4_tensors(vision: dict[str, Any]) -> tuple[int, ...]:
    """Llama4VisionModel: the class and position embeddings (one more position than patches),
    the unfolded patches' linear (no bias), the pre and post LayerNorms, the encoder layers
    (q/k/v/o projections with biases, fc1/fc2 with biases, two LayerNorms), and the pixel
    shuffle adapter's two linears (no biases)."""
    p = "vision_config."
    h, inter = _count(vision, p + "hidden_size"), _count(vision, p + "intermediate_size")
    channels = _count(vision, p + "num_channels")
    patch, image = _count(vision, p + "patch_size"), _count(vision, p + "image_size")
    positions = (image // patch) ** 2 + 1
    layer_norm = (h, h)
    layer = (*(h * h, h) * 4, inter * h, inter, h * inter, h, *layer_norm, *layer_norm)
    adapter_in = _count(vision, p + "projector_input_dim")
    adapter_out = _count(vision, p + "projector_output_dim")
    tensors = [h, positions * h, channels * patch * patch * h, *layer_norm, *layer_norm]
    tensors += layer * _layers(vision, p + "num_hidden_layers")
    tensors += [adapter_in * inter, adapter_out * adapter_out]
    return tuple(tensors)


def qwen3_5_tensors(vision: dict[str, Any]) -> tuple[int, ...]:
    """Qwen3_5VisionModel: the patch Conv3d (with bias), learned position embeddings, blocks of
    two LayerNorms, fused qkv and proj (biases), fc1/fc2 (biases), then the patch merger (its
    LayerNorm, fc1 over spatial_merge_size^2 patches, fc2 into out_hidden_size, biases): the
    merger is the tower's own projection, so the wrapper has no projector beside it."""
    p = "vision_config."
    h, inter = _count(vision, p + "hidden_size"), _count(vision, p + "intermediate_size")
    patch = _count(vision, p + "patch_size")
    volume = _count(vision, p + "in_channels") * _count(vision, p + "temporal_patch_size")
    merged = h * _count(vision, p + "spatial_merge_size") ** 2
    out = _count(vision, p + "out_hidden_size")
    layer = (h, h, h, h, 3 * h * h, 3 * h, h * h, h, inter * h, inter, h * inter, h)
    tensors = [h * volume * patch * patch, h, _count(vision, p + "num_position_embeddings") * h]
    tensors += layer * _layers(vision, p + "depth")
    tensors += [h, h, merged * merged, merged, out * merged, out]
    return tuple(tensors)


TOWERS: dict[str, Callable[[dict[str, Any]], tuple[int, ...]]] = {
    "qwen3_5": qwen3_5_tensors,
    "siglip": siglip_tensors,
    "pixtral": pixtral_tensors,
    "gemma4": gemma4_tensors,
    "llama4": llama4_tensors,
}


# ----------------------------------------------------------------------------- projectors


def gemma3_projector(
    config: dict[str, Any], vision: dict[str, Any], text_hidden: int
) -> tuple[int, ...]:
    """Gemma3MultiModalProjector: mm_input_projection_weight (vision x text hidden), then the
    soft-embedding RMSNorm's weight."""
    h = _count(vision, "vision_config.hidden_size")
    return (h * text_hidden, h)


def mistral3_projector(
    config: dict[str, Any], vision: dict[str, Any], text_hidden: int
) -> tuple[int, ...]:
    """Mistral3MultiModalProjector: an RMSNorm, the patch merger's linear over
    spatial_merge_size^2 patches, linear_1 (from the hidden size times the number of
    vision_feature_layer entries) and linear_2, with biases when multimodal_projector_bias."""
    h = _count(vision, "vision_config.hidden_size")
    merge = _count({"spatial_merge_size": 2, **_given(config)}, "spatial_merge_size")
    layers = _given(config).get("vision_feature_layer", -1)
    if isinstance(layers, list) and layers:
        feature_layers = len(layers)
    elif isinstance(layers, int) and not isinstance(layers, bool):
        feature_layers = 1
    else:
        raise _bad("vision_feature_layer", layers, "an integer or a non-empty list")
    bias = _flag(config, "multimodal_projector_bias", default=False)
    linear_1 = [text_hidden * h * feature_layers] + ([text_hidden] if bias else [])
    linear_2 = [text_hidden * text_hidden] + ([text_hidden] if bias else [])
    return (h, h * h * merge * merge, *linear_1, *linear_2)


def gemma4_embedder(
    config: dict[str, Any], vision: dict[str, Any], text_hidden: int
) -> tuple[int, ...]:
    """Gemma4MultimodalEmbedder (embed_vision): the projection into the text model's width (no
    bias; its pre-projection RMSNorm has no weight)."""
    return (text_hidden * _count(vision, "vision_config.hidden_size"),)


def _given(config: dict[str, Any]) -> dict[str, Any]:
    """The config's keys that are not null (null means the config class's default)."""
    return {k: v for k, v in config.items() if v is not None}


def llama4_projector(
    config: dict[str, Any], vision: dict[str, Any], text_hidden: int
) -> tuple[int, ...]:
    """Llama4MultiModalProjector: linear_1 from vision_output_dim to the text hidden size, no
    bias."""
    return (_count(vision, "vision_config.vision_output_dim") * text_hidden,)


PROJECTORS: dict[str, Callable[[dict[str, Any], dict[str, Any], int], tuple[int, ...]]] = {
    "gemma3": gemma3_projector,
    "mistral3": mistral3_projector,
    "gemma4": gemma4_embedder,
    "llama4": llama4_projector,
    "qwen3_5": lambda config, vision, text_hidden: (),
    "qwen3_5_moe": lambda config, vision, text_hidden: (),
}
