"""The parameter tensors of a causal LM in the order transformers allocates them (the order of
model.parameters()): the embedding, each decoder layer's projections then norms, the final norm,
the untied lm_head. Each tensor is (rows, columns): its first dimension, which FSDP2 shards,
and the product of the others; count_params gives the same totals."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimators.params import (
    deltanet_conv_dim,
    deltanet_other_widths,
    deltanet_projection_widths,
    fused_deltanet,
    latent_attention_tensors,
    linear_value_dim,
    moe_rules,
    qk_norm_widths,
    shared_expert_gated,
)
from memplan.schema import ModelSpec

Shape = tuple[int, int]  # (dim 0, the product of the other dims)
FP32 = 4


def numel(shape: Shape) -> int:
    return shape[0] * shape[1]


@dataclass(frozen=True)
class ParamShapes:
    embedding: Shape
    # One decoder layer's tensors, in registration order: attention, MLP, norms.
    attention: tuple[Shape, ...]
    mlp: tuple[Shape, ...]
    norms: tuple[Shape, ...]
    final_norm: tuple[Shape, ...]
    lm_head: Shape | None  # None when tied to the embedding
    # A MoE model's dense layers (by index) and their MLP's tensors; `mlp` is the MoE block's.
    dense_layers: tuple[int, ...] = ()
    dense_mlp: tuple[Shape, ...] = ()
    router_index: int | None = None  # the router weight's place in a MoE block's `mlp`

    @property
    def layer(self) -> tuple[Shape, ...]:
        return self.attention + self.mlp + self.norms

    def layer_at(self, index: int) -> tuple[Shape, ...]:
        mlp = self.dense_mlp if index in self.dense_layers else self.mlp
        return self.attention + mlp + self.norms


@dataclass(frozen=True)
class ParamTensors:
    """The same tensors in elements."""

    embedding: int
    attention: tuple[int, ...]
    mlp: tuple[int, ...]
    norms: tuple[int, ...]
    final_norm: tuple[int, ...]
    lm_head: int  # 0 when tied to the embedding
    dense_layers: tuple[int, ...] = ()
    dense_mlp: tuple[int, ...] = ()
    router_index: int | None = None

    def bytes_in_order(self, layers: int, param_bytes: int, router_fp32: bool) -> list[int]:
        """Bytes of each tensor of in_order, in the weights' dtype (`param_bytes` an element)
        but for a MoE router weight kept in fp32 (`router_fp32`)."""
        sizes = [self.embedding * param_bytes]
        for index in range(layers):
            for position, n in enumerate(self.layer_at(index)):
                sizes.append(n * self.width_at(index, position, param_bytes, router_fp32))
        sizes += [n * param_bytes for n in self.final_norm]
        return sizes + ([self.lm_head * param_bytes] if self.lm_head else [])

    def width_at(self, index: int, position: int, param_bytes: int, router_fp32: bool) -> int:
        """Bytes per element of tensor `position` of layer `index` (layer_at's order)."""
        router = self.router_index
        sparse = index not in self.dense_layers and router is not None
        kept = router_fp32 and sparse and position == len(self.attention) + router
        return FP32 if kept else param_bytes

    @property
    def layer(self) -> tuple[int, ...]:
        return self.attention + self.mlp + self.norms

    def mlp_at(self, index: int) -> tuple[int, ...]:
        return self.dense_mlp if index in self.dense_layers else self.mlp

    def layer_at(self, index: int) -> tuple[int, ...]:
        return self.attention + self.mlp_at(index) + self.norms

    def in_order(self, layers: int) -> list[int]:
        tensors = [self.embedding, *(n for i in range(layers) for n in self.layer_at(i))]
        tensors += self.final_norm
        return tensors + ([self.lm_head] if self.lm_head else [])


def model_param_tensors(spec: ModelSpec) -> list[int]:
    """Every parameter of the model in registration order, each layer's as ModelSpec.layer
    gives its geometry."""
    if spec.uniform_layers:
        return param_tensors(spec).in_order(spec.num_hidden_layers)
    model = param_tensors(spec)
    layers = [n for i, layer in enumerate(spec.layers()) for n in param_tensors(layer).layer_at(i)]
    tensors = [model.embedding, *layers, *model.final_norm]
    return tensors + ([model.lm_head] if model.lm_head else [])


def param_shapes(spec: ModelSpec) -> ParamShapes:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    # the attention module's own parameter, registered before its projections
    attention: list[Shape] = [(spec.num_attention_heads, 1)] if spec.attention_sinks else []
    qk_norms = [(width, 1) for width in qk_norm_widths(spec)]
    if spec.fused_qkv:
        projections: tuple[int, ...] = (q_out + 2 * kv_out,)
    else:
        projections = (q_out, kv_out) if spec.values_from_keys else (q_out, kv_out, kv_out)
    if spec.attention_output_gate:  # q_proj's second half is the output gate
        projections = (2 * q_out, *projections[1:])
    for index, out in enumerate(projections):
        attention.append((out, h))
        if spec.attention_bias and not spec.fused_qkv:
            attention.append((out, 1))
        if index == 0 and spec.v_norm:  # Gemma 4 registers q_norm and k_norm after q_proj
            attention += qk_norms
    attention.append((h, q_out))
    if spec.attention_out_bias:
        attention.append((h, 1))
    if not spec.v_norm:
        attention += qk_norms
    if spec.mla:
        attention = [(rows, cols) for _, rows, cols in latent_attention_tensors(spec)]
    if spec.deltanet:
        attention = deltanet_shapes(spec)
    dense = dense_mlp_shapes(spec, spec.intermediate_size)
    mlp = moe_shapes(spec) if spec.num_experts else dense
    norm: list[Shape] = [(h, 1), (h, 1)] if spec.norm == "layer" else [(h, 1)]
    norms = norm * (4 if spec.sandwich_norm else 2)
    embedding = (spec.vocab_size, h)
    return ParamShapes(
        embedding=embedding,
        attention=tuple(attention),
        mlp=tuple(mlp),
        norms=tuple(norms),
        final_norm=tuple(norm),
        lm_head=None if spec.tie_word_embeddings else embedding,
        dense_layers=spec.dense_layers,
        dense_mlp=tuple(dense) if spec.dense_layers else (),
        router_index=router_position(spec),
    )


def deltanet_shapes(spec: ModelSpec) -> list[Shape]:
    """The gated DeltaNet in parameters() order: its own dt_bias and A_log, then its
    submodules' (Qwen3.5: the depthwise conv's weight, the gated norm's weight, out_proj,
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next: the conv's weight, in_proj_qkvz,
    in_proj_ba, the gated norm's weight, out_proj)."""
    _, dt_bias, a_log, norm = deltanet_other_widths(spec)
    h = spec.hidden_size
    inputs = [(width, h) for width in deltanet_projection_widths(spec)]
    conv = (deltanet_conv_dim(spec), spec.linear_conv_kernel_dim)
    out = (h, linear_value_dim(spec))
    if fused_deltanet(spec):
        return [(dt_bias, 1), (a_log, 1), conv, *inputs, (norm, 1), out]
    return [(dt_bias, 1), (a_log, 1), conv, (norm, 1), out, *inputs]


# The routers (MoeRules.router) of MoE blocks that register their experts first, then the
# router, then the shared experts' MLP.
EXPERTS_FIRST = ("sigmoid_fp32", "sigmoid_every_expert")


def router_position(spec: ModelSpec) -> int | None:
    """Where moe_shapes puts the router weight, for a MoE model."""
    if not spec.num_experts:
        return None
    return len(expert_shapes(spec)) if moe_rules(spec).router in EXPERTS_FIRST else 0


def dense_mlp_shapes(spec: ModelSpec, inter: int, bias: bool | None = None) -> list[Shape]:
    """A gated MLP `inter` wide: gate, up and down (their biases after each), or phi3's fused
    gate_up and down."""
    h = spec.hidden_size
    if spec.fused_gate_up:
        return [(2 * inter, h), (h, inter)]
    shapes: list[Shape] = []
    for out, fan_in in ((inter, h), (inter, h), (h, inter)):
        shapes.append((out, fan_in))
        if spec.mlp_bias if bias is None else bias:
            shapes.append((out, 1))
    return shapes


def moe_shapes(spec: ModelSpec) -> list[Shape]:
    """A MoE block: transformers 5 keeps the experts as 3-D parameters, (experts, 2 x moe, h)
    and (experts, h, moe), beside the (experts, h) router (and its bias, gpt-oss): registered
    first (Mixtral, Qwen3, gpt-oss; Qwen3-Next's then its shared expert and the (1, h)
    shared_expert_gate), or after the experts and before the shared experts' MLP
    (DeepSeek-style, Llama 4: EXPERTS_FIRST)."""
    e, h = spec.num_experts, spec.hidden_size
    rules = moe_rules(spec)
    router: list[Shape] = [(e, h)] + ([(e, 1)] if rules.router_bias else [])
    if shared_expert_gated(spec):
        shared = dense_mlp_shapes(spec, spec.shared_expert_intermediate_size, False)
        return router + expert_shapes(spec) + shared + [(1, h)]
    if rules.router not in EXPERTS_FIRST:
        return router + expert_shapes(spec)
    shared = dense_mlp_shapes(spec, spec.shared_expert_intermediate_size, False)
    return expert_shapes(spec) + router + shared


def expert_shapes(spec: ModelSpec) -> list[Shape]:
    """The experts' gate_up and down weights, each followed by its per-expert bias where the
    family has them (gpt-oss)."""
    e, moe, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    biases = moe_rules(spec).expert_biases
    gate_up: list[Shape] = [(e, 2 * moe * h)] + ([(e, 2 * moe)] if biases else [])
    return gate_up + [(e, h * moe)] + ([(e, h)] if biases else [])


def param_tensors(spec: ModelSpec) -> ParamTensors:
    shapes = param_shapes(spec)
    return ParamTensors(
        embedding=numel(shapes.embedding),
        attention=tuple(map(numel, shapes.attention)),
        mlp=tuple(map(numel, shapes.mlp)),
        norms=tuple(map(numel, shapes.norms)),
        final_norm=tuple(map(numel, shapes.final_norm)),
        lm_head=numel(shapes.lm_head) if shapes.lm_head else 0,
        dense_layers=shapes.dense_layers,
        dense_mlp=tuple(map(numel, shapes.dense_mlp)),
        router_index=shapes.router_index,
    )
