"""What memplan patches in a model family, as data: the PatchSpec a family entry holds.

A spec names the module classes of the family (by class name, as transformers defines them) and
the few facts that differ between families: how the RMSNorm casts, how q/k/v are projected,
where q/k norms sit, which attention options the family passes, the MLP layout and activation,
and what the causal-LM head adds to the loss. The generic forwards in
`memplan/patching/forwards.py` read these fields. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class NormSpec:
    """RMSNorm modules -> memplan.kernels.rms_norm.

    casting "llama": normalize in fp32, cast to the input dtype, multiply by the weight.
    casting "gemma": everything in fp32 with weight (offset + w), cast at the end.
    in_place_backward: the kernel may write dX into dY's buffer. Not where the norm's output
    gradient is also the residual's (Gemma 2/3 post-norms feed a residual add directly).
    weight_cast: the product takes weight.float(), a copy of a weight that is not fp32 (Gemma 4).
    rstd_by_pow: the inverse RMS is torch.pow(mean + eps, -0.5), which keeps its input beside
        the product keeping its output (Gemma 4).
    scale_flag_attr: module attribute saying whether the norm has a weight at all (Gemma 4's
        with_scale, false in v_norm): the kernel patches only those that do."""

    classes: tuple[str, ...]
    eps_attr: str = "variance_epsilon"
    casting: Literal["llama", "gemma"] = "llama"
    offset: float = 0.0
    in_place_backward: bool = True
    weight_cast: bool = False
    rstd_by_pow: bool = False
    scale_flag_attr: str | None = None


@dataclass(frozen=True)
class GatedNormSpec:
    """Gated RMSNorm modules, forward(hidden_states, gate) = weight x norm(x) x silu(gate) in
    Hugging Face's casting (the gated DeltaNet's norm before out_proj) ->
    memplan.kernels.gated_rms_norm, switched on with the rms_norm kernel."""

    classes: tuple[str, ...]
    eps_attr: str = "variance_epsilon"


@dataclass(frozen=True)
class AttentionSpec:
    """Attention modules whose forward is replaced by the one generic attention forward that
    applies memplan's RoPE kernel and then calls transformers' attention interface.

    qkv: "separate" (q_proj, k_proj, v_proj) or "fused" (one qkv_proj, phi3).
    qk_norm: RMSNorm on q and k (q_norm, k_norm), before RoPE.
    qk_norm_flag_attr: module attribute saying whether the module has them (GLM-4.5's
        use_qk_norm, from the config); None: every module of the family has them.
    qk_norm_scope: "head": each head's vector, after the split into heads (Qwen3, Gemma 3);
        "projection": the whole q / k projection output, before the split (OLMo 2/3).
    sliding_window: where the family reads the window it passes to the interface: the module's
        `sliding_window` attribute, the config's, or nowhere.
    softcap_attr: module attribute holding the attention-logit softcap (Gemma 2), passed as
        `softcap=`.
    query_scale: "llama4": after RoPE the queries are multiplied by the family's
        get_llama_4_attn_scale of the position ids (Ministral 3), which the attention then
        takes instead of them.
    output_dropout_attr: module attribute holding the dropout probability applied to o_proj's
        output in training (seed_oss's residual_dropout).
    rope_flag_attr: module attribute saying whether the layer rotates q and k at all (SmolLM3's
        use_rope, false in its NoPE layers); None: every layer does.
    sliding_flag_attr: module attribute saying whether the layer slides (EXAONE 4's is_sliding,
        beside a window set on every layer): the window is passed only where it is true, and
        where the module has a window only those layers rotate q and k; None: no such flag.
    v_norm: Gemma 4's attention: q_norm, k_norm and a scale-free v_norm on each head (before the
        heads move to dim 1, RoPE with unsqueeze_dim=2), and v is k_proj's output where the
        module has no v_proj (attention_k_eq_v).
    sinks_attr: module attribute holding the per-head sink logits, passed to the interface as
        `s_aux=` (gpt-oss); None: the family has none.
    half_rope_tables: cos/sin are head_dim / 2 wide and rotate the whole head (gpt-oss), not
        the first cos-width dims of it (partial rotary)."""

    classes: tuple[str, ...]
    qkv: Literal["separate", "fused"] = "separate"
    qk_norm: bool = False
    qk_norm_flag_attr: str | None = None
    qk_norm_scope: Literal["head", "projection"] = "head"
    sliding_window: Literal["module", "config"] | None = None
    softcap_attr: str | None = None
    query_scale: Literal["llama4"] | None = None
    output_dropout_attr: str | None = None
    rope_flag_attr: str | None = None
    sliding_flag_attr: str | None = None
    v_norm: bool = False
    sinks_attr: str | None = None
    half_rope_tables: bool = False


@dataclass(frozen=True)
class MlpSpec:
    """Gated MLP modules -> swiglu or geglu, picked by the config's activation name.

    fused_gate_up: one gate_up_proj whose output halves are (gate, up) (phi3).
    output_dropout_attr: module attribute holding the dropout probability applied to down_proj's
        output in training (seed_oss's residual_dropout)."""

    classes: tuple[str, ...]
    activation_config_attr: str = "hidden_act"
    fused_gate_up: bool = False
    output_dropout_attr: str | None = None


@dataclass(frozen=True)
class CausalLMSpec:
    """The *ForCausalLM module whose forward routes the training loss to FLCE (or the
    cross-entropy kernel).

    final_logit_softcapping: the family caps the logits with config.final_logit_softcapping.
    moe_aux_loss: the family adds router_aux_loss_coef x the load-balancing loss (MoE).
    logits_scaling: the family divides the logits by config.logits_scaling (Granite); the
        patched loss divides the last hidden states instead, before lm_head (one hidden-sized
        tensor rather than a logits-sized one; the same values where the divisor is a power of
        two)."""

    classes: tuple[str, ...]
    base_model_attr: str = "model"
    final_logit_softcapping: bool = False
    moe_aux_loss: bool = False
    logits_scaling: bool = False


@dataclass(frozen=True)
class EmbeddingSpec:
    """The token embedding -> memplan.kernels.embedding: an nn.Embedding itself, or the family's
    subclass `scaled_class` whose forward multiplies the lookup by its `scale_attr` (Gemma)."""

    scaled_class: str | None = None
    scale_attr: str = "embed_scale"


@dataclass(frozen=True)
class DecoderLayerSpec:
    """Pre-norm decoder layers (input_layernorm, self_attn, residual add, post_attention_layernorm,
    mlp, residual add), whose forward is replaced with patched norms: each residual add runs in
    the norm that follows it (the next layer's input_layernorm, or the model's final norm, for
    the layer's last add), and a norm's output reaches each projection that reads it as its own
    view, so their gradients are summed in the norm's backward instead of by autograd.

    branch_dropouts: dropout modules on the attention and MLP outputs before their adds (phi3).
    final_norm_attr: the base model's norm after the last layer.
    residual_multiplier_attr: the layer attribute both branch outputs are multiplied by before
        their adds (Granite's residual_multiplier).
    mlp_returns_router_scores: the MLP returns (hidden_states, router_scores) and the layer adds
        the first (gpt-oss)."""

    classes: tuple[str, ...]
    branch_dropouts: tuple[str, str] | None = None
    final_norm_attr: str = "norm"
    residual_multiplier_attr: str | None = None
    mlp_returns_router_scores: bool = False


@dataclass(frozen=True)
class PatchSpec:
    model_type: str
    norm: NormSpec
    attention: AttentionSpec
    causal_lm: CausalLMSpec
    mlp: MlpSpec | None = None
    # None: the family's layers keep their forward. Gemma 2/3 put a norm on each branch's output
    # before the add as well; OLMo 2/3 only there (post-norm): no residual add feeds a norm of
    # the layer, so there is nothing to fuse, and the norms' dY is the residual's gradient too.
    decoder_layer: DecoderLayerSpec | None = None
    embedding: EmbeddingSpec = field(default=EmbeddingSpec())
    gated_norm: GatedNormSpec | None = None
    notes: tuple[str, ...] = field(default=())
