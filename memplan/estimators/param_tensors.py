"""The parameter tensors of a causal LM in the order transformers allocates them (the order of
model.parameters()): the embedding, each decoder layer's projections then norms, the final norm,
the untied lm_head. Sizes in elements; count_params gives the same totals."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.schema import ModelSpec


@dataclass(frozen=True)
class ParamTensors:
    embedding: int
    # One decoder layer's tensors, in registration order: attention, MLP, norms.
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


def param_tensors(spec: ModelSpec) -> ParamTensors:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    attention: list[int] = []
    if spec.fused_qkv:
        attention.append(h * (q_out + 2 * kv_out))
    else:
        for out in (q_out, kv_out, kv_out):
            attention.append(h * out)
            if spec.attention_bias:
                attention.append(out)
    attention.append(q_out * h)
    if spec.attention_out_bias:
        attention.append(h)
    if spec.qk_norm:
        attention += [hd, hd]
    inter = spec.intermediate_size
    if spec.num_experts:
        moe = spec.moe_intermediate_size
        mlp = [h * spec.num_experts, spec.num_experts * 2 * moe * h, spec.num_experts * h * moe]
    elif spec.fused_gate_up:
        mlp = [2 * inter * h, inter * h]
    else:
        mlp = []
        for out, fan_in in ((inter, h), (inter, h), (h, inter)):
            mlp.append(out * fan_in)
            if spec.mlp_bias:
                mlp.append(out)
    norm = [h, h] if spec.norm == "layer" else [h]
    norms = norm * (4 if spec.sandwich_norm else 2)
    embedding = spec.vocab_size * h
    return ParamTensors(
        embedding=embedding,
        attention=tuple(attention),
        mlp=tuple(mlp),
        norms=tuple(norms),
        final_norm=tuple(norm),
        lm_head=0 if spec.tie_word_embeddings else embedding,
    )
