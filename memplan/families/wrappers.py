"""The multimodal wrappers memplan reads: config classes whose text_config holds a registry
family's config (Family.wrapped_by), as transformers' config class reads them, and the vision
tower and projector transformers builds beside the text model (memplan.catalog.vision_tower
counts their parameters). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Wrapper:
    """One multimodal `config.model_type`.

    default_text: text_config's model_type when it gives none (the config class's default).
    tower: the vision model transformers builds from vision_config. tower_model_types: the
        vision_config model_types the config class builds that tower for; empty when it builds
        it whatever vision_config says (Gemma3Config always makes a SiglipVisionConfig).
    default_vision: the vision_config the config class makes when the config gives none (on
        top of the tower config class's own defaults). without_vision_config "none": a config
        without vision_config builds no tower at all (Gemma4Config)."""

    model_type: str
    default_text: str
    tower: Literal["siglip", "pixtral", "gemma4", "llama4", "qwen3_5"]
    tower_model_types: tuple[str, ...] = ()
    default_vision: dict[str, Any] = field(default_factory=dict)
    without_vision_config: Literal["default", "none"] = "default"


WRAPPERS: dict[str, Wrapper] = {
    wrapper.model_type: wrapper
    for wrapper in (
        Wrapper(model_type="gemma3", default_text="gemma3_text", tower="siglip"),
        # its audio tower, where audio_config gives one, is not counted (config_notes says so)
        Wrapper(
            model_type="gemma4",
            default_text="gemma4_text",
            tower="gemma4",
            tower_model_types=("gemma4_vision",),
            without_vision_config="none",
        ),
        Wrapper(
            model_type="mistral3",
            default_text="mistral",
            tower="pixtral",
            tower_model_types=("pixtral",),
            default_vision={
                "intermediate_size": 4096,
                "hidden_size": 1024,
                "patch_size": 14,
                "image_size": 1540,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
            },
        ),
        # Qwen3_5Config renames a vision_config of model_type qwen3_5 to qwen3_5_vision
        Wrapper(
            model_type="qwen3_5",
            default_text="qwen3_5_text",
            tower="qwen3_5",
            tower_model_types=("qwen3_5_vision", "qwen3_5"),
        ),
        # Qwen3_5MoeVisionConfig: Qwen3.5's tower, its defaults and classes under another name
        Wrapper(
            model_type="qwen3_5_moe",
            default_text="qwen3_5_moe_text",
            tower="qwen3_5",
            tower_model_types=("qwen3_5_moe_vision", "qwen3_5_moe"),
        ),
        Wrapper(
            model_type="llama4",
            default_text="llama4_text",
            tower="llama4",
            tower_model_types=("llama4_vision_model",),
        ),
    )
}
