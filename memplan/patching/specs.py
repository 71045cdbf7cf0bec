"""What memplan patches in each model family, as data: one PatchSpec per `config.model_type`.

A spec names the module classes of the family (by class name, as transformers defines them) and
the few facts that differ between families: how the RMSNorm casts, how q/k/v are projected,
where q/k norms sit, which attention options the family passes, the MLP layout and activation,
and what the causal-LM head adds to the loss. The generic forwards in `forwards.py` read these
fields; adding a family is adding a spec here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class NormSpec:
    """RMSNorm modules -> memplan.kernels.rms_norm.

    casting "llama": normalize in fp32, cast to the input dtype, multiply by the weight.
    casting "gemma": everything in fp32 with weight (offset + w), cast at the end.
    in_place_backward: the kernel may write dX into dY's buffer. Not where the norm's output
    gradient is also the residual's (Gemma 2/3 post-norms feed a residual add directly)."""

    classes: tuple[str, ...]
    eps_attr: str = "variance_epsilon"
    casting: Literal["llama", "gemma"] = "llama"
    offset: float = 0.0
    in_place_backward: bool = True


@dataclass(frozen=True)
class AttentionSpec:
    """Attention modules whose forward is replaced by the one generic attention forward that
    applies memplan's RoPE kernel and then calls transformers' attention interface.

    qkv: "separate" (q_proj, k_proj, v_proj) or "fused" (one qkv_proj, phi3).
    qk_norm: per-head RMSNorm on q and k (q_norm, k_norm; Qwen3, Gemma 3).
    sliding_window: where the family reads the window it passes to the interface: the module's
        `sliding_window` attribute, the config's, or nowhere.
    softcap_attr: module attribute holding the attention-logit softcap (Gemma 2), passed as
        `softcap=`."""

    classes: tuple[str, ...]
    qkv: Literal["separate", "fused"] = "separate"
    qk_norm: bool = False
    sliding_window: Literal["module", "config"] | None = None
    softcap_attr: str | None = None


@dataclass(frozen=True)
class MlpSpec:
    """Gated MLP modules -> swiglu or geglu, picked by the config's activation name.

    fused_gate_up: one gate_up_proj whose output halves are (gate, up) (phi3)."""

    classes: tuple[str, ...]
    activation_config_attr: str = "hidden_act"
    fused_gate_up: bool = False


@dataclass(frozen=True)
class CausalLMSpec:
    """The *ForCausalLM module whose forward routes the training loss to FLCE (or the
    cross-entropy kernel).

    final_logit_softcapping: the family caps the logits with config.final_logit_softcapping.
    moe_aux_loss: the family adds router_aux_loss_coef x the load-balancing loss (MoE)."""

    classes: tuple[str, ...]
    base_model_attr: str = "model"
    final_logit_softcapping: bool = False
    moe_aux_loss: bool = False


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
    final_norm_attr: the base model's norm after the last layer."""

    classes: tuple[str, ...]
    branch_dropouts: tuple[str, str] | None = None
    final_norm_attr: str = "norm"


@dataclass(frozen=True)
class PatchSpec:
    model_type: str
    norm: NormSpec
    attention: AttentionSpec
    causal_lm: CausalLMSpec
    mlp: MlpSpec | None = None
    # None: the family's layers keep their forward (Gemma 2/3 put norms after attention and MLP)
    decoder_layer: DecoderLayerSpec | None = None
    embedding: EmbeddingSpec = field(default=EmbeddingSpec())
    notes: tuple[str, ...] = field(default=())


def _classes(prefix: str, *suffixes: str) -> tuple[str, ...]:
    return tuple(prefix + suffix for suffix in suffixes)


def _llama_like(
    model_type: str,
    prefix: str,
    *,
    sliding_window: Literal["module", "config"] | None = None,
    qk_norm: bool = False,
) -> PatchSpec:
    return PatchSpec(
        model_type=model_type,
        norm=NormSpec(classes=_classes(prefix, "RMSNorm")),
        attention=AttentionSpec(
            classes=_classes(prefix, "Attention"), qk_norm=qk_norm, sliding_window=sliding_window
        ),
        mlp=MlpSpec(classes=_classes(prefix, "MLP")),
        causal_lm=CausalLMSpec(classes=_classes(prefix, "ForCausalLM")),
        decoder_layer=DecoderLayerSpec(classes=_classes(prefix, "DecoderLayer")),
    )


def _gemma_norm(prefix: str, *, in_place_backward: bool) -> NormSpec:
    return NormSpec(
        classes=_classes(prefix, "RMSNorm"),
        eps_attr="eps",
        casting="gemma",
        offset=1.0,
        in_place_backward=in_place_backward,
    )


SPECS: dict[str, PatchSpec] = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral", sliding_window="config"),
        _llama_like("qwen2", "Qwen2", sliding_window="module"),
        _llama_like("qwen3", "Qwen3", sliding_window="module", qk_norm=True),
        PatchSpec(
            model_type="gemma",
            norm=_gemma_norm("Gemma", in_place_backward=True),
            attention=AttentionSpec(classes=("GemmaAttention",)),
            mlp=MlpSpec(classes=("GemmaMLP",)),
            causal_lm=CausalLMSpec(classes=("GemmaForCausalLM",)),
            embedding=EmbeddingSpec(scaled_class="GemmaTextScaledWordEmbedding"),
            decoder_layer=DecoderLayerSpec(classes=("GemmaDecoderLayer",)),
        ),
        PatchSpec(
            model_type="gemma2",
            norm=_gemma_norm("Gemma2", in_place_backward=False),
            attention=AttentionSpec(
                classes=("Gemma2Attention",),
                sliding_window="module",
                softcap_attr="attn_logit_softcapping",
            ),
            mlp=MlpSpec(classes=("Gemma2MLP",), activation_config_attr="hidden_activation"),
            causal_lm=CausalLMSpec(classes=("Gemma2ForCausalLM",), final_logit_softcapping=True),
            embedding=EmbeddingSpec(scaled_class="Gemma2TextScaledWordEmbedding"),
        ),
        PatchSpec(
            model_type="gemma3_text",
            norm=_gemma_norm("Gemma3", in_place_backward=False),
            attention=AttentionSpec(
                classes=("Gemma3Attention",),
                qk_norm=True,
                sliding_window="module",
            ),
            mlp=MlpSpec(classes=("Gemma3MLP",), activation_config_attr="hidden_activation"),
            causal_lm=CausalLMSpec(classes=("Gemma3ForCausalLM",), final_logit_softcapping=True),
            embedding=EmbeddingSpec(scaled_class="Gemma3TextScaledWordEmbedding"),
        ),
        PatchSpec(
            model_type="phi3",
            norm=NormSpec(classes=("Phi3RMSNorm",)),
            attention=AttentionSpec(
                classes=("Phi3Attention",), qkv="fused", sliding_window="config"
            ),
            mlp=MlpSpec(classes=("Phi3MLP",), fused_gate_up=True),
            causal_lm=CausalLMSpec(classes=("Phi3ForCausalLM",)),
            decoder_layer=DecoderLayerSpec(
                classes=("Phi3DecoderLayer",),
                branch_dropouts=("resid_attn_dropout", "resid_mlp_dropout"),
            ),
        ),
        PatchSpec(
            model_type="mixtral",
            norm=NormSpec(classes=("MixtralRMSNorm",)),
            attention=AttentionSpec(classes=("MixtralAttention",), sliding_window="config"),
            causal_lm=CausalLMSpec(classes=("MixtralForCausalLM",), moe_aux_loss=True),
            decoder_layer=DecoderLayerSpec(classes=("MixtralDecoderLayer",)),
            notes=("the experts (3-D fused weights) keep transformers' implementation",),
        ),
        PatchSpec(
            model_type="qwen3_moe",
            norm=NormSpec(classes=("Qwen3MoeRMSNorm",)),
            attention=AttentionSpec(
                classes=("Qwen3MoeAttention",), qk_norm=True, sliding_window="module"
            ),
            # Only the dense layers (config.mlp_only_layers) have a Qwen3MoeMLP.
            mlp=MlpSpec(classes=("Qwen3MoeMLP",)),
            causal_lm=CausalLMSpec(classes=("Qwen3MoeForCausalLM",), moe_aux_loss=True),
            decoder_layer=DecoderLayerSpec(classes=("Qwen3MoeDecoderLayer",)),
            notes=("the experts (3-D fused weights) keep transformers' implementation",),
        ),
    )
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(SPECS)
