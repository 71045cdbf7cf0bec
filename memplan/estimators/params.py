"""Parameter counts of a causal LM from its ModelSpec, per module kind, as transformers builds it.
tests/test_estimator_params.py checks every catalog family against a meta-device model."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import UsageError
from memplan.families import FAMILIES
from memplan.families.family import MoeRules
from memplan.schema import ModelSpec, TrainSetup


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    layers_linear: int  # matmul weights (+ biases) of every decoder layer
    layers_other: int  # norms of every decoder layer

    @property
    def total(self) -> int:
        return (
            self.embedding + self.lm_head + self.final_norm + self.layers_linear + self.layers_other
        )

    @property
    def linear_weights(self) -> int:
        """Parameters that go through a matmul (autocast keeps a low-precision copy of these)."""
        return self.layers_linear + (self.lm_head or self.embedding)


def layer_linear_params(layer: ModelSpec, index: int) -> int:
    """Matmul weights (+ biases) of decoder layer `index` (`layer`: its ModelSpec.layer view): a
    MoE model's dense layers have the dense MLP, its MoE layers the experts, router and shared
    expert."""
    h, hd = layer.hidden_size, layer.head_dim
    q_out, kv_out = layer.num_attention_heads * hd, layer.num_key_value_heads * hd
    projections = 1 if layer.values_from_keys else 2  # k and v, or k alone (values from keys)
    gate = q_out if layer.attention_output_gate else 0  # q_proj's gate half
    attn = h * (q_out + gate) + projections * h * kv_out + q_out * h
    if layer.deltanet:
        attn = sum(deltanet_projection_widths(layer)) * h + linear_value_dim(layer) * h
    if layer.attention_bias:
        attn += q_out + projections * kv_out
    if layer.attention_out_bias:
        attn += h
    if layer.mla:
        attn = sum(rows * cols for name, rows, cols in latent_attention_tensors(layer))
        attn -= sum(latent_norm_widths(layer))
    if layer.moe_layer(index):
        mlp = h * layer.num_experts + layer.num_experts * 3 * h * layer.moe_intermediate_size
        mlp += layer.num_experts * sum(moe_bias_widths(layer))
        mlp += 3 * h * layer.shared_expert_intermediate_size
        mlp += h if shared_expert_gated(layer) else 0
    else:
        inter = layer.intermediate_size
        mlp = 3 * h * inter + (2 * inter + h if layer.mlp_bias else 0)
    return attn + mlp


def layer_other_params(layer: ModelSpec) -> int:
    """Norm weights of one decoder layer (a ModelSpec.layer view), and gpt-oss's sink logits."""
    norm_width = 2 * layer.hidden_size if layer.norm == "layer" else layer.hidden_size
    n_norms = 4 if layer.sandwich_norm else 2
    sinks = layer.num_attention_heads if layer.attention_sinks else 0
    if layer.deltanet:
        return n_norms * norm_width + sum(deltanet_other_widths(layer))
    latent = sum(latent_norm_widths(layer))
    return n_norms * norm_width + sum(qk_norm_widths(layer)) + sinks + latent


def linear_value_dim(layer: ModelSpec) -> int:
    """A gated DeltaNet layer's value width (heads x dim): out_proj's input, z's width."""
    return layer.linear_num_value_heads * layer.linear_value_head_dim


def deltanet_conv_dim(layer: ModelSpec) -> int:
    """The channels of a gated DeltaNet layer's causal conv: q, k and v together."""
    return 2 * layer.linear_num_key_heads * layer.linear_key_head_dim + linear_value_dim(layer)


def fused_deltanet(layer: ModelSpec) -> bool:
    """Whether the gated DeltaNet projects q, k, v and z in one linear, b and a in another
    (Qwen3-Next's in_proj_qkvz and in_proj_ba)."""
    return FAMILIES[layer.model_type].config.fused_deltanet_projections


def deltanet_projection_widths(layer: ModelSpec) -> tuple[int, ...]:
    """Output widths of the input projections, in registration order: Qwen3.5's in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a; Qwen3-Next's in_proj_qkvz, in_proj_ba."""
    nv = layer.linear_num_value_heads
    if fused_deltanet(layer):
        return deltanet_conv_dim(layer) + linear_value_dim(layer), 2 * nv
    return deltanet_conv_dim(layer), linear_value_dim(layer), nv, nv


def deltanet_other_widths(layer: ModelSpec) -> tuple[int, ...]:
    """The gated DeltaNet layer's parameters outside matmuls, in registration order: the
    depthwise conv's weight, dt_bias, A_log, the gated norm's weight."""
    nv = layer.linear_num_value_heads
    conv = deltanet_conv_dim(layer) * layer.linear_conv_kernel_dim
    return conv, nv, nv, layer.linear_value_head_dim


def count_params(spec: ModelSpec) -> ParamCounts:
    h = spec.hidden_size
    layers = spec.layers()
    embedding = spec.vocab_size * h
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if spec.tie_word_embeddings else embedding,
        final_norm=2 * h if spec.norm == "layer" else h,
        layers_linear=sum(layer_linear_params(layer, i) for i, layer in enumerate(layers)),
        layers_other=sum(map(layer_other_params, layers)),
    )


def moe_rules(spec: ModelSpec) -> MoeRules:
    rules = FAMILIES[spec.model_type].config.moe
    assert rules is not None, f"{spec.model_type} has no MoE rules"
    return rules


def shared_expert_gated(spec: ModelSpec) -> bool:
    """Whether the shared expert's output is multiplied by sigmoid(shared_expert_gate(x)), a
    Linear(hidden, 1) (Qwen3-Next, Qwen3.5-MoE)."""
    return spec.num_experts > 0 and moe_rules(spec).shared_expert_width_key is not None


def moe_bias_widths(spec: ModelSpec) -> tuple[int, ...]:
    """Per expert, the widths of the MoE block's biases in registration order: the router's
    (one per expert: 1 each), then gate_up_proj's and down_proj's where the experts have them."""
    rules = moe_rules(spec)
    router = (1,) if rules.router_bias else ()
    experts = (2 * spec.moe_intermediate_size, spec.hidden_size) if rules.expert_biases else ()
    return router + experts


def latent_attention_tensors(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """DeepSeek-V3's latent attention parameters in registration order, as (module, rows,
    columns): q_proj, or q_a_proj (its bias where attention_bias), q_a_layernorm and q_b_proj;
    kv_a_proj_with_mqa (bias likewise), kv_a_layernorm, kv_b_proj; o_proj (bias likewise)."""
    h, nh, hd = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    q_rank, kv_rank, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.rotated_dim
    bias = spec.attention_bias

    def linear(name: str, fan_in: int, fan_out: int, biased: bool) -> list[tuple[str, int, int]]:
        return [(name, fan_out, fan_in)] + ([(name, fan_out, 1)] if biased else [])

    if q_rank:
        tensors = linear("q_a_proj", h, q_rank, bias) + [("q_a_layernorm", q_rank, 1)]
        tensors += linear("q_b_proj", q_rank, nh * hd, False)
    else:
        tensors = linear("q_proj", h, nh * hd, False)
    tensors += linear("kv_a_proj_with_mqa", h, kv_rank + rope, bias)
    tensors += [("kv_a_layernorm", kv_rank, 1)]
    tensors += linear("kv_b_proj", kv_rank, nh * (spec.qk_nope_dim + spec.value_dim), False)
    return tensors + linear("o_proj", nh * spec.value_dim, h, spec.attention_out_bias)


def latent_norm_widths(spec: ModelSpec) -> tuple[int, ...]:
    """The weights of latent attention's q_a_layernorm (where q has a latent) and
    kv_a_layernorm; none for other attention."""
    if not spec.mla:
        return ()
    return (spec.q_lora_rank,) * bool(spec.q_lora_rank) + (spec.kv_lora_rank,)


def qk_norm_widths(spec: ModelSpec) -> tuple[int, ...]:
    """The weights of q_norm and k_norm: one head's width each, or the whole q / k projection's
    (qk_norm_scope "projection"); none without qk norms."""
    if not spec.qk_norm:
        return ()
    if spec.qk_norm_scope == "projection":
        return (spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim)
    return (spec.head_dim, spec.head_dim)


LORA_TARGET_SHAPES = {
    # target module -> (in_features, out_features) as a function of the spec
    "q_proj": lambda s: (
        s.hidden_size,
        s.num_attention_heads * s.head_dim * (2 if s.attention_output_gate else 1),
    ),
    "k_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "o_proj": lambda s: (s.num_attention_heads * s.value_dim, s.hidden_size),
    # latent attention (DeepSeek-V3)
    "q_a_proj": lambda s: (s.hidden_size, s.q_lora_rank),
    "q_b_proj": lambda s: (s.q_lora_rank, s.num_attention_heads * s.head_dim),
    "kv_a_proj_with_mqa": lambda s: (s.hidden_size, s.kv_lora_rank + s.rotated_dim),
    "kv_b_proj": lambda s: (
        s.kv_lora_rank,
        s.num_attention_heads * (s.qk_nope_dim + s.value_dim),
    ),
    "gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "down_proj": lambda s: (s.intermediate_size, s.hidden_size),
    "qkv_proj": lambda s: (
        s.hidden_size,
        (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim,
    ),
    "gate_up_proj": lambda s: (s.hidden_size, 2 * s.intermediate_size),
}


def attention_lora_targets(spec: ModelSpec) -> tuple[str, ...]:
    """Every attention projection (q, k, v and o) under the architecture's own names."""
    if spec.mla:
        q = ("q_a_proj", "q_b_proj") if spec.q_lora_rank else ("q_proj",)
        return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    return ("qkv_proj", "o_proj") if spec.fused_qkv else ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_target_modules(spec: ModelSpec) -> tuple[str, ...]:
    """The linears of one decoder layer that LoRA can adapt, by the module names transformers
    gives them. transformers 5 builds MoE experts as 3-D parameters, not nn.Linear, so peft's
    target_modules reach only the attention projections there."""
    if spec.num_experts:
        mlp: tuple[str, ...] = ()
    elif spec.fused_gate_up:
        mlp = ("gate_up_proj", "down_proj")
    else:
        mlp = ("gate_proj", "up_proj", "down_proj")
    return attention_lora_targets(spec) + mlp


def default_lora_targets(spec: ModelSpec) -> tuple[str, ...]:
    """peft's default for llama-like models, q_proj and v_proj; on a fused-qkv model (phi3) the
    one linear that holds them, qkv_proj (which adapts k as well); under latent attention (peft
    has no default for it) the up-projections of q and of k and v, q_b_proj (q_proj without a q
    latent) and kv_b_proj."""
    if spec.mla:
        return ("q_b_proj" if spec.q_lora_rank else "q_proj", "kv_b_proj")
    return ("qkv_proj",) if spec.fused_qkv else ("q_proj", "v_proj")


def check_lora_targets(spec: ModelSpec, targets: tuple[str, ...]) -> None:
    """Raise UsageError unless every target names a linear of this architecture (peft would
    raise, or silently adapt fewer modules than asked)."""
    available = lora_target_modules(spec)
    if not targets:
        raise UsageError(
            f"LoRA needs at least one target module; {spec.model_type} has {', '.join(available)}"
        )
    missing = [t for t in targets if t not in available]
    if missing:
        raise UsageError(
            f"{spec.model_type} has no LoRA target {', '.join(missing)}; "
            f"its layers have {', '.join(available)}"
        )


def lora_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Adapter parameters: r * (in + out) for each targeted linear of each layer."""
    if not setup.lora_rank:
        return 0
    return sum(
        setup.lora_rank * (i + o) for layer in spec.layers() for i, o in lora_shapes(layer, setup)
    )


def lora_targets_modelled(spec: ModelSpec, setup: TrainSetup) -> list[str]:
    """The adapted linears of one layer whose shapes the estimator knows (LORA_TARGET_SHAPES)."""
    if setup.lora_rank:
        check_lora_targets(spec, setup.lora_targets)
    return [t for t in setup.lora_targets if t in LORA_TARGET_SHAPES]


def lora_shapes(spec: ModelSpec, setup: TrainSetup) -> list[tuple[int, int]]:
    """(in, out) of each adapted linear of one layer (a ModelSpec.layer view): a layer whose
    values come from its keys has no v_proj to adapt."""
    return [LORA_TARGET_SHAPES[t](spec) for t in layer_lora_targets(spec, setup)]


def layer_lora_targets(spec: ModelSpec, setup: TrainSetup) -> list[str]:
    """lora_targets_modelled that one layer (a ModelSpec.layer view) has: a gated DeltaNet layer
    has none of the attention projections."""
    targets = lora_targets_modelled(spec, setup)
    if spec.deltanet:
        return [t for t in targets if t not in attention_lora_targets(spec)]
    return [t for t in targets if not (spec.values_from_keys and t == "v_proj")]
