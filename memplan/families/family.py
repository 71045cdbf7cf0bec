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

    experts_key: the config key transformers' class reads (num_local_experts is the alias of
        num_experts and of n_routed_experts; num_experts is num_local_experts').
    expert_width_key: each expert's intermediate size.
    normalizes_by_default: whether the top-k weights are renormalized when the config has no
        norm_topk_prob (reads_norm_topk_prob False: whatever it says, as Qwen3.5-MoE's router).
        fp32_routing_weights: whether each routed row keeps its weight in fp32 (the router
        softmax's dtype) rather than the router logits' dtype.
    dense_layers_key: a key whose non-default value makes some layers dense (unsupported).
    first_dense_key: the config key giving how many leading layers have a dense MLP
        (DeepSeek-style first_k_dense_replace), read as ModelSpec.dense_layers.
    shared_experts_key: the config key giving how many shared experts (one gated MLP of
        expert width x that many) each MoE layer runs beside the routed ones.
    shared_expert_width_key: the config key giving the width of the one shared expert each MoE
        layer runs before the routed ones (Qwen3-Next, Qwen3.5-MoE), whose output is multiplied
        by sigmoid(shared_expert_gate(x)), a Linear(hidden, 1) registered after it.
    router: "softmax": the router's linear in the input's dtype, a softmax of all its logits
        in fp32, then the top k; "topk_softmax" (gpt-oss): the linear in the input's dtype, the
        top k of its logits, a softmax of those k in the logits' dtype; "sigmoid_fp32"
        (DeepSeek-style): the linear on fp32 copies of its input and weight, sigmoid scores
        plus an fp32 e_score_correction_bias buffer per MoE layer, group-limited top-k, the
        routing weights in the router logits' dtype (fp32, autocast's under autocast);
        "sigmoid_every_expert": Llama 4's, every token through every expert (bmm), its input
        times the sigmoid of its top-k router logits (0 for the other experts), beside a shared
        expert of the expert width; its experts are registered before its router.
    router_bias: the router linear has a bias. expert_biases: gate_up_proj and down_proj each
        have a per-expert bias. clamped_glu: gpt-oss's gate: gate and up interleaved in the
        gate_up output, both clamped to its limit, gate * sigmoid(alpha * gate) * (up + 1).
    dense_step_key: a key whose value other than 1 makes some layers dense (unsupported).
    moe_layers_key: a key listing the MoE layers; one it leaves out is dense (unsupported)."""

    experts_key: Literal["num_experts", "num_local_experts", "n_routed_experts"]
    expert_width_key: str
    normalizes_by_default: bool
    fp32_routing_weights: bool
    dense_layers_key: str | None = None
    first_dense_key: str | None = None
    shared_experts_key: str | None = None
    shared_expert_width_key: str | None = None
    reads_norm_topk_prob: bool = True
    router: Literal["softmax", "topk_softmax", "sigmoid_fp32", "sigmoid_every_expert"] = "softmax"
    router_bias: bool = False
    expert_biases: bool = False
    clamped_glu: bool = False
    dense_step_key: str = "decoder_sparse_step"
    moe_layers_key: str | None = None


@dataclass(frozen=True)
class Unmodelled:
    """A config key whose other values build what memplan does not model: spec_from_config
    refuses a value outside `modelled` with one line naming `what` it builds."""

    key: str
    modelled: tuple[Any, ...]
    what: str


@dataclass(frozen=True)
class ConfigRules:
    """How a config.json of the family reads: transformers' class defaults and the traits that
    are the family's rather than the config's.

    attention_bias: "config" (q/k/v/o follow attention_bias), "never", "qkv" (q/k/v always,
        o never), "qkv_config" (q/k/v follow attention_bias, o never) or "out_key" (q/k/v
        follow attention_bias, o attention_out_bias).
        windowed_layers: which layers slide when a window is given: "all", "all_if_enabled"
        (use_sliding_window), "from_max_window_layers", "pattern" (every
        sliding_window_pattern-th layer is full), "nope_if_enabled" (the layers without RoPE,
        with use_sliding_window), or "never" (the family's attention takes no window).
        reads_layer_types: whether the model reads config.layer_types
        (Mistral's and Ministral 3's slide every layer whatever it says); where it does, they
        say it for every rule. fused: one qkv_proj and one gate_up_proj. llama4_query_scale:
        attention multiplies the queries after RoPE by Llama 4's position-dependent factor
        (Ministral 3).
    nope_layers: some layers apply no RoPE: those no_rope_layers marks 0, else every
        no_rope_layer_interval-th layer (SmolLM3).
    nope_full_layers: where sliding_window is set, the full-attention layers apply no RoPE
        (EXAONE 4's global NoPE); without a window every layer rotates.
    multipliers: the model multiplies the embedding by embedding_multiplier and each branch
        output by residual_multiplier, and divides the logits by logits_scaling (Granite).
    residual_dropout_key: the config key of the dropout on the attention and MLP outputs before
        their residual adds (None: the family has none).
    qk_norm_scope: what q_norm and k_norm normalize: each head's vector (Qwen3, Gemma 3) or the
        whole q / k projection output before it is split into heads (OLMo 2/3).
    post_norm: no norm before attention and MLP; one on each branch's output before its residual
        add (OLMo 2/3), so the projections read the residual stream itself.
    rope_in_fp32: the rotary embedding returns fp32 cos/sin whatever the hidden states' dtype,
        and apply_rotary_pos_emb rotates in fp32 and casts q and k back to their own dtype.
    rope_per_layer_type: the model computes one cos/sin pair per attention layer type.
    qk_norm_key: the config key that switches the q/k norms on (GLM-4.5's use_qk_norm); None:
        the family's qk_norm decides.
    partial_rotary: RoPE rotates the first partial_rotary_factor of each head's dims (the
        factor in rope_parameters, else the config's top-level key).
    last_layer_full: the config class makes the last layer a full-attention one whatever
        layer_types or the pattern say (Gemma 4).
    global_layers: the full-attention layers take global_head_dim and, with attention_k_eq_v,
        num_global_key_value_heads and no v_proj (v is k_proj's output), or what the config's
        per_layer_config gives them (Gemma 4).
    v_norm: a scale-free RMSNorm on v beside q_norm and k_norm (Gemma 4).
    layer_scalar: each layer multiplies its output in place by a 1-element buffer (Gemma 4).
    keeps_last_kv_per_type: the last layer of each attention type stores its k and v in the
        model's shared_kv_states, which holds them until forward returns (Gemma 4).
    unmodelled: keys whose other values spec_from_config refuses.
    rope_half_tables: cos/sin are head_dim / 2 wide, one value per rotated pair, which the
        rotation applies to both halves of each head (gpt-oss).
    attention_sinks: each attention head has a learned sink logit (a `sinks` parameter) that
        eager attention concatenates to the scores before the softmax and drops after it
        (gpt-oss); attention_dropout must then be 0.
    llama4_attention: Llama 4's attention: RoPE as fp32 complex products with one complex64
        table, q and k cast back to their dtype; in the layers that rotate, an L2 norm of q and
        k without weight (use_qk_norm) and attention within chunks of attention_chunk_size (a
        mask at every sequence length); in the others, the queries times a position-dependent
        temperature (attn_temperature_tuning); eager attention's softmax in q's dtype.
    latent_attention: DeepSeek-V3's multi-head latent attention (q_lora_rank, kv_lora_rank,
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim): ModelSpec.kv_lora_rank and the rest;
        attention_dropout must be 0 and num_key_value_heads equal num_attention_heads.
    gated_deltanet: layer_types name "linear_attention" layers (else every
        full_attention_interval-th layer is full attention, the others linear): Qwen3.5's gated
        DeltaNet, q/k/v through a causal depthwise conv, the gated delta rule in chunks of 64
        (transformers' torch fallback), a gated RMSNorm before out_proj.
    fused_deltanet_projections: the gated DeltaNet's input projections are two, in_proj_qkvz
        and in_proj_ba, registered after the conv (Qwen3-Next), not in_proj_qkv, in_proj_z,
        in_proj_b and in_proj_a registered last (Qwen3.5).
    attention_output_gate: the full attention's q_proj is twice as wide; the second half's
        sigmoid multiplies the attention output before o_proj (Qwen3.5, Qwen3-Next).
    rope_per_batch_row: the rotary embedding builds cos/sin for every batch row (Qwen3.5's
        multimodal RoPE, three position grids per row)."""

    defaults: dict[str, Any]
    act_key: str = "hidden_act"
    attention_bias: Literal["config", "never", "qkv", "qkv_config", "out_key"] = "config"
    residual_dropout_key: str | None = None
    mlp_bias: bool = False  # whether the config's mlp_bias is read (otherwise no MLP bias)
    nope_layers: bool = False
    nope_full_layers: bool = False
    multipliers: bool = False
    windowed_layers: Literal[
        "all", "all_if_enabled", "from_max_window_layers", "pattern", "nope_if_enabled", "never"
    ] = "all"
    sliding_window_pattern: int | None = None
    reads_layer_types: bool = True
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "projection"] = "head"
    sandwich_norm: bool = False  # norms after attention and MLP as well as before
    post_norm: bool = False
    rope_in_fp32: bool = False
    rope_per_layer_type: bool = False
    rope_half_tables: bool = False
    attention_sinks: bool = False
    fused: bool = False
    llama4_query_scale: bool = False
    qk_norm_key: str | None = None
    partial_rotary: bool = False
    last_layer_full: bool = False
    global_layers: bool = False
    v_norm: bool = False
    layer_scalar: bool = False
    keeps_last_kv_per_type: bool = False
    unmodelled: tuple[Unmodelled, ...] = ()
    llama4_attention: bool = False
    latent_attention: bool = False
    gated_deltanet: bool = False
    fused_deltanet_projections: bool = False
    attention_output_gate: bool = False
    rope_per_batch_row: bool = False
    moe: MoeRules | None = None

    def __post_init__(self) -> None:
        if self.windowed_layers == "pattern" and self.sliding_window_pattern is None:
            raise ValueError("windowed_layers='pattern' needs a sliding_window_pattern")
        if self.post_norm and self.sandwich_norm:
            raise ValueError("post_norm and sandwich_norm place the norms differently; give one")
        if self.nope_layers and self.nope_full_layers:
            raise ValueError("nope_layers and nope_full_layers pick the NoPE layers; give one")
        if self.windowed_layers == "nope_if_enabled" and not self.nope_layers:
            raise ValueError("windowed_layers='nope_if_enabled' needs nope_layers")
        if self.qk_norm_key is not None and self.qk_norm:
            raise ValueError("qk_norm_key reads the q/k norms from the config; give no qk_norm")


@dataclass(frozen=True)
class Family:
    """Everything memplan knows of one `config.model_type`."""

    model_type: str
    config: ConfigRules
    patch: PatchSpec
    tiny_from: str  # the catalog entry whose config the tests shrink to a tiny model
    # model_types whose config holds this family's in a text_config (multimodal wrappers,
    # memplan.families.wrappers)
    wrapped_by: tuple[str, ...] = field(default=())
    # the first transformers release whose model class refuses attn_implementation="sdpa" and
    # builds the model with eager attention instead
    sdpa_refused_from: tuple[int, int] | None = None

    @property
    def gemma_norms(self) -> bool:
        """RMSNorms that multiply by the weight in fp32 and keep x * rstd (fp32) for the
        weight's gradient (Gemma's (1 + w), OLMo 2/3's w)."""
        return self.patch.norm.casting == "gemma"

    @property
    def norm_weight_copied(self) -> bool:
        """Gemma's RMSNorm multiplies by 1 + w.float(), a new fp32 tensor its product saves;
        OLMo's multiplies by the weight itself."""
        return self.gemma_norms and self.patch.norm.offset != 0.0

    @property
    def scaled_embedding(self) -> bool:
        """The token embedding multiplies its lookup by a scale (Gemma's sqrt(hidden))."""
        return self.patch.embedding.scaled_class is not None

    @property
    def patched_rope(self) -> bool:
        """Whether memplan's RoPE kernel applies: it runs inside the patched attention."""
        return bool(self.patch.attention.classes)

    def kernels(self, activation: str, dense_mlp: bool = True) -> tuple[str, ...]:
        """The memplan kernels that replace an op of this family, in KERNEL_NAMES order; RoPE
        where memplan patches the attention, and sink attention there where the family has
        sink logits; the GLU kernel where the family has a gated MLP
        class, some gated MLP runs (`dense_mlp`: a dense layer, or a shared expert beside the
        experts) and the activation has one."""
        found = {"rms_norm", "cross_entropy", "flce", "embedding"}
        if self.patched_rope:
            found.add("rope")
            if self.patch.attention.sinks_attr is not None:
                found.add("sink_attention")
        glu = GLU_KERNEL_BY_ACTIVATION.get(activation)
        if glu is not None and self.patch.mlp is not None and dense_mlp:
            found.add(glu)
        return tuple(k for k in KERNEL_NAMES if k in found)
