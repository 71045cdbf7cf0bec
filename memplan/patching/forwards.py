"""The generic forwards memplan binds to module instances, parameterized by a family's spec.

Each factory returns a plain function `forward(self, ...)` that `engine.py` binds to one module
instance with types.MethodType. They call the projections, norms and heads as modules (so PEFT
adapters on them keep working) and transformers' attention interface exactly as the family's own
forward does; only the fused op replaces the PyTorch one."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from memplan.families.patch_spec import (
    AttentionSpec,
    CausalLMSpec,
    DecoderLayerSpec,
    GatedNormSpec,
    MlpSpec,
    NormSpec,
)

Forward = Callable[..., Any]

# The keyword under which a patched decoder layer hands memplan's attention and MLP forwards one
# view of the normalized input per projection (see DecoderLayerSpec).
PROJECTION_INPUTS = "memplan_projection_inputs"


class PrenormedHandoff:
    """One norm's output handed from the decoder layer that computed it to the norm's next call.

    A patched layer runs its last residual add inside the norm that reads the result (the next
    layer's input_layernorm, or the model's final norm): it computes h = residual + branch and
    norm(h) in one pass, returns h, and leaves (h, the views of norm(h)) here; the norm's next
    call, or the next layer reading its input norm, takes them. One handoff per norm module,
    made at apply time and held by the forwards that use it (nothing on the module itself).

    Invariant: it holds at most one entry, and hands the views out only to a call of its own
    norm module on exactly the tensor h (the same object). Any take() by that norm removes the
    entry, so activations never outlive the next call, and a call on another tensor (a forward
    hook replaced the layer's output) gets None and computes the norm itself. A copy of the
    model (copy.deepcopy, nn.DataParallel's replicas) shares the forwards' closures but not the
    modules: its norms get None here, and its layers leave nothing (LayerWiring.layer)."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm
        self._source: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def leave(self, source: torch.Tensor, outputs: tuple[torch.Tensor, ...]) -> None:
        self._source, self._outputs = source, outputs

    def take(self, norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """norm(x)'s views if `norm` is this handoff's norm and they were left for exactly x,
        else None; a take by the handoff's norm removes the entry."""
        source, outputs = self._source, self._outputs
        if source is None or norm is not self.norm:
            return None
        self._source, self._outputs = None, ()
        return outputs if source is x else None

    @property
    def empty(self) -> bool:
        return self._source is None


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the kernels are told of the GPU their tensors stand for, where the tensors cannot
    say: the traced step (memplan/traced) runs the patched model on meta tensors, which have no
    SMs and no autocast of their own. None: ask the tensors' device (a run on the GPU).

    sm_count: the GPU's SMs (they size the norms' backward scratch).
    autocast: the emulated autocast's dtype at the time of the call, None while it is off."""

    sm_count: int | None = None
    autocast: Callable[[], torch.dtype | None] | None = None

    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast runs in now, where these facts say (None: the device's own)."""
        return self.autocast() if self.autocast is not None else None


ON_DEVICE = DeviceFacts()


def _norm_options(spec: NormSpec, facts: DeviceFacts) -> dict[str, Any]:
    return {
        "offset": spec.offset,
        "casting": spec.casting,
        "in_place_backward": spec.in_place_backward,
        "sm_count": facts.sm_count,
    }


def norm_forward(
    spec: NormSpec,
    rms_norm: Callable[..., torch.Tensor],
    handoff: PrenormedHandoff,
    facts: DeviceFacts = ON_DEVICE,
) -> Forward:
    """The norm's forward: the output a decoder layer left in `handoff` for this input, else
    the kernel."""
    eps_attr = spec.eps_attr
    options = _norm_options(spec, facts)

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        prenormed = handoff.take(self, hidden_states)
        if prenormed is not None:
            return prenormed[0]
        return rms_norm(hidden_states, self.weight, getattr(self, eps_attr), **options)

    return forward


def gated_norm_forward(
    spec: GatedNormSpec, gated_rms_norm: Callable[..., torch.Tensor], facts: DeviceFacts = ON_DEVICE
) -> Forward:
    """The gated RMSNorm's forward through the kernel."""
    eps_attr = spec.eps_attr

    def forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, eps_attr)
        return gated_rms_norm(hidden_states, gate, self.weight, eps, sm_count=facts.sm_count)

    return forward


def embedding_forward(embedding: Callable[..., torch.Tensor], scale_attr: str | None) -> Forward:
    """The token embedding's lookup through memplan's kernel; with scale_attr, times that
    attribute in the weight's dtype, as Gemma's scaled embeddings do."""

    def forward(self: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        looked_up = embedding(input_ids, self.weight, self.padding_idx)
        if scale_attr is None:
            return looked_up
        return looked_up * getattr(self, scale_attr).to(self.weight.dtype)

    return forward


def output_dropout(module: nn.Module, out: torch.Tensor, dropout_attr: str | None) -> torch.Tensor:
    """A branch output through the dropout the family's own forward applies to it in training
    (the probability in `dropout_attr` of the module), or as it is."""
    if dropout_attr is None:
        return out
    return F.dropout(out, p=getattr(module, dropout_attr), training=module.training)


def mlp_forward(
    spec: MlpSpec,
    glu: Callable[..., torch.Tensor],
    facts: DeviceFacts = ON_DEVICE,
) -> Forward:
    dropout_attr = spec.output_dropout_attr
    if spec.fused_gate_up:

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            out = glu(gate, up, down=self.down_proj, autocast=facts.autocast_dtype())
            return output_dropout(self, out, dropout_attr)

    else:
        # gate and up are fresh projection outputs that nothing else reads (a Linear's backward
        # needs its input, not its output), so their buffers can take the gradients.
        def forward(
            self: nn.Module, x: torch.Tensor, **projection_inputs: tuple[torch.Tensor, ...]
        ) -> torch.Tensor:
            x_gate, x_up = projection_inputs.get(PROJECTION_INPUTS, (x, x))
            gate, up = self.gate_proj(x_gate), self.up_proj(x_up)
            autocast = facts.autocast_dtype()
            out = glu(gate, up, in_place_backward=True, down=self.down_proj, autocast=autocast)
            return output_dropout(self, out, dropout_attr)

    return forward


@dataclasses.dataclass(frozen=True)
class LayerWiring:
    """What one patched decoder layer needs to know about its neighbours, fixed at apply time.

    attention_inputs / mlp_inputs: how many views of the normalized input the layer's attention
        and MLP forwards take (3 for memplan's attention with q, k, v projections, 2 for memplan's
        MLP with gate and up projections, else 1).
    layer: the decoder layer these were made for: a copy of it (deepcopy, DataParallel) runs
        every add as its own, with its own norms.
    input_handoff: where the layer before left this layer's input norm's output.
    next_norm: the norm that reads this layer's output (the next layer's input_layernorm, or the
        model's final norm), with next_inputs views of its output, left in next_handoff (that
        norm's handoff); None: the layer's last residual add stays a plain add."""

    layer: nn.Module
    attention_inputs: int
    mlp_inputs: int
    input_handoff: PrenormedHandoff
    next_norm: nn.Module | None
    next_inputs: int
    next_handoff: PrenormedHandoff | None


def decoder_layer_forward(
    spec: DecoderLayerSpec,
    norm_spec: NormSpec,
    norm_kernels: tuple[Callable[..., Any], Callable[..., Any]],
    wiring: LayerWiring,
    facts: DeviceFacts = ON_DEVICE,
) -> Forward:
    """The pre-norm decoder layer of DecoderLayerSpec, with each residual add fused into the norm
    after it. The add that ends the layer runs with the next norm, in this layer: its result goes
    to the next norm's handoff (PrenormedHandoff), which hands it out when that norm is called
    on this layer's output. Not under gradient checkpointing (the recomputed next layer would
    compute its norm where the first forward took it from here) nor while torch.compile
    traces."""
    consumed_norm, add_norm = norm_kernels
    checkpoints_in_forward = layers_checkpoint_in_forward()
    eps_attr = norm_spec.eps_attr
    options = _norm_options(norm_spec, facts)
    dropouts = spec.branch_dropouts
    multiplier_attr = spec.residual_multiplier_attr
    router_scores_returned = spec.mlp_returns_router_scores

    def normed(norm: nn.Module, x: torch.Tensor, inputs: int) -> tuple[torch.Tensor, ...]:
        return consumed_norm(x, norm.weight, getattr(norm, eps_attr), consumers=inputs, **options)

    def added_normed(
        norm: nn.Module, residual: torch.Tensor, branch: torch.Tensor | None, inputs: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        mismatched = branch is not None and (
            residual.dtype != branch.dtype or residual.shape != branch.shape
        )
        if mismatched:
            # e.g. an fp32 residual stream under autocast: torch's add promotes
            hidden = residual + branch
            return hidden, normed(norm, hidden, inputs)
        return add_norm(
            residual, branch, norm.weight, getattr(norm, eps_attr), consumers=inputs, **options
        )

    def projection_inputs(views: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        return {PROJECTION_INPUTS: views} if len(views) > 1 else {}

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args:  # arguments only the family's own signature can place
            return type(self).forward(self, hidden_states, *args, **kwargs)
        if checkpoints_in_forward and self.training and torch.is_grad_enabled():
            if getattr(self, "gradient_checkpointing", False):
                # transformers checkpoints the class's forward, which this one replaces: the
                # family's own forward runs, checkpointed, its norms and projections patched
                return type(self).forward(self, hidden_states, **kwargs)
        residual = hidden_states
        views = wiring.input_handoff.take(self.input_layernorm, hidden_states)
        if views is None:
            residual, views = added_normed(
                self.input_layernorm, hidden_states, None, wiring.attention_inputs
            )
        attention_out, _ = self.self_attn(
            hidden_states=views[0], **kwargs, **projection_inputs(views)
        )
        if dropouts is not None:
            attention_out = getattr(self, dropouts[0])(attention_out)
        if multiplier_attr is not None:
            attention_out = attention_out * getattr(self, multiplier_attr)
        residual, views = added_normed(
            self.post_attention_layernorm, residual, attention_out, wiring.mlp_inputs
        )
        mlp_out = self.mlp(views[0], **projection_inputs(views))
        if router_scores_returned:
            mlp_out = mlp_out[0]
        if dropouts is not None:
            mlp_out = getattr(self, dropouts[1])(mlp_out)
        if multiplier_attr is not None:
            mlp_out = mlp_out * getattr(self, multiplier_attr)

        next_norm = wiring.next_norm
        if (
            next_norm is None
            or self is not wiring.layer
            or (self.training and getattr(self, "gradient_checkpointing", False))
            or torch.compiler.is_compiling()
            or next_norm.weight.device != residual.device
            or gathered_elsewhere(next_norm.weight)
        ):
            return residual + mlp_out
        hidden_states, next_views = added_normed(next_norm, residual, mlp_out, wiring.next_inputs)
        wiring.next_handoff.leave(hidden_states, next_views)
        return hidden_states

    return forward


def gathered_elsewhere(weight: torch.Tensor) -> bool:
    """Whether a sharding wrapper gathers `weight` for its own module's calls only: FSDP2's
    DTensor, or a DeepSpeed ZeRO-3 parameter (its hooks pass each module's output on as a new
    tensor, and free the weight after that module's backward, before this layer's runs)."""
    return isinstance(weight, DTensor) or hasattr(weight, "ds_id")


def layers_checkpoint_in_forward() -> bool:
    """Whether transformers' decoder layers apply gradient checkpointing inside the class's
    forward (from 5.2x) rather than in __call__ around whatever forward the instance has."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" not in vars(GradientCheckpointingLayer)


def family_function(module: nn.Module, name: str) -> Callable[..., Any]:
    """A module-level function of the transformers file that defines type(module), read (never
    replaced): the family's eager_attention_forward or load_balancing_loss_func."""
    fn = getattr(sys.modules[type(module).__module__], name, None)
    if fn is None:
        raise AttributeError(f"{type(module).__module__} defines no {name}")
    return fn


def _attention_interface(implementation: str | None, eager: Callable[..., Any]) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get_interface is not None:
        return get_interface(implementation, eager)
    return eager if implementation in (None, "eager") else ALL_ATTENTION_FUNCTIONS[implementation]


def _rotate(
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    in_place: bool,
    half_tables: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1] or half_tables:
        return rope(q, k, cos, sin, in_place=in_place)
    # Partial rotary (phi3 with partial_rotary_factor < 1): the tail of each head passes through.
    q_rot, k_rot = rope(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    return (
        torch.cat([q_rot, q[..., rotary_dim:]], dim=-1),
        torch.cat([k_rot, k[..., rotary_dim:]], dim=-1),
    )


class CausalMasks:
    """Which attention masks of the model's forward are plain causal masks (with the layer's
    window): sink attention's kernel computes exactly that and nothing else. transformers
    builds one mask per layer type per forward and hands the same tensor to each layer of the
    type, so each is read once (a device sync) and the answer kept beside a weak reference to
    it, one per window; a mask that has died is never mistaken for a new one. Made at apply
    time, held by the attention forwards that use it (nothing on the modules)."""

    def __init__(self) -> None:
        self._seen: dict[int | None, tuple[weakref.ref, bool]] = {}

    def plain(self, mask: torch.Tensor, seq: int, window: int | None) -> bool:
        """Whether `mask` ((batch, 1, seq, seq): additive, 0 where attended, or bool) lets query
        i attend to exactly the keys j <= i (and j > i - window)."""
        seen = self._seen.get(window)
        if seen is not None and seen[0]() is mask:
            return seen[1]
        plain = mask.dim() == 4 and tuple(mask.shape[1:]) == (1, seq, seq)
        if plain:
            attended = mask if mask.dtype == torch.bool else mask == 0
            i = torch.arange(seq, device=mask.device)[:, None]
            j = torch.arange(seq, device=mask.device)[None, :]
            expected = (j <= i) & (j > i - window) if window is not None else j <= i
            plain = torch.equal(attended, expected.expand_as(attended))
        self._seen[window] = (weakref.ref(mask), plain)
        return plain


def sink_kernel_applies(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int | None,
    masks: CausalMasks,
    kwargs: dict[str, Any],
) -> bool:
    """Whether memplan's sink attention computes what the family's eager attention would for
    this call: eager chosen (another implementation runs as asked), no dropout in training,
    no attention weights asked for, keys of the queries' positions only (no cache prefix), and
    a plain causal mask (padding, packed sequences or a custom mask: HF's eager attention
    runs). While torch.compile traces, the mask cannot be read: HF's attention runs."""
    if module.config._attn_implementation not in (None, "eager"):
        return False
    if module.training and module.attention_dropout > 0:
        return False
    if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
        return False
    seq = query.shape[-2]
    if key.shape[-2] != seq or attention_mask is None or torch.compiler.is_compiling():
        return False
    return masks.plain(attention_mask, seq, window)


def attention_forward(
    spec: AttentionSpec,
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    eager: Callable,
    query_scale: Callable[..., torch.Tensor] | None = None,
    sink_attention: Callable[..., torch.Tensor] | None = None,
) -> Forward:
    """One attention forward for every family: project, (qk-norm), RoPE kernel (not in a layer
    whose `rope_flag_attr` says it has none), (the queries times the family's
    position-dependent factor: `query_scale`, its get_llama_4_attn_scale, where
    spec.query_scale says so), cache update, then transformers' attention interface chosen by
    config._attn_implementation, or `sink_attention` (memplan.kernels.sink_attention) where the
    family has sinks and the call is one it computes exactly (sink_kernel_applies)."""
    masks = CausalMasks()
    dropout_attr = spec.output_dropout_attr
    rope_flag_attr = spec.rope_flag_attr
    sliding_flag_attr = spec.sliding_flag_attr

    def qk_normed(module: nn.Module) -> bool:
        flag = spec.qk_norm_flag_attr
        return spec.qk_norm and (flag is None or bool(getattr(module, flag)))

    def rotates(module: nn.Module) -> bool:
        if rope_flag_attr is not None and not getattr(module, rope_flag_attr):
            return False
        if sliding_flag_attr is None or module.sliding_window is None:
            return True
        return bool(getattr(module, sliding_flag_attr))

    def window(module: nn.Module) -> int | None:
        if sliding_flag_attr is not None and not getattr(module, sliding_flag_attr):
            return None
        return module.sliding_window

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # transformers 5.2x names the layer's KV cache `cache` (earlier: past_key_values)
        cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        if spec.qkv == "fused":
            qkv = self.qkv_proj(hidden_states)
            q_size = self.config.num_attention_heads * self.head_dim
            kv_size = self.config.num_key_value_heads * self.head_dim
            query = qkv[..., :q_size]
            key = qkv[..., q_size : q_size + kv_size]
            # A copy, as transformers' KV cache would make: attention saves value for backward,
            # and a slice would keep the whole qkv output alive with it.
            value = qkv[..., q_size + kv_size :].contiguous()
        else:
            x_q, x_k, x_v = kwargs.pop(PROJECTION_INPUTS, (hidden_states,) * 3)
            query = self.q_proj(x_q)
            key = self.k_proj(x_k)
            # Gemma 4's full layers without v_proj (attention_k_eq_v) take k_proj's output as v
            value = key if spec.v_norm and self.v_proj is None else self.v_proj(x_v)
        if qk_normed(self) and spec.qk_norm_scope == "projection":
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = (t.view(hidden_shape) for t in (query, key, value))

        # A per-head norm is per head vector, so before or after the transpose is the same math;
        # before it, the norm kernel reads contiguous rows and its output keeps the (batch, seq,
        # heads, head_dim) layout transformers' own ops keep (a contiguous (batch, heads, seq,
        # ...) output would make attention's output need a copy before o_proj).
        if qk_normed(self) and spec.qk_norm_scope == "head":
            query, key = self.q_norm(query), self.k_norm(key)
        if spec.v_norm:
            value = self.v_norm(value)
            # read by layers that reuse another's keys and values, which spec_from_config
            # refuses (num_kv_shared_layers); nothing reads it here
            kwargs.pop("shared_kv_states", None)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))

        if rotates(self):
            cos, sin = position_embeddings
            # q and k are fresh projection (or qk-norm) outputs that nothing saved: rotated in
            # place, except as slices of a fused qkv output, which attention would then keep
            # whole.
            query, key = _rotate(
                rope,
                query,
                key,
                cos,
                sin,
                in_place=spec.qkv != "fused",
                half_tables=spec.half_rope_tables,
            )
        if query_scale is not None:
            # as the family's forward: position_ids are its own argument, not the interface's
            rope_parameters = self.config.rope_parameters
            factor = query_scale(
                kwargs.pop("position_ids"),
                rope_parameters.get("llama_4_scaling_beta"),
                rope_parameters.get("original_max_position_embeddings"),
            )
            query = query * factor.to(query.dtype)

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        options: dict[str, Any] = {}
        if spec.sliding_window == "module":
            options["sliding_window"] = window(self)
        elif spec.sliding_window == "config":
            options["sliding_window"] = getattr(self.config, "sliding_window", None)
        if spec.softcap_attr is not None:
            options["softcap"] = getattr(self, spec.softcap_attr)
        if spec.sinks_attr is not None:
            options["s_aux"] = getattr(self, spec.sinks_attr)
            fused = sink_attention is not None and sink_kernel_applies(
                self, query, key, attention_mask, options.get("sliding_window"), masks, kwargs
            )
            if fused:
                # (batch, seq, heads, head_dim) views of the projections: no copy
                attn_output = sink_attention(
                    query.transpose(1, 2),
                    key.transpose(1, 2),
                    value.transpose(1, 2),
                    options["s_aux"],
                    options.get("sliding_window"),
                    self.scaling,
                )
                attn_output = attn_output.reshape(*input_shape, -1)
                return output_dropout(self, self.o_proj(attn_output), dropout_attr), None

        interface = _attention_interface(self.config._attn_implementation, eager)
        attn_output, attn_weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **options,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return output_dropout(self, self.o_proj(attn_output), dropout_attr), attn_weights

    return forward


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' logits_to_keep: an int keeps the last n positions (0 keeps all), a 1-D
    tensor the given positions, a 2-D bool mask the True positions, a 2-D int tensor per-row
    positions."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        return hidden[:, slice(-logits_to_keep, None), :]
    return hidden[:, logits_to_keep, :]


# The names transformers gave the KV cache, as a forward argument and an output field.
CACHE_NAMES = ("past_key_values", "cache")


class LossKernels:
    """The loss kernels a patched causal LM uses: FLCE when enabled, else cross entropy on the
    logits (computed in place of them: they are not returned in training)."""

    def __init__(
        self,
        flce: Callable[..., torch.Tensor] | None,
        cross_entropy: Callable[..., torch.Tensor] | None,
        flce_chunk: int | None,
        flce_memory_budget: int | None = None,
        facts: DeviceFacts = ON_DEVICE,
    ) -> None:
        self.flce = flce
        self.cross_entropy = cross_entropy
        self.flce_chunk = flce_chunk
        self.flce_memory_budget = flce_memory_budget
        self.facts = facts


def causal_lm_forward(spec: CausalLMSpec, original: Forward, kernels: LossKernels) -> Forward:
    """The causal-LM forward: in training with labels, last hidden states -> (FLCE | lm_head +
    CE kernel) with transformers' label shift; the loss is returned with logits=None. Otherwise
    (eval, or no labels) the original forward runs unchanged."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    from memplan.kernels.fused_linear_cross_entropy import prefetch_targets
    from memplan.patching.stateless_cache import StatelessCache, skips_packed_check

    signature = inspect.signature(original)
    # transformers 5.2x renamed past_key_values to cache, as an argument and an output field
    cache_arg = "cache" if "cache" in signature.parameters else "past_key_values"
    cache_field = next(
        f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name in CACHE_NAMES
    )
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )
    # A method of the module is called through its function on `self`, not through the bound
    # method: copy.deepcopy rebinds the instance's forward but not what this closure holds, so
    # a copy would otherwise run the source model's weights in eval and without labels.
    unbound = original.__func__ if isinstance(original, types.MethodType) else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            arguments = dict(signature.bind(*args, **kwargs).arguments)
            extra = arguments.pop(var_keyword, {}) if var_keyword else {}
            kwargs = {**arguments, **extra}
        labels = kwargs.get("labels")
        if labels is None or not self.training:
            return unbound(self, **kwargs) if unbound is not None else original(**kwargs)
        cache_slot = False
        if kwargs.get("use_cache") is None:
            # transformers builds a KV cache in training too (config.use_cache), holding a copy
            # of every layer's keys and values until the forward returns: under autocast (fp32
            # keys, not what SDPA saves) or eager attention (which saves repeated copies) that
            # is memory nobody reads, alive at the loss.
            kwargs["use_cache"] = False
            # HF's tuple output would hold that cache (not under gradient checkpointing, which
            # turns it off): its slot stays, as None, so hidden states and attentions keep their
            # positions.
            base = getattr(self, spec.base_model_attr, None)
            cache_slot = bool(getattr(self.config, "use_cache", False)) and not getattr(
                base, "gradient_checkpointing", False
            )

        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        model_kwargs = dict(kwargs)
        model_kwargs.pop("labels")
        logits_to_keep = model_kwargs.pop("logits_to_keep", 0)
        if spec.moe_aux_loss:
            output_router_logits = model_kwargs.get("output_router_logits")
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            model_kwargs["output_router_logits"] = output_router_logits

        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1)
        head = self.lm_head
        prefetched = None
        if kernels.flce is not None and plain_linear(head) and target.device == head.weight.device:
            prefetched = prefetch_targets(target, ignore_index, head.weight.shape[0])
        base = getattr(self, spec.base_model_attr)
        stateless = skips_packed_check(model_kwargs, base)
        if stateless:
            model_kwargs[cache_arg] = StatelessCache(config=self.config)
        outputs = base(**model_kwargs)
        past_key_values = None if stateless else getattr(outputs, cache_field)
        hidden = _keep_positions(outputs.last_hidden_state, logits_to_keep)

        target = target.to(hidden.device)
        softcap = self.config.final_logit_softcapping if spec.final_logit_softcapping else None
        loss = _loss(
            head,
            hidden,
            target,
            kernels,
            ignore_index=ignore_index,
            softcap=softcap,
            logits_scaling=self.config.logits_scaling if spec.logits_scaling else None,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            prefetched=prefetched,
        )

        if not spec.moe_aux_loss:
            result = CausalLMOutputWithPast(
                loss=loss,
                logits=None,
                **{cache_field: past_key_values},
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        else:
            aux_loss = None
            if model_kwargs["output_router_logits"]:
                balance = family_function(self, "load_balancing_loss_func")
                aux_loss = balance(
                    outputs.router_logits,
                    self.num_experts,
                    self.num_experts_per_tok,
                    kwargs.get("attention_mask"),
                )
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            result = MoeCausalLMOutputWithPast(
                loss=loss,
                aux_loss=aux_loss,
                logits=None,
                **{cache_field: past_key_values},
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
                router_logits=outputs.router_logits,
            )
        return result if return_dict else _to_tuple(result, cache_field if cache_slot else None)

    # HF's signature, for what inspects the forward: the Trainer keeps only the dataset columns
    # it names, generate() checks it for attention_mask and logits_to_keep.
    functools.update_wrapper(forward, unbound if unbound is not None else original)
    return forward


def _to_tuple(output: Any, cache_slot: str | None) -> tuple[Any, ...]:
    """output.to_tuple() with the logits slot kept (None), and the cache's where HF would have
    returned one: to_tuple drops None fields, which would move hidden states or the cache to
    where HF's tuple has the logits."""
    kept = ("logits", cache_slot) if cache_slot else ("logits",)
    return tuple(
        getattr(output, f.name)
        for f in dataclasses.fields(output)
        if f.name in kept or getattr(output, f.name) is not None
    )


def module_class(module: nn.Module) -> type:
    """The module's own class: FSDP2's fully_shard gives a module the subclass
    FSDP<Name>(FSDPModule, <Name>), which the families' class names do not list."""
    cls = type(module)
    for base in cls.__bases__:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base
    return cls


def plain_linear(module: nn.Module) -> bool:
    """An nn.Linear itself (or FSDP2's subclass of one), not another subclass or an adapter
    wrapper (PEFT LoRA, modules_to_save): FLCE reads its weight and bias instead of calling
    it."""
    return module_class(module) is nn.Linear


def _loss(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    target: torch.Tensor,
    kernels: LossKernels,
    *,
    ignore_index: int,
    softcap: float | None,
    num_items_in_batch: Any,
    prefetched: Any = None,
    logits_scaling: float | None = None,
) -> torch.Tensor:
    """The loss of the causal LM's last hidden states; `prefetched`: FLCE's target flags copied
    at the forward's start (memplan.kernels.fused_linear_cross_entropy.prefetch_targets);
    `logits_scaling`: the divisor of the logits, applied to the hidden states (lm_head is
    linear), where it is not 1."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if logits_scaling is not None and logits_scaling != 1:
        hidden = hidden / logits_scaling
    # FLCE needs the projection's weight; an adapter-wrapped lm_head (PEFT modules_to_save, LoRA)
    # is called as a module and its logits go to the cross-entropy kernel instead.
    if kernels.flce is not None and plain_linear(lm_head):
        # Under autocast FLCE casts hidden and weight itself, as nn.Linear would.
        return kernels.flce(
            hidden,
            lm_head.weight,
            target,
            lm_head.bias,
            ignore_index=ignore_index,
            softcap=softcap,
            num_items_in_batch=num_items_in_batch,
            chunk_size=kernels.flce_chunk,
            memory_budget=kernels.flce_memory_budget,
            prefetched=prefetched,
            autocast=kernels.facts.autocast_dtype(),
        )
    logits = lm_head(hidden)
    cross_entropy = kernels.cross_entropy
    if cross_entropy is None:
        # flce is on but the head is wrapped and cross_entropy is off: the plain loss, as HF.
        from transformers.loss.loss_utils import fixed_cross_entropy

        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return fixed_cross_entropy(logits.float(), target, num_items_in_batch, ignore_index)
    return cross_entropy(
        logits,
        target,
        ignore_index=ignore_index,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        inplace_grad=True,
    )
