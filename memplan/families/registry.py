"""The families memplan knows, one entry per `config.model_type`: adding a family is adding an
entry here (and its catalog configs and tests). Catalog, estimator, advisor and patcher read
these entries and nothing else about a family."""

from __future__ import annotations

from typing import Any, Literal

from memplan.families.family import ConfigRules, Family, MoeRules, Unmodelled
from memplan.families.patch_spec import (
    AttentionSpec,
    CausalLMSpec,
    DecoderLayerSpec,
    EmbeddingSpec,
    GatedNormSpec,
    MlpSpec,
    NormSpec,
    PatchSpec,
)


def _classes(prefix: str, *suffixes: str) -> tuple[str, ...]:
    return tuple(prefix + suffix for suffix in suffixes)


def _llama_like_patch(
    model_type: str,
    prefix: str,
    *,
    sliding_window: Literal["module", "config"] | None = None,
    qk_norm: bool = False,
    query_scale: Literal["llama4"] | None = None,
) -> PatchSpec:
    return PatchSpec(
        model_type=model_type,
        norm=NormSpec(classes=_classes(prefix, "RMSNorm")),
        attention=AttentionSpec(
            classes=_classes(prefix, "Attention"),
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            query_scale=query_scale,
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


# MistralConfig's and MixtralConfig's shared defaults (Mistral-7B's sizes).
_MISTRAL_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
}
_EXPERTS_KEPT = ("the experts (3-D fused weights) keep transformers' implementation",)
# What transformers' Qwen3.5 and Qwen3-Next config classes default to for their gated DeltaNet
# layers and the output-gated full attention beside them.
_GATED_DELTANET_DEFAULTS = {
    "num_attention_heads": 16,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
_GATED_DELTANET_RULES: dict[str, Any] = {
    "qk_norm": True,
    "windowed_layers": "never",
    "reads_layer_types": False,
    "partial_rotary": True,
    "gated_deltanet": True,
    "attention_output_gate": True,
}
_GATED_DELTANET_NOTES = (
    "the decoder layers keep their forward: each runs a gated DeltaNet or a full attention",
    "the gated DeltaNet runs transformers' torch fallbacks (chunked gated delta rule, causal "
    "conv1d in torch), or flash-linear-attention's rule and causal-conv1d's conv where they "
    "import (deltanet_kernels, deltanet_conv)",
)
# DeepSeek-style MoE layers (GLM-4.5, DeepSeek-V3): an fp32 sigmoid router with an expert-bias
# buffer and group-limited top-k, shared experts beside the routed ones, the first layers dense.
_DEEPSEEK_MOE = MoeRules(
    experts_key="n_routed_experts",
    expert_width_key="moe_intermediate_size",
    normalizes_by_default=True,
    fp32_routing_weights=True,
    first_dense_key="first_k_dense_replace",
    shared_experts_key="n_shared_experts",
    router="sigmoid_fp32",
)

# Olmo2Config's and Olmo3Config's shared defaults (OLMo 7B's sizes).
_OLMO_7B = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
}
_POST_NORM_KEPT = (
    "post-norm decoder layers keep their forward: no residual add feeds a norm to fuse it into",
)


# Gemma4TextConfig's values that build what memplan does not model.
_GEMMA4_UNMODELLED = (
    Unmodelled("hidden_size_per_layer_input", (0,), "per-layer embeddings into every layer"),
    Unmodelled("num_kv_shared_layers", (0,), "layers that reuse an earlier layer's keys/values"),
    Unmodelled("enable_moe_block", (False,), "a mixture-of-experts block beside the MLP"),
    Unmodelled("use_bidirectional_attention", (None, "vision"), "bidirectional text attention"),
)


def _olmo_patch(
    model_type: str, prefix: str, *, sliding_window: Literal["module"] | None = None
) -> PatchSpec:
    """OLMo 2/3: RMSNorms that multiply by w in fp32 (Gemma casting, no offset), whose output
    gradient after attention and the MLP is the residual's too; q/k norms over the whole
    projection; post-norm layers left as they are."""
    return PatchSpec(
        model_type=model_type,
        norm=NormSpec(
            classes=_classes(prefix, "RMSNorm"), casting="gemma", in_place_backward=False
        ),
        attention=AttentionSpec(
            classes=_classes(prefix, "Attention"),
            qk_norm=True,
            qk_norm_scope="projection",
            sliding_window=sliding_window,
        ),
        mlp=MlpSpec(classes=_classes(prefix, "MLP")),
        causal_lm=CausalLMSpec(classes=_classes(prefix, "ForCausalLM")),
        notes=_POST_NORM_KEPT,
    )


def _olmo_rules(**rules: Any) -> ConfigRules:
    return ConfigRules(
        qk_norm=True,
        qk_norm_scope="projection",
        post_norm=True,
        rope_in_fp32=True,
        **rules,
    )


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family(
            model_type="llama",
            config=ConfigRules(
                defaults={
                    "vocab_size": 32000,
                    "hidden_size": 4096,
                    "intermediate_size": 11008,
                    "num_hidden_layers": 32,
                    "num_attention_heads": 32,
                    "max_position_embeddings": 2048,
                },
                mlp_bias=True,
            ),
            patch=_llama_like_patch("llama", "Llama"),
            tiny_from="llama-3.2-1b",
        ),
        Family(
            model_type="mistral",
            config=ConfigRules(
                defaults={**_MISTRAL_7B, "sliding_window": 4096},
                attention_bias="never",
                reads_layer_types=False,
            ),
            patch=_llama_like_patch("mistral", "Mistral", sliding_window="config"),
            tiny_from="mistral-7b-v0.3",
            wrapped_by=("mistral3",),  # Mistral Small 3.1 and 3.2
        ),
        Family(
            model_type="ministral3",
            config=ConfigRules(
                defaults={
                    "vocab_size": 131072,
                    "hidden_size": 4096,
                    "intermediate_size": 14336,
                    "num_hidden_layers": 34,
                    "num_attention_heads": 32,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 262144,
                },
                attention_bias="never",
                reads_layer_types=False,
                llama4_query_scale=True,
            ),
            patch=_llama_like_patch(
                "ministral3", "Ministral3", sliding_window="config", query_scale="llama4"
            ),
            tiny_from="ministral-3-8b",
            wrapped_by=("mistral3",),  # the Ministral 3 checkpoints
        ),
        Family(
            model_type="mixtral",
            config=ConfigRules(
                defaults={**_MISTRAL_7B, "num_local_experts": 8, "num_experts_per_tok": 2},
                attention_bias="never",
                moe=MoeRules(
                    experts_key="num_local_experts",
                    expert_width_key="intermediate_size",
                    normalizes_by_default=True,
                    fp32_routing_weights=True,
                ),
            ),
            patch=PatchSpec(
                model_type="mixtral",
                norm=NormSpec(classes=("MixtralRMSNorm",)),
                attention=AttentionSpec(classes=("MixtralAttention",), sliding_window="config"),
                causal_lm=CausalLMSpec(classes=("MixtralForCausalLM",), moe_aux_loss=True),
                decoder_layer=DecoderLayerSpec(classes=("MixtralDecoderLayer",)),
                notes=_EXPERTS_KEPT,
            ),
            tiny_from="mixtral-8x7b",
        ),
        Family(
            model_type="glm4_moe",
            config=ConfigRules(
                defaults={
                    "vocab_size": 151552,
                    "hidden_size": 4096,
                    "intermediate_size": 10944,
                    "num_hidden_layers": 46,
                    "num_attention_heads": 96,
                    "num_key_value_heads": 8,
                    "max_position_embeddings": 131072,
                    "n_routed_experts": 128,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 1408,
                    "n_shared_experts": 1,
                    "n_group": 1,
                    "topk_group": 1,
                    "first_k_dense_replace": 1,
                    "use_qk_norm": False,
                    "partial_rotary_factor": 0.5,
                },
                attention_bias="qkv_config",
                windowed_layers="never",
                reads_layer_types=False,
                qk_norm_key="use_qk_norm",
                partial_rotary=True,
                moe=_DEEPSEEK_MOE,
            ),
            patch=PatchSpec(
                model_type="glm4_moe",
                norm=NormSpec(classes=("Glm4MoeRMSNorm",)),
                attention=AttentionSpec(
                    classes=("Glm4MoeAttention",), qk_norm=True, qk_norm_flag_attr="use_qk_norm"
                ),
                # The dense layers' MLP and each MoE layer's shared experts.
                mlp=MlpSpec(classes=("Glm4MoeMLP",)),
                causal_lm=CausalLMSpec(classes=("Glm4MoeForCausalLM",)),
                decoder_layer=DecoderLayerSpec(classes=("Glm4MoeDecoderLayer",)),
                notes=_EXPERTS_KEPT,
            ),
            tiny_from="glm-4.5-air",
        ),
        Family(
            model_type="deepseek_v3",
            config=ConfigRules(
                defaults={
                    "vocab_size": 129280,
                    "hidden_size": 7168,
                    "intermediate_size": 18432,
                    "num_hidden_layers": 61,
                    "num_attention_heads": 128,
                    "max_position_embeddings": 4096,
                    "n_routed_experts": 256,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048,
                    "n_shared_experts": 1,
                    "n_group": 8,
                    "topk_group": 4,
                    "first_k_dense_replace": 3,
                    "q_lora_rank": 1536,
                    "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64,
                    "v_head_dim": 128,
                },
                windowed_layers="never",
                reads_layer_types=False,
                latent_attention=True,
                moe=_DEEPSEEK_MOE,
            ),
            patch=PatchSpec(
                model_type="deepseek_v3",
                # the decoder layers' norms, and q_a_layernorm and kv_a_layernorm in attention
                norm=NormSpec(classes=("DeepseekV3RMSNorm",)),
                # memplan's attention takes q, k and v projections: latent attention keeps
                # transformers' forward, RoPE included
                attention=AttentionSpec(classes=()),
                # the dense layers' MLP and each MoE layer's shared experts
                mlp=MlpSpec(classes=("DeepseekV3MLP",)),
                causal_lm=CausalLMSpec(classes=("DeepseekV3ForCausalLM",)),
                decoder_layer=DecoderLayerSpec(classes=("DeepseekV3DecoderLayer",)),
                notes=(
                    "the attention keeps its forward: latent attention (q and k from low-rank "
                    "latents, a shared rotated key) does not fit memplan's attention and RoPE",
                    *_EXPERTS_KEPT,
                ),
            ),
            tiny_from="deepseek-v3",
        ),
        Family(
            model_type="qwen2",
            config=ConfigRules(
                defaults={
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
                attention_bias="qkv",
                windowed_layers="from_max_window_layers",
            ),
            patch=_llama_like_patch("qwen2", "Qwen2", sliding_window="module"),
            tiny_from="qwen2.5-0.5b",
        ),
        Family(
            model_type="qwen3",
            config=ConfigRules(
                defaults={
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
                qk_norm=True,
                windowed_layers="from_max_window_layers",
            ),
            patch=_llama_like_patch("qwen3", "Qwen3", sliding_window="module", qk_norm=True),
            tiny_from="qwen3-0.6b",
        ),
        Family(
            model_type="qwen3_moe",
            config=ConfigRules(
                defaults={
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
                qk_norm=True,
                windowed_layers="all_if_enabled",
                moe=MoeRules(
                    experts_key="num_experts",
                    expert_width_key="moe_intermediate_size",
                    normalizes_by_default=False,
                    fp32_routing_weights=False,
                    dense_layers_key="mlp_only_layers",
                ),
            ),
            patch=PatchSpec(
                model_type="qwen3_moe",
                norm=NormSpec(classes=("Qwen3MoeRMSNorm",)),
                attention=AttentionSpec(
                    classes=("Qwen3MoeAttention",), qk_norm=True, sliding_window="module"
                ),
                # Only the dense layers (config.mlp_only_layers) have a Qwen3MoeMLP.
                mlp=MlpSpec(classes=("Qwen3MoeMLP",)),
                causal_lm=CausalLMSpec(classes=("Qwen3MoeForCausalLM",), moe_aux_loss=True),
                decoder_layer=DecoderLayerSpec(classes=("Qwen3MoeDecoderLayer",)),
                notes=_EXPERTS_KEPT,
            ),
            tiny_from="qwen3-30b-a3b",
        ),
        Family(
            model_type="gemma",
            config=ConfigRules(
                defaults={
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
            ),
            patch=PatchSpec(
                model_type="gemma",
                norm=_gemma_norm("Gemma", in_place_backward=True),
                attention=AttentionSpec(classes=("GemmaAttention",)),
                mlp=MlpSpec(classes=("GemmaMLP",)),
                causal_lm=CausalLMSpec(classes=("GemmaForCausalLM",)),
                embedding=EmbeddingSpec(scaled_class="GemmaTextScaledWordEmbedding"),
                decoder_layer=DecoderLayerSpec(classes=("GemmaDecoderLayer",)),
            ),
            tiny_from="gemma-2b",
        ),
        Family(
            model_type="gemma2",
            config=ConfigRules(
                defaults={
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
                act_key="hidden_activation",
                sandwich_norm=True,
                windowed_layers="pattern",
                sliding_window_pattern=2,
            ),
            patch=PatchSpec(
                model_type="gemma2",
                norm=_gemma_norm("Gemma2", in_place_backward=False),
                attention=AttentionSpec(
                    classes=("Gemma2Attention",),
                    sliding_window="module",
                    softcap_attr="attn_logit_softcapping",
                ),
                mlp=MlpSpec(classes=("Gemma2MLP",), activation_config_attr="hidden_activation"),
                causal_lm=CausalLMSpec(
                    classes=("Gemma2ForCausalLM",), final_logit_softcapping=True
                ),
                embedding=EmbeddingSpec(scaled_class="Gemma2TextScaledWordEmbedding"),
            ),
            tiny_from="gemma-2-2b",
            sdpa_refused_from=(5, 21),  # SDPA cannot softcap the attention logits
        ),
        Family(
            model_type="gemma3_text",
            config=ConfigRules(
                defaults={
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
                act_key="hidden_activation",
                qk_norm=True,
                sandwich_norm=True,
                windowed_layers="pattern",
                sliding_window_pattern=6,
                rope_per_layer_type=True,  # rotary_emb(x, position_ids, layer_type)
            ),
            patch=PatchSpec(
                model_type="gemma3_text",
                norm=_gemma_norm("Gemma3", in_place_backward=False),
                attention=AttentionSpec(
                    classes=("Gemma3Attention",),
                    qk_norm=True,
                    sliding_window="module",
                ),
                mlp=MlpSpec(classes=("Gemma3MLP",), activation_config_attr="hidden_activation"),
                causal_lm=CausalLMSpec(
                    classes=("Gemma3ForCausalLM",), final_logit_softcapping=True
                ),
                embedding=EmbeddingSpec(scaled_class="Gemma3TextScaledWordEmbedding"),
            ),
            tiny_from="gemma-3-1b",
            wrapped_by=("gemma3",),
        ),
        Family(
            model_type="gemma4_text",
            config=ConfigRules(
                defaults={
                    "vocab_size": 262144,
                    "hidden_size": 2304,
                    "intermediate_size": 9216,
                    "num_hidden_layers": 30,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 4,
                    "head_dim": 256,
                    "max_position_embeddings": 131072,
                    "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": 512,
                    # popped by Gemma4TextConfig, 512 unless given
                    "global_head_dim": 512,
                    "attention_k_eq_v": False,
                    "hidden_size_per_layer_input": 256,
                    "num_kv_shared_layers": 0,
                    "enable_moe_block": False,
                },
                act_key="hidden_activation",
                qk_norm=True,
                sandwich_norm=True,
                windowed_layers="pattern",
                sliding_window_pattern=6,
                rope_per_layer_type=True,
                last_layer_full=True,
                global_layers=True,
                v_norm=True,
                layer_scalar=True,
                keeps_last_kv_per_type=True,
                unmodelled=_GEMMA4_UNMODELLED,
            ),
            patch=PatchSpec(
                model_type="gemma4_text",
                norm=NormSpec(
                    classes=("Gemma4RMSNorm",),
                    eps_attr="eps",
                    casting="gemma",
                    in_place_backward=False,
                    weight_cast=True,
                    rstd_by_pow=True,
                    scale_flag_attr="with_scale",
                ),
                attention=AttentionSpec(
                    classes=("Gemma4TextAttention",),
                    qk_norm=True,
                    sliding_window="module",
                    v_norm=True,
                ),
                mlp=MlpSpec(classes=("Gemma4TextMLP",), activation_config_attr="hidden_activation"),
                causal_lm=CausalLMSpec(
                    classes=("Gemma4ForCausalLM",), final_logit_softcapping=True
                ),
                embedding=EmbeddingSpec(scaled_class="Gemma4TextScaledWordEmbedding"),
            ),
            tiny_from="gemma-4-31b",
            wrapped_by=("gemma4",),
        ),
        Family(
            model_type="phi3",
            config=ConfigRules(
                defaults={
                    "vocab_size": 32064,
                    "hidden_size": 3072,
                    "intermediate_size": 8192,
                    "num_hidden_layers": 32,
                    "num_attention_heads": 32,
                    "max_position_embeddings": 4096,
                },
                attention_bias="never",
                fused=True,
            ),
            patch=PatchSpec(
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
            tiny_from="phi-3-mini",
        ),
        Family(
            model_type="olmo2",
            config=_olmo_rules(defaults=_OLMO_7B),
            patch=_olmo_patch("olmo2", "Olmo2"),
            tiny_from="olmo-2-0425-1b",
        ),
        Family(
            model_type="olmo3",
            config=_olmo_rules(
                defaults={**_OLMO_7B, "sliding_window": 4096},
                windowed_layers="pattern",
                sliding_window_pattern=4,
                rope_per_layer_type=True,
            ),
            patch=_olmo_patch("olmo3", "Olmo3", sliding_window="module"),
            tiny_from="olmo-3-7b-instruct",
        ),
        Family(
            model_type="seed_oss",
            config=ConfigRules(
                defaults={
                    "vocab_size": 155136,
                    "hidden_size": 4096,
                    "intermediate_size": 27648,
                    "num_hidden_layers": 64,
                    "num_attention_heads": 80,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 524288,
                    "attention_bias": True,
                    "attention_out_bias": False,
                    "attention_dropout": 0.1,
                    "residual_dropout": 0.1,
                },
                attention_bias="out_key",
                mlp_bias=True,
                residual_dropout_key="residual_dropout",
            ),
            patch=PatchSpec(
                model_type="seed_oss",
                norm=NormSpec(classes=("SeedOssRMSNorm",)),
                attention=AttentionSpec(
                    classes=("SeedOssAttention",), output_dropout_attr="residual_dropout"
                ),
                mlp=MlpSpec(classes=("SeedOssMLP",), output_dropout_attr="residual_dropout"),
                causal_lm=CausalLMSpec(classes=("SeedOssForCausalLM",)),
                decoder_layer=DecoderLayerSpec(classes=("SeedOssDecoderLayer",)),
            ),
            tiny_from="seed-oss-36b-instruct",
        ),
        Family(
            model_type="smollm3",
            config=ConfigRules(
                defaults={
                    "vocab_size": 128256,
                    "hidden_size": 2048,
                    "intermediate_size": 11008,
                    "num_hidden_layers": 36,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 4,
                    "max_position_embeddings": 32768,
                    "tie_word_embeddings": True,
                    "use_sliding_window": False,
                    "no_rope_layer_interval": 4,
                },
                mlp_bias=True,
                nope_layers=True,
                windowed_layers="nope_if_enabled",
            ),
            patch=PatchSpec(
                model_type="smollm3",
                norm=NormSpec(classes=("SmolLM3RMSNorm",)),
                attention=AttentionSpec(
                    classes=("SmolLM3Attention",),
                    sliding_window="module",
                    rope_flag_attr="use_rope",
                ),
                mlp=MlpSpec(classes=("SmolLM3MLP",)),
                causal_lm=CausalLMSpec(classes=("SmolLM3ForCausalLM",)),
                decoder_layer=DecoderLayerSpec(classes=("SmolLM3DecoderLayer",)),
            ),
            tiny_from="smollm3-3b",
        ),
        Family(
            model_type="granite",
            config=ConfigRules(
                defaults={
                    "vocab_size": 32000,
                    "hidden_size": 4096,
                    "intermediate_size": 11008,
                    "num_hidden_layers": 32,
                    "num_attention_heads": 32,
                    "max_position_embeddings": 2048,
                    "embedding_multiplier": 1.0,
                    "residual_multiplier": 1.0,
                    "logits_scaling": 1.0,
                },
                mlp_bias=True,
                multipliers=True,
            ),
            patch=PatchSpec(
                model_type="granite",
                norm=NormSpec(classes=("GraniteRMSNorm",)),
                # attention_multiplier is the module's own scaling, passed on as it is
                attention=AttentionSpec(classes=("GraniteAttention",)),
                mlp=MlpSpec(classes=("GraniteMLP",)),
                causal_lm=CausalLMSpec(classes=("GraniteForCausalLM",), logits_scaling=True),
                decoder_layer=DecoderLayerSpec(
                    classes=("GraniteDecoderLayer",), residual_multiplier_attr="residual_multiplier"
                ),
            ),
            tiny_from="granite-3.3-8b-instruct",
        ),
        Family(
            model_type="exaone4",
            config=ConfigRules(
                defaults={
                    "vocab_size": 102400,
                    "hidden_size": 4096,
                    "intermediate_size": 16384,
                    "num_hidden_layers": 32,
                    "num_attention_heads": 32,
                    "num_key_value_heads": 32,
                    "max_position_embeddings": 2048,
                    "sliding_window": 4096,
                },
                qk_norm=True,
                post_norm=True,
                nope_full_layers=True,
                windowed_layers="pattern",
                sliding_window_pattern=4,
            ),
            patch=PatchSpec(
                model_type="exaone4",
                norm=NormSpec(classes=("Exaone4RMSNorm",), in_place_backward=False),
                attention=AttentionSpec(
                    classes=("Exaone4Attention",),
                    qk_norm=True,
                    sliding_window="module",
                    sliding_flag_attr="is_sliding",
                ),
                mlp=MlpSpec(classes=("Exaone4MLP",)),
                causal_lm=CausalLMSpec(classes=("Exaone4ForCausalLM",)),
                notes=_POST_NORM_KEPT,
            ),
            tiny_from="exaone-4.0-32b",
        ),
        Family(
            model_type="gpt_oss",
            config=ConfigRules(
                defaults={
                    "vocab_size": 201088,
                    "hidden_size": 2880,
                    "intermediate_size": 2880,
                    "num_hidden_layers": 36,
                    "num_attention_heads": 64,
                    "num_key_value_heads": 8,
                    "head_dim": 64,
                    "max_position_embeddings": 131072,
                    "sliding_window": 128,
                    "attention_bias": True,
                    "num_local_experts": 128,
                    "num_experts_per_tok": 4,
                },
                windowed_layers="pattern",
                sliding_window_pattern=2,
                rope_half_tables=True,
                attention_sinks=True,
                moe=MoeRules(
                    experts_key="num_local_experts",
                    expert_width_key="intermediate_size",
                    normalizes_by_default=False,
                    fp32_routing_weights=False,
                    router="topk_softmax",
                    router_bias=True,
                    expert_biases=True,
                    clamped_glu=True,
                ),
            ),
            patch=PatchSpec(
                model_type="gpt_oss",
                # (w * x.float()).to(dtype): the weight product in fp32, as OLMo's
                norm=NormSpec(classes=("GptOssRMSNorm",), casting="gemma"),
                attention=AttentionSpec(
                    classes=("GptOssAttention",),
                    sliding_window="module",
                    sinks_attr="sinks",
                    half_rope_tables=True,
                ),
                causal_lm=CausalLMSpec(classes=("GptOssForCausalLM",), moe_aux_loss=True),
                decoder_layer=DecoderLayerSpec(
                    classes=("GptOssDecoderLayer",), mlp_returns_router_scores=True
                ),
                notes=_EXPERTS_KEPT,
            ),
            tiny_from="gpt-oss-20b",
            sdpa_refused_from=(5, 0),  # no SDPA path takes the sink logits: eager
        ),
        Family(
            model_type="llama4_text",
            config=ConfigRules(
                defaults={
                    "vocab_size": 202048,
                    "hidden_size": 5120,
                    "intermediate_size": 8192,
                    "intermediate_size_mlp": 16384,
                    "num_hidden_layers": 48,
                    "num_attention_heads": 40,
                    "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 131072,
                    "num_local_experts": 16,
                    "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1,
                    "no_rope_layer_interval": 4,
                    "use_qk_norm": True,
                    "attention_chunk_size": 8192,
                    "attn_temperature_tuning": True,
                    "floor_scale": 8192,
                    "attn_scale": 0.1,
                },
                nope_layers=True,
                llama4_attention=True,
                moe=MoeRules(
                    experts_key="num_local_experts",
                    expert_width_key="intermediate_size",
                    normalizes_by_default=False,
                    fp32_routing_weights=False,
                    router="sigmoid_every_expert",
                    dense_step_key="interleave_moe_layer_step",
                    moe_layers_key="moe_layers",
                ),
            ),
            patch=PatchSpec(
                model_type="llama4_text",
                norm=NormSpec(classes=("Llama4TextRMSNorm",), eps_attr="eps"),
                # Llama 4 rotates interleaved pairs as complex numbers, memplan's RoPE kernel
                # halves: the attention keeps its forward
                attention=AttentionSpec(classes=()),
                # the shared expert is a Llama4TextMLP too
                mlp=MlpSpec(classes=("Llama4TextMLP",)),
                causal_lm=CausalLMSpec(classes=("Llama4ForCausalLM",)),
                notes=(
                    "the decoder layers keep their forward: the MoE block returns the router "
                    "logits beside its output",
                    "the attention keeps its forward: Llama 4 rotates interleaved pairs as "
                    "complex numbers, memplan's RoPE kernel rotates halves",
                    "the experts (3-D weights, every token through every expert) keep "
                    "transformers' implementation",
                ),
            ),
            tiny_from="llama-4-scout-17b-16e",
            wrapped_by=("llama4",),
        ),
        Family(
            model_type="qwen3_5_text",
            config=ConfigRules(
                # Qwen3_5TextConfig's defaults (Qwen3.5-9B's sizes)
                defaults={
                    "vocab_size": 248320,
                    "hidden_size": 4096,
                    "intermediate_size": 12288,
                    "num_hidden_layers": 32,
                    **_GATED_DELTANET_DEFAULTS,
                    "num_key_value_heads": 4,
                },
                **_GATED_DELTANET_RULES,
                rope_per_batch_row=True,
            ),
            patch=PatchSpec(
                model_type="qwen3_5_text",
                # (1 + w) in fp32 on fp32 x, cast at the end: Gemma's casting; q_norm and
                # k_norm are of the class too
                norm=_gemma_norm("Qwen3_5", in_place_backward=True),
                gated_norm=GatedNormSpec(classes=("Qwen3_5RMSNormGated",)),
                # the gated attention (sigmoid output gate, multimodal RoPE) keeps its forward
                attention=AttentionSpec(classes=()),
                mlp=MlpSpec(classes=("Qwen3_5MLP",)),
                causal_lm=CausalLMSpec(classes=("Qwen3_5ForCausalLM",)),
                notes=(
                    *_GATED_DELTANET_NOTES,
                    "the full attention keeps its forward: its output gate and multimodal RoPE "
                    "are not memplan's attention",
                ),
            ),
            tiny_from="qwen3.5-0.8b",
            wrapped_by=("qwen3_5",),
        ),
        Family(
            model_type="qwen3_5_moe_text",
            config=ConfigRules(
                # Qwen3_5MoeTextConfig's defaults (Qwen3.5-35B-A3B's sizes, its docs say)
                defaults={
                    "vocab_size": 248320,
                    "hidden_size": 2048,
                    "num_hidden_layers": 40,
                    **_GATED_DELTANET_DEFAULTS,
                    "num_key_value_heads": 2,
                    "num_experts": 256,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512,
                },
                **_GATED_DELTANET_RULES,
                rope_per_batch_row=True,
                # the router renormalizes its top k whatever norm_topk_prob says
                moe=MoeRules(
                    experts_key="num_experts",
                    expert_width_key="moe_intermediate_size",
                    normalizes_by_default=True,
                    fp32_routing_weights=False,
                    shared_expert_width_key="shared_expert_intermediate_size",
                    reads_norm_topk_prob=False,
                ),
            ),
            patch=PatchSpec(
                model_type="qwen3_5_moe_text",
                norm=_gemma_norm("Qwen3_5Moe", in_place_backward=True),
                gated_norm=GatedNormSpec(classes=("Qwen3_5MoeRMSNormGated",)),
                attention=AttentionSpec(classes=()),
                # the shared expert is a Qwen3_5MoeMLP
                mlp=MlpSpec(classes=("Qwen3_5MoeMLP",)),
                causal_lm=CausalLMSpec(classes=("Qwen3_5MoeForCausalLM",), moe_aux_loss=True),
                notes=(
                    *_GATED_DELTANET_NOTES,
                    "the full attention keeps its forward: its output gate and multimodal RoPE "
                    "are not memplan's attention",
                    *_EXPERTS_KEPT,
                ),
            ),
            tiny_from="qwen3.5-35b-a3b",
            wrapped_by=("qwen3_5_moe",),
        ),
        Family(
            model_type="qwen3_next",
            config=ConfigRules(
                # Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B-Instruct's sizes, its docs say)
                defaults={
                    "vocab_size": 151936,
                    "hidden_size": 2048,
                    "intermediate_size": 5632,
                    "num_hidden_layers": 48,
                    **_GATED_DELTANET_DEFAULTS,
                    "num_key_value_heads": 2,
                    "decoder_sparse_step": 1,
                    "num_experts": 512,
                    "num_experts_per_tok": 10,
                    "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512,
                    "norm_topk_prob": True,
                },
                **_GATED_DELTANET_RULES,
                fused_deltanet_projections=True,
                moe=MoeRules(
                    experts_key="num_experts",
                    expert_width_key="moe_intermediate_size",
                    normalizes_by_default=True,
                    fp32_routing_weights=False,
                    dense_layers_key="mlp_only_layers",
                    shared_expert_width_key="shared_expert_intermediate_size",
                ),
            ),
            patch=PatchSpec(
                model_type="qwen3_next",
                norm=_gemma_norm("Qwen3Next", in_place_backward=True),
                gated_norm=GatedNormSpec(classes=("Qwen3NextRMSNormGated",)),
                # the gated attention (sigmoid output gate) keeps its forward
                attention=AttentionSpec(classes=()),
                # the shared expert is a Qwen3NextMLP
                mlp=MlpSpec(classes=("Qwen3NextMLP",)),
                causal_lm=CausalLMSpec(classes=("Qwen3NextForCausalLM",), moe_aux_loss=True),
                notes=(
                    *_GATED_DELTANET_NOTES,
                    "the full attention keeps its forward: its output gate is not memplan's "
                    "attention",
                    *_EXPERTS_KEPT,
                ),
            ),
            tiny_from="qwen3-next-80b-a3b-instruct",
        ),
    )
}
