"""What a raw config.json holds that the estimate does not count, or only guesses: one warning
line each. The estimate itself is made from the ModelSpec (config_to_spec); this module only
reads the config as the user gave it, so nothing here changes a prediction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.schema import ModelSpec

# The keys that fix a decoder's shape. A config without one of them gets transformers' class
# default, which is some checkpoint's size (LlamaConfig's are Llama-2-7B's), not the user's.
# vocab_size is left out: the multimodal Gemma 3 checkpoints leave it to the default, which is
# their tokenizer's.
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

# Sub-configs of a multimodal checkpoint, and what each adds to the text model.
_TOWERS = {"vision_config": "vision tower", "audio_config": "audio tower"}


def config_notes(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    """Warnings for `config` (a config.json as given) predicted as `spec`. A vision tower whose
    parameters memplan counts (spec.vision_tower_tensors) gets vision_tower_note instead, which
    says whether the setup counts it."""
    counted = ("vision_config",) if spec.vision_tower_tensors else ()
    towers = {k: v for k, v in _TOWERS.items() if k not in counted}
    notes = [*_quantization(config), *_towers(config, towers)]
    text = config.get("text_config")
    notes += _defaults(text if isinstance(text, Mapping) else config, spec)
    return notes


def _quantization(config: Mapping[str, Any]) -> list[str]:
    quant = config.get("quantization_config")
    if not quant:
        return []
    method, bits = _quant_method(quant) if isinstance(quant, Mapping) else ("unknown", None)
    smaller = (
        f"{bits}-bit weights take {bits}/16 of bf16's bytes"
        if bits
        else "quantized weights take fewer bytes"
    )
    return [
        f"the config has a quantization_config ({method}{f', {bits}-bit' if bits else ''}): "
        f"memplan predicts unquantized weights (in the --precision dtype), so it overstates "
        f"them ({smaller}); transformers trains quantized weights only through adapters (LoRA)"
    ]


def _quant_method(quant: Mapping[str, Any]) -> tuple[str, int | None]:
    method = str(quant.get("quant_method") or "unknown method")
    if quant.get("load_in_4bit"):
        return method, 4
    if quant.get("load_in_8bit"):
        return method, 8
    bits = quant.get("bits") or quant.get("w_bit")
    return method, bits if isinstance(bits, int) and not isinstance(bits, bool) else None


def vision_tower_note(spec: ModelSpec, counted: str | None, param_bytes: int) -> list[str]:
    """What the estimate does with the vision tower and projector of a multimodal config
    (`counted`: TrainSetup.count_vision_tower), with their parameter count and the bytes of
    their weights (`param_bytes` each); nothing for a text model."""
    params = spec.vision_tower_params
    if not params:
        return []
    tower = (
        f"its vision tower and multimodal projector ({params:,} parameters, "
        f"{params * param_bytes / 2**30:.2f} GiB of weights, from vision_config)"
    )
    head = f"the config is multimodal (model_type {spec.wrapper_model_type!r}): "
    images = "nor the image tokens they add to each sequence"
    if counted is None:
        return [
            f"{head}memplan predicts the text model alone; {tower} are not counted, {images} "
            "(--count-vision-tower frozen or trained counts them; count_vision_tower in Python)"
        ]
    what = "weights" if counted == "frozen" else "weights, gradients and optimizer states"
    return [
        f"{head}the estimate counts the {what} of {tower}, {counted}; not their activations, "
        f"{images}"
    ]


def _towers(config: Mapping[str, Any], towers: Mapping[str, str]) -> list[str]:
    notes = []
    for key, tower in towers.items():
        sub = config.get(key)
        if not isinstance(sub, Mapping):
            continue
        shape = [
            f"{sub[k]} {label}"
            for k, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"))
            if isinstance(sub.get(k), int)
        ]
        detail = f" ({', '.join(shape)})" if shape else ""
        notes.append(
            f"the config is multimodal (model_type {config.get('model_type')!r}): memplan "
            f"predicts the text model alone; the {tower}{detail}, its activations and the "
            "tokens it adds to each sequence are not counted"
        )
    return notes


def _defaults(config: Mapping[str, Any], spec: ModelSpec) -> list[str]:
    keys = list(_SHAPE_KEYS)
    # the experts' width is what the estimate uses (Qwen3.5-MoE's config has no dense width)
    if spec.num_experts and (
        spec.moe_intermediate_size != spec.intermediate_size or "intermediate_size" not in config
    ):
        keys[-1] = "moe_intermediate_size"
    missing = [k for k in keys if config.get(k) is None]
    if not missing:
        return []
    used = ", ".join(f"{k} {getattr(spec, k):,}" for k in missing)
    return [
        f"the config does not give {', '.join(missing)}: memplan uses transformers' defaults "
        f"for model_type {spec.model_type!r} ({used}), another model's sizes; give the "
        "checkpoint's own config.json"
    ]
