"""One model family, as data: how its config.json maps to a ModelSpec, what its MoE router keeps,
what memplan patches in it, and the catalog entry its tests shrink. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memplan.families.patch_spec import PatchSpec
from memplan.schema import GLU_KERNEL_BY_ACTIVATION, KERNEL_NAMES


@dataclass(frozen=True)
class MoeRules:
    """A sparse MoE block of transformers 5 (experts as 3-D parameters).

    experts_key: the config key transformers' class reads (the other of num_experts /
        num_local_experts is its alias). expert_width_key: each expert's intermediate size.
    normalizes_by_default: whether the top-k weights are renormalized when the config has no
        norm_topk_prob. fp32_routing_weights: whether each routed row keeps its weight in fp32
        (the router softmax's dtype) rather than the router logits' dtype.
    dense_layers_key: a key whose non-default value makes some layers dense (unsupported)."""

    experts_key: Literal["num_experts", "num_local_experts"]
    expert_width_key: str
    normalizes_by_default: bool
    fp32_routing_weights: bool
    dense_layers_key: str | None = None


@dataclass(frozen=True)
class ConfigRules:
    """How a config.json of the family reads: transformers' class defaults and the traits that
    are the family's rather than the config's.

    attention_bias: "config" (q/k/v/o follow attention_bias), "never", "qkv" (q/k/v always,
        o never) or "out_key" (q/k/v follow attention_bias, o attention_out_bias).
    nope_layers: some layers apply no RoPE: those no_rope_layers marks 0, else every
        no_rope_layer_interval-th layer (SmolLM3).
    multipliers: the model multiplies the embedding by embedding_multiplier and each branch
        output by residual_multiplier, and divides the logits by logits_scaling (Granite).
    residual_dropout_key: the config key of the dropout on the attention and MLP outputs before
        their residual adds (None: the family has none). windowed_layers: which layers slide
        when a window is given: "all", "all_if_enabled" (use_sliding_window),
        "from_max_window_layers", "pattern" (every sliding_window_pattern-th layer is full), or
        "nope_if_enabled" (the layers without RoPE, with use_sliding_window); layer_types, where
        the config gives them, say it for every rule.
        fused: one qkv_proj and one gate_up_proj."""

    defaults: dict[str, Any]
    act_key: str = "hidden_act"
    attention_bias: Literal["config", "never", "qkv", "out_key"] = "config"
    residual_dropout_key: str | None = None
    mlp_bias: bool = False  # whether the config's mlp_bias is read (otherwise no MLP bias)
    nope_layers: bool = False
    multipliers: bool = False
    windowed_layers: Literal[
        "all", "all_if_enabled", "from_max_window_layers", "pattern", "nope_if_enabled"
    ] = "all"
    sliding_window_pattern: int | None = None
    qk_norm: bool = False
    sandwich_norm: bool = False  # norms after attention and MLP as well as before
    fused: bool = False
    moe: MoeRules | None = None

    def __post_init__(self) -> None:
        if self.windowed_layers == "pattern" and self.sliding_window_pattern is None:
            raise ValueError("windowed_layers='pattern' needs a sliding_window_pattern")
        if self.windowed_layers == "nope_if_enabled" and not self.nope_layers:
            raise ValueError("windowed_layers='nope_if_enabled' needs nope_layers")


@dataclass(frozen=True)
class Family:
    """Everything memplan knows of one `config.model_type`."""

    model_type: str
    config: ConfigRules
    patch: PatchSpec
    tiny_from: str  # the catalog entry whose config the tests shrink to a tiny model
    # model_types whose config holds this family's in a text_config (multimodal wrappers)
    wrapped_by: tuple[str, ...] = field(default=())
    # the first transformers release whose model class refuses attn_implementation="sdpa" and
    # builds the model with eager attention instead
    sdpa_refused_from: tuple[int, int] | None = None

    @property
    def gemma_norms(self) -> bool:
        """RMSNorms that compute in fp32 with (1 + w) and keep x * rstd for w's gradient."""
        return self.patch.norm.casting == "gemma"

    def kernels(self, activation: str, dense_mlp: bool = True) -> tuple[str, ...]:
        """The memplan kernels that replace an op of this family, in KERNEL_NAMES order; the GLU
        kernel where the family has a gated MLP class, some layer is dense (`dense_mlp`: not a
        model whose every layer is a mixture of experts) and the activation has one."""
        found = {"rms_norm", "rope", "cross_entropy", "flce", "embedding"}
        glu = GLU_KERNEL_BY_ACTIVATION.get(activation)
        if glu is not None and self.patch.mlp is not None and dense_mlp:
            found.add(glu)
        return tuple(k for k in KERNEL_NAMES if k in found)
