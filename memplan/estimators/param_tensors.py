"""The parameter tensors of a causal LM in the order transformers allocates them (the order of
model.parameters()): the embedding, each decoder layer's projections then norms, the final norm,
the untied lm_head. Each tensor is (rows, columns): its first dimension, which FSDP2 shards,
and the product of the others; count_params gives the same totals."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimators.params import qk_norm_widths
from memplan.schema import ModelSpec

Shape = tuple[int, int]  # (dim 0, the product of the other dims)


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

    @property
    def layer(self) -> tuple[Shape, ...]:
        return self.attention + self.mlp + self.norms


@dataclass(frozen=True)
class ParamTensors:
    """The same tensors in elements."""

    embedding: int
    attention: tuple[int, ...]
    mlp: tuple[int, ...]
    norms: tuple[int, ...]
    final_norm: tuple[int, ...]
    lm_head: int  # 0 when tied to the embedding

    @property
    def layer(self) -> tuple[int, ...]:
        return self.attention + self.mlp + self.norms

    def in_order(self, layers: int) -> list[int]:
        tensors = [self.embedding, *(self.layer * layers), *self.final_norm]
        return tensors + ([self.lm_head] if self.lm_head else [])


def param_shapes(spec: ModelSpec) -> ParamShapes:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    attention: list[Shape] = []
    if spec.fused_qkv:
        attention.append((q_out + 2 * kv_out, h))
    else:
        for out in (q_out, kv_out, kv_out):
            attention.append((out, h))
            if spec.attention_bias:
                attention.append((out, 1))
    attention.append((h, q_out))
    if spec.attention_out_bias:
        attention.append((h, 1))
    attention += [(width, 1) for width in qk_norm_widths(spec)]
    inter = spec.intermediate_size
    if spec.num_experts:
        # transformers 5 keeps the experts as 3-D parameters: (experts, 2 x moe, h), (experts,
        # h, moe); the router is (experts, h).
        e, moe = spec.num_experts, spec.moe_intermediate_size
        mlp: list[Shape] = [(e, h), (e, 2 * moe * h), (e, h * moe)]
    elif spec.fused_gate_up:
        mlp = [(2 * inter, h), (h, inter)]
    else:
        mlp = []
        for out, fan_in in ((inter, h), (inter, h), (h, inter)):
            mlp.append((out, fan_in))
            if spec.mlp_bias:
                mlp.append((out, 1))
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
    )


def param_tensors(spec: ModelSpec) -> ParamTensors:
    shapes = param_shapes(spec)
    return ParamTensors(
        embedding=numel(shapes.embedding),
        attention=tuple(map(numel, shapes.attention)),
        mlp=tuple(map(numel, shapes.mlp)),
        norms=tuple(map(numel, shapes.norms)),
        final_norm=tuple(map(numel, shapes.final_norm)),
        lm_head=numel(shapes.lm_head) if shapes.lm_head else 0,
    )
