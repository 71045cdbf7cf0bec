"""Parameter counts of a causal LM from its ModelSpec, per module kind, as transformers builds it.
tests/test_estimator_params.py checks every catalog family against a meta-device model."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import UsageError
from memplan.schema import ModelSpec, TrainSetup


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    per_layer_linear: int  # matmul weights (+ biases) of one decoder layer
    per_layer_other: int  # norms of one decoder layer
    per_layer_tensors: int
    layers: int
    # A MoE model's layers with a dense MLP, and the matmul weights of one of them
    dense_layers: int = 0
    per_dense_layer_linear: int = 0

    @property
    def per_layer(self) -> int:
        return self.per_layer_linear + self.per_layer_other

    @property
    def layers_linear(self) -> int:
        """Matmul weights (+ biases) of all decoder layers."""
        sparse = self.layers - self.dense_layers
        return sparse * self.per_layer_linear + self.dense_layers * self.per_dense_layer_linear

    @property
    def total(self) -> int:
        layers = self.layers_linear + self.layers * self.per_layer_other
        return self.embedding + self.lm_head + self.final_norm + layers

    @property
    def linear_weights(self) -> int:
        """Parameters that go through a matmul (autocast keeps a low-precision copy of these)."""
        return self.layers_linear + (self.lm_head or self.embedding)


def count_params(spec: ModelSpec) -> ParamCounts:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    attn = h * q_out + 2 * h * kv_out + q_out * h
    tensors = 4
    if spec.attention_bias:
        attn += q_out + 2 * kv_out
        tensors += 3
    if spec.attention_out_bias:
        attn += h
        tensors += 1
    dense_mlp = 3 * h * spec.intermediate_size + (
        2 * spec.intermediate_size + h if spec.mlp_bias else 0
    )
    if spec.num_experts:
        mlp = h * spec.num_experts + spec.num_experts * 3 * h * spec.moe_intermediate_size
        mlp += 3 * h * spec.shared_expert_intermediate_size
        tensors += 3 + (3 if spec.shared_expert_intermediate_size else 0)
    else:
        mlp = dense_mlp
        tensors += 3 + (3 if spec.mlp_bias else 0)
    norm_width = 2 * h if spec.norm == "layer" else h
    n_norms = 4 if spec.sandwich_norm else 2
    other = n_norms * norm_width + sum(qk_norm_widths(spec))
    tensors += n_norms * (2 if spec.norm == "layer" else 1) + len(qk_norm_widths(spec))
    embedding = spec.vocab_size * h
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if spec.tie_word_embeddings else embedding,
        final_norm=norm_width,
        per_layer_linear=attn + mlp,
        per_layer_other=other,
        per_layer_tensors=tensors,
        layers=spec.num_hidden_layers,
        dense_layers=len(spec.dense_layers),
        per_dense_layer_linear=attn + dense_mlp,
    )


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
    "q_proj": lambda s: (s.hidden_size, s.num_attention_heads * s.head_dim),
    "k_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden_size, s.num_key_value_heads * s.head_dim),
    "o_proj": lambda s: (s.num_attention_heads * s.head_dim, s.hidden_size),
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
    one linear that holds them, qkv_proj (which adapts k as well)."""
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
    per_layer = sum(setup.lora_rank * (i + o) for i, o in lora_shapes(spec, setup))
    return per_layer * spec.num_hidden_layers


def lora_targets_modelled(spec: ModelSpec, setup: TrainSetup) -> list[str]:
    """The adapted linears of one layer whose shapes the estimator knows (LORA_TARGET_SHAPES)."""
    if setup.lora_rank:
        check_lora_targets(spec, setup.lora_targets)
    return [t for t in setup.lora_targets if t in LORA_TARGET_SHAPES]


def lora_shapes(spec: ModelSpec, setup: TrainSetup) -> list[tuple[int, int]]:
    """(in, out) of each adapted linear of one layer."""
    return [LORA_TARGET_SHAPES[t](spec) for t in lora_targets_modelled(spec, setup)]
