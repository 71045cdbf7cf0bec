"""Walk one training step as a timeline of allocated bytes and take its maximum.

The walk follows the measurement protocol (shared/reference/measurement_protocol.md): forward layer
by layer, the loss, backward layer by layer, the optimizer step, zero_grad(set_to_none=True).
Step 1 runs without optimizer states; a steady step (the protocol's figure) starts with them and
with the cuBLAS workspace of the autograd thread, which step 1's backward created."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from memplan.estimators import kernel_contracts as kc
from memplan.estimators.adapters import forward_order, forward_programs
from memplan.estimators.contracts import (
    AFTER_ATTENTION,
    EVERY_EXPERT_AUTOCAST_NAMES,
    FP32,
    INPUT_ITSELF,
    INT64,
    LAYER_INPUT,
    LORA_TARGET_STAGE,
    MLP_AUTOCAST_WEIGHTS,
    SHARED_EXPERT,
    BackwardStep,
    DtypePlan,
    LayerContext,
    Saved,
    adapters_share_inputs,
    attention_masked,
    attention_path,
    autocast_weight_params,
    autocast_weight_tensors,
    every_expert_moe_backward,
    every_expert_moe_peaks,
    fused_attention_kernel,
    fused_qkv_programs,
    gated_mlp_backward,
    gated_mlp_first_forward,
    gemma_norms,
    kv_cache_shares_saved,
    kv_path_saved,
    layer_saved,
    norm_saved,
    o_input_kept,
    rotation_saved,
    runs_under_autocast,
    scores_attention_backward,
    sink_kernel,
    walked_tensor_by_tensor,
)
from memplan.estimators.deltanet import (
    RULE_ENTRIES,
    TRITON_BENCHMARK_BUFFER,
    deltanet_backward_transient,
    deltanet_cache_bytes,
    deltanet_forward_peak,
    fla_autotuned_layer,
)
from memplan.estimators.events import EventLog, ForwardStep
from memplan.estimators.grouped_experts import (
    experts_backward_start,
    experts_programs,
    recomputed_experts_peak,
    unsaved_experts_program,
)
from memplan.estimators.kernel_scratch import (
    CudaDevice,
    embedding_backward_bytes,
    sort_blocks,
    sum_staging_blocks,
)
from memplan.estimators.norm_programs import norm_programs
from memplan.estimators.parallel import OneGpu, computed_setup, layout_for
from memplan.estimators.param_tensors import model_param_tensors, param_tensors
from memplan.estimators.params import (
    ParamCounts,
    count_params,
    latent_attention_tensors,
    layer_lora_targets,
    lora_params,
    lora_shapes,
    moe_rules,
    qk_norm_widths,
)
from memplan.estimators.releases import Release
from memplan.estimators.scores_programs import scores_programs
from memplan.families import FAMILIES
from memplan.schema import (
    GLU_KERNEL_BY_ACTIVATION,
    Gpu,
    MemoryEstimate,
    ModelSpec,
    TimelinePoint,
    TrainSetup,
)

MIB = 2**20

# Optimizer: states per trainable parameter in the parameters' dtype, and the temporary its
# step allocates (torch's foreach AdamW: one sqrt(exp_avg_sq) list the size of the parameters).
# torch's Adafactor keeps a row and a column vector per matrix (left out: < 0.1% of the
# parameters) and steps one tensor at a time: its temporary is the largest tensor's estimate.
OPTIMIZER_STATES: dict[str, tuple[float, float]] = {
    "adamw": (2, 1),
    "adamw-fused": (2, 0),
    "adam": (2, 1),
    "sgd": (0, 0),
    "sgd-momentum": (1, 0),
    "adafactor": (0, 0),
}
PER_TENSOR_STEP = ("adafactor",)
# bitsandbytes' AdamW8bit (0.50, Optimizer2State.init_state): tensors of fewer elements keep
# two fp32 states; larger ones two uint8 states and an fp32 absmax per block of each, after the
# two 256-entry fp32 quantization maps the first one moves to the GPU.
BNB_MIN_8BIT_ELEMENTS = 4096
BNB_BLOCK = 256
BNB_QMAP_BYTES = 256 * 4


def bnb_8bit_states(tensors: list[int]) -> list[list[int]]:
    """Per trainable tensor (elements), the blocks AdamW8bit allocates at its first step."""
    states, maps = [], [BNB_QMAP_BYTES, BNB_QMAP_BYTES]
    for n in tensors:
        if n < BNB_MIN_8BIT_ELEMENTS:
            states.append([n * FP32, n * FP32])
            continue
        absmax = -(-n // BNB_BLOCK) * FP32
        states.append([*maps, n, n, absmax, absmax])
        maps = []
    return states


def cublas_workspace_bytes(gpu: Gpu | None) -> int:
    """torch's default cuBLAS workspace per (handle, stream): 32 MiB from Hopper on, else
    4096 KiB * 2 + 16 KiB * 8 (CublasHandlePool.cpp)."""
    major = gpu.compute_capability[0] if gpu else 9
    return 32 * MIB if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def round_block(nbytes: float) -> int:
    """The caching allocator hands out multiples of 512 bytes."""
    return -(-int(nbytes) // 512) * 512


def layer_contexts(
    spec: ModelSpec,
    setup: TrainSetup,
    dtypes: DtypePlan,
    backend: str,
    under_autocast: bool | None = None,
) -> list[LayerContext]:
    """One context per decoder layer; `under_autocast` defaults to what `dtypes` say (an FSDP2
    amp step computes in bf16 inside autocast: runs_under_autocast of its setup as given)."""
    lora = bool(setup.lora_rank)
    layer_types = spec.layer_types or ()
    # Under checkpointed LoRA peft's leaf, the embedding's output, requires grad, and so the
    # first layer's input: modelled where the walk follows a checkpointed layer tensor by
    # tensor (Llama 4's MoE layers, moe_forward_peaks)
    leaf_input = setup.grad_checkpointing and walked_tensor_by_tensor(spec)
    hf_loss = not {"flce", "cross_entropy"} & set(setup.kernels)
    # Under LoRA a layer's input needs a gradient once a layer before it has an adapter: not in
    # the gated DeltaNet layers before the first full attention, where only attention is
    # adapted. peft's leaf (checkpointed LoRA) makes every layer's input need one.
    adapted = [bool(layer_lora_targets(layer, setup)) for layer in spec.layers()] if lora else []
    leaf_input = leaf_input or (setup.grad_checkpointing and bool(spec.linear_attention_layers))
    return [
        LayerContext(
            spec=spec.layer(index),
            setup=setup,
            dtypes=dtypes,
            backend=backend,
            kernels=frozenset(setup.kernels),
            trainable_base=not lora,
            needs_input_grad=not lora or any(adapted[:index]) or leaf_input,
            sliding=index < len(layer_types) and layer_types[index] == "sliding_attention",
            under_autocast=dtypes.autocast if under_autocast is None else under_autocast,
            rope=index not in spec.nope_layers,
            moe=spec.moe_layer(index),
            chunked=spec.attention_chunk_size is not None and index not in spec.nope_layers,
            cached=hf_loss and not setup.grad_checkpointing and spec.use_cache,
        )
        for index in range(spec.num_hidden_layers)
    ]


@dataclass
class ForwardSaved:
    """What the forward leaves saved for backward, in bytes, by where it was saved."""

    # Per layer, the allocations saved before and after attention (the norms and MLP after
    # attention: backward frees those before it reaches attention).
    layer_entries: list[tuple[list[int], list[int]]]
    # The same, as a checkpointed layer's recomputation allocates them: without what is the
    # layer's input itself, which the checkpoint holds already.
    recomputed_entries: list[tuple[list[int], list[int]]]
    final_norm: int
    embedding: int
    shared: int  # rotary cos/sin, shared by every layer
    loss: int
    # Attention masks the checkpointed layers keep as inputs for their recomputation: (bytes,
    # the layer whose backward releases it, the lowest that reads it).
    checkpoint_masks: list[tuple[int, int]] = field(default_factory=list)
    # Under checkpointed autocast, per layer, the copies of its trainable weights that autocast
    # caches as each matmul first runs: the attention's, then Llama 4's MoE block's (their order
    # in moe_forward_peaks); None where the cache is one allocation at the start (LoRA).
    autocast_cache_by_layer: list[tuple[list[int], list[int]]] | None = None
    # Per layer, the forward's points inside Llama 4's MoE block above the layer's start: the
    # layer's saved allocations alive there and what the block holds beside them (none
    # elsewhere); under checkpointing, the graph-free first forward's.
    moe_peaks: list[list[list[int]]] = field(default_factory=list)
    # The attention masks the model's forward makes, alive until it returns (under
    # checkpointing, checkpoint_masks).
    forward_masks: list[int] = field(default_factory=list)
    # Per layer, the names of the allocations saved after attention, and the MLP block's
    # backward program (Llama 4's MoE: contracts.every_expert_moe_backward; a dense gated MLP:
    # contracts.gated_mlp_backward; empty elsewhere).
    after_names: list[list[str]] = field(default_factory=list)
    mlp_backward: list[list[BackwardStep]] = field(default_factory=list)
    # The embedding's output, which the model's forward holds through every layer, where the
    # first layer saves none of it as it is and no checkpoint holds it (one allocation, or
    # none).
    embedding_output: list[int] = field(default_factory=list)
    # Per layer, the names of the allocations saved before the MLP, as the forward and a
    # checkpointed recomputation make them (the attention's backward frees them by name where
    # it materializes scores: contracts.scores_attention_backward).
    before_names: list[list[str]] = field(default_factory=list)
    recomputed_before_names: list[list[str]] = field(default_factory=list)
    # Per layer, the forward's temporaries around its saved entries of a name, by that name
    # (norm_programs.norm_programs: the HF RMSNorms'; adapters.forward_programs: LoRA's).
    forward_programs: list[dict[str, list[ForwardStep]]] = field(default_factory=list)
    # per layer, the grouped experts' temporaries where its MoE block saves nothing
    # (grouped_experts.unsaved_experts_program; empty elsewhere)
    unsaved_experts: list[list[ForwardStep]] = field(default_factory=list)
    # per layer, a checkpointed dense MLP's first forward (contracts.gated_mlp_first_forward;
    # empty elsewhere)
    mlp_first_forward: list[list[ForwardStep]] = field(default_factory=list)
    # whether the walk plays a checkpointed layer's first forward: under LoRA, and in models
    # without gated DeltaNet layers (whose chunk loop's tensors it does not follow there)
    first_forward: bool = True

    @property
    def layers(self) -> list[int]:
        return [sum(before) + sum(after) for before, after in self.layer_entries]

    @property
    def layers_after_attention(self) -> list[int]:
        return [sum(after) for _, after in self.layer_entries]

    @property
    def total(self) -> int:
        return sum(self.layers) + self.final_norm + self.embedding + self.shared + self.loss


def saved_allocations(
    saved: Saved, tokens: int, prefixes: tuple[str, ...], matching: bool = True
) -> list[int]:
    """The bytes of each tensor of `saved` whose name starts (`matching`) or does not start with
    one of `prefixes`, in the order the forward saved them."""
    sizes = (
        int(per_token * tokens) + constant
        for name, per_token, constant in saved.tensors
        if name.startswith(prefixes) == matching
    )
    return [n for n in sizes if n > 0]


def deltanet_forward_transient(ctx: LayerContext, tokens: int) -> list[int]:
    """deltanet_forward_peak with the layer's saved tensors, all of them and those up to the
    chunked rule's last, as the allocator gets them."""
    saved = layer_saved(ctx)
    rule = [i for i, (name, _, _) in enumerate(saved.tensors) if name.startswith(RULE_ENTRIES)]
    up_to_rule = Saved(tensors=saved.tensors[: rule[-1] + 1] if rule else [])
    return deltanet_forward_peak(
        ctx,
        [round_block(n) for n in saved_allocations(saved, tokens, ())],
        [round_block(n) for n in saved_allocations(up_to_rule, tokens, ())],
        tokens,
    )


def saved_names(
    saved: Saved, tokens: int, prefixes: tuple[str, ...], matching: bool = True
) -> list[str]:
    """The names of saved_allocations(saved, tokens, prefixes, matching), in the same order."""
    return [
        name
        for name, per_token, constant in saved.tensors
        if name.startswith(prefixes) == matching and int(per_token * tokens) + constant > 0
    ]


def forward_saved(
    spec: ModelSpec,
    setup: TrainSetup,
    backend: str = "cuda",
    rounded: bool = True,
    under_autocast: bool | None = None,
) -> ForwardSaved:
    """Bytes autograd saves during one forward (no checkpointing), parameters excluded."""
    dtypes = DtypePlan.of(setup.precision)
    tokens = setup.batch * setup.seq
    blocks = round_block if rounded else int
    lora = bool(setup.lora_rank)
    contexts = layer_contexts(spec, setup, dtypes, backend, under_autocast)
    by_kind: dict[tuple[bool, ...], tuple[list[int], list[int]]] = {}  # layers differ so
    recomputed: dict[tuple[bool, ...], tuple[list[int], list[int]]] = {}
    # Without autocast the linears that read the residual stream keep the layer input itself,
    # as an fp32 input norm does (x.float() returns it): the checkpoint holds it already.
    layer_input = (LAYER_INPUT,) if not dtypes.autocast else ()
    layer_input += ("norm.attn" + INPUT_ITSELF,)
    moe_peaks: dict[tuple[bool, ...], list[list[int]]] = {}
    after_names: dict[tuple[bool, ...], list[str]] = {}
    before_names: dict[tuple[bool, ...], tuple[list[str], list[str]]] = {}
    mlp_backward: dict[tuple[bool, ...], list[BackwardStep]] = {}
    programs: dict[tuple[bool, ...], dict[str, list[ForwardStep]]] = {}
    unsaved: dict[tuple[bool, ...], list[ForwardStep]] = {}
    first_mlp: dict[tuple[bool, ...], list[ForwardStep]] = {}
    for ctx in contexts:
        kind = layer_kind(ctx)
        if kind not in by_kind:
            original = layer_saved(ctx)
            saved = forward_order(original, layer_lora_targets(ctx.spec, setup))
            programs[kind] = {**norm_programs(ctx, saved, tokens)}
            programs[kind].update(scores_programs(ctx, saved, tokens))
            programs[kind].update(forward_programs(ctx, saved, tokens))
            programs[kind].update(experts_programs(ctx, saved, tokens))
            programs[kind].update(fused_qkv_programs(ctx, saved, tokens, programs[kind]))
            unsaved[kind] = unsaved_experts_program(ctx, saved, tokens)
            first_mlp[kind] = gated_mlp_first_forward(ctx, tokens)
            before = saved_allocations(saved, tokens, AFTER_ATTENTION, matching=False)
            after = saved_allocations(saved, tokens, AFTER_ATTENTION)
            by_kind[kind] = ([blocks(n) for n in before], [blocks(n) for n in after])
            before = saved_allocations(saved, tokens, AFTER_ATTENTION + layer_input, matching=False)
            recomputed[kind] = ([blocks(n) for n in before], by_kind[kind][1])
            moe_peaks[kind] = moe_forward_peaks(ctx, original, tokens, blocks)
            after_names[kind] = saved_names(saved, tokens, AFTER_ATTENTION)
            before_names[kind] = (
                saved_names(saved, tokens, AFTER_ATTENTION, matching=False),
                saved_names(saved, tokens, AFTER_ATTENTION + layer_input, matching=False),
            )
            every_expert = spec.moe_router == "sigmoid_every_expert" and ctx.output_needs_grad(1)
            mlp_backward[kind] = (
                every_expert_moe_backward(ctx, tokens)
                if every_expert
                else gated_mlp_backward(ctx, tokens)
            )
    final = Saved()
    norm_saved(
        contexts[-1],
        final,
        "norm.final",
        spec.hidden_size,
        dtypes.residual,
        # lm_head keeps its input unless FLCE computed the gradients already.
        0 if lora or "flce" in setup.kernels else 1,
        not lora,
        gemma_norms(spec),
    )
    shared = sum(
        rope_table_bytes(spec, width, setup, dtypes, blocks)
        for width in rope_tables_kept(spec, contexts)
    )
    embedding = 0 if lora else blocks(tokens * INT64)
    if FAMILIES[spec.model_type].scaled_embedding and not lora:
        embedding += blocks(dtypes.residual)  # the sqrt(hidden) normalizer, a 0-d tensor
    return ForwardSaved(
        layer_entries=[by_kind[layer_kind(ctx)] for ctx in contexts],
        recomputed_entries=[recomputed[layer_kind(ctx)] for ctx in contexts],
        final_norm=blocks(final.bytes(tokens)),
        embedding=embedding,
        shared=shared,
        loss=blocks(loss_saved_bytes(spec, setup, dtypes)),
        checkpoint_masks=[
            (blocks(n), layer) for n, layer in checkpointed_masks(setup, dtypes, contexts)
        ],
        autocast_cache_by_layer=autocast_copies_by_layer(spec, contexts, blocks),
        moe_peaks=[moe_peaks[layer_kind(ctx)] for ctx in contexts],
        after_names=[after_names[layer_kind(ctx)] for ctx in contexts],
        embedding_output=[]
        if first_norm_keeps_input(contexts[0]) or setup.grad_checkpointing
        else [blocks(tokens * spec.hidden_size * dtypes.residual)],
        mlp_backward=[mlp_backward[layer_kind(ctx)] for ctx in contexts],
        before_names=[before_names[layer_kind(ctx)][0] for ctx in contexts],
        recomputed_before_names=[before_names[layer_kind(ctx)][1] for ctx in contexts],
        forward_programs=[programs[layer_kind(ctx)] for ctx in contexts],
        unsaved_experts=[unsaved[layer_kind(ctx)] for ctx in contexts],
        mlp_first_forward=[first_mlp[layer_kind(ctx)] for ctx in contexts],
        first_forward=lora or not spec.linear_attention_layers,
        forward_masks=[]
        if setup.grad_checkpointing
        else [blocks(n) for n in chunked_model_masks(setup, dtypes, contexts)],
    )


def layer_autocast_copies(
    spec: ModelSpec, ctx: LayerContext, blocks: Callable[[float], int]
) -> tuple[list[int], list[int]] | None:
    """One layer's autocast copies of its trainable weights under checkpointing, where the
    walk makes them layer by layer (walked_tensor_by_tensor): the attention's, the MoE
    block's (EVERY_EXPERT_AUTOCAST_NAMES' order); None elsewhere."""
    # copies only where autocast casts stored weights (not FSDP2's or ZeRO's bf16 gathers)
    trained = ctx.trainable_base and ctx.dtypes.autocast and ctx.setup.grad_checkpointing
    if not (trained and walked_tensor_by_tensor(spec)):
        return None
    copies = [blocks(ctx.dtypes.proj * n) for n in autocast_weight_tensors(spec, 0, True)]
    moe = len(EVERY_EXPERT_AUTOCAST_NAMES)
    return copies[:-moe], copies[-moe:]


def autocast_copies_by_layer(
    spec: ModelSpec, contexts: list[LayerContext], blocks: Callable[[float], int]
) -> list[tuple[list[int], list[int]]] | None:
    """Per layer, the autocast copies of its trainable weights under checkpointing, made as the
    layer's forward first runs its matmuls: Llama 4's as layer_autocast_copies splits them,
    else all of them with the attention's; None where the base weights do not train (LoRA:
    the adapters' copies, one allocation at the step's start)."""
    ctx = contexts[-1]
    if walked_tensor_by_tensor(spec):
        copies = layer_autocast_copies(spec, ctx, blocks)
        return None if copies is None else [copies] * len(contexts)
    if not (ctx.trainable_base and ctx.dtypes.autocast and ctx.setup.grad_checkpointing):
        return None
    return [
        ([blocks(c.dtypes.proj * n) for n in autocast_weight_tensors(c.spec, 0, c.moe)], [])
        for c in contexts
    ]


def first_norm_keeps_input(ctx: LayerContext) -> bool:
    """Whether the first layer's HF RMSNorm saves its input itself: x.float() returns an fp32
    input as it is, and pow keeps it where the norm needs a gradient, in a forward that records
    the graph."""
    grad = not ctx.setup.grad_checkpointing
    saves = ctx.needs_input_grad or ctx.trainable_base
    return grad and saves and ctx.dtypes.residual == FP32 and "rms_norm" not in ctx.kernels


def chunked_model_masks(
    setup: TrainSetup, dtypes: DtypePlan, contexts: list[LayerContext]
) -> list[int]:
    """Llama 4's masks, made once per forward: SDPA's (batch x seq x seq) bool mask for the
    chunked layers (the causal layers pass none); eager attention's additive (batch x seq x
    seq) masks in the residual dtype, one per layer type (chunked_mask_readers' order). None
    for other models."""
    square = setup.batch * setup.seq * setup.seq
    element = dtypes.residual if setup.attn == "eager" else 1
    return [square * element for _ in chunked_mask_readers(setup, contexts)]


def chunked_mask_readers(setup: TrainSetup, contexts: list[LayerContext]) -> list[int]:
    """For each of chunked_model_masks' masks, the first layer that reads it: its checkpoint
    holds it until that layer's backward is done."""
    if not any(ctx.chunked for ctx in contexts):
        return []
    kinds = (True, False) if setup.attn == "eager" else (True,)
    firsts = [next((i for i, c in enumerate(contexts) if c.chunked == k), None) for k in kinds]
    return [i for i in firsts if i is not None]


def moe_forward_peaks(
    ctx: LayerContext, saved: Saved, tokens: int, blocks: Callable[[float], int]
) -> list[list[int]]:
    """The allocations alive at each high point of Llama 4's MoE block in one layer's forward,
    beyond the layer's start: what the layer has saved by then (all of it but the shared
    expert's at the experts' second matmul) and every_expert_moe_peaks' tensors; under
    checkpointing the graph-free forward saves nothing. None for other blocks."""
    if ctx.spec.moe_router != "sigmoid_every_expert" or not ctx.output_needs_grad(1):
        return []
    grad = not ctx.setup.grad_checkpointing
    *in_experts, summed = every_expert_moe_peaks(ctx, grad)
    everything = saved_allocations(saved, tokens, (), False) if grad else []
    before_shared = saved_allocations(saved, tokens, (SHARED_EXPERT,), False) if grad else []
    points = [[*before_shared, *(tokens * b for b in held)] for held in in_experts]
    points.append([*everything, *(tokens * b for b in summed)])
    points = [[blocks(n) for n in point] for point in points]
    copies = layer_autocast_copies(ctx.spec, ctx, blocks)
    if copies is not None:  # the router's and gate_up's copies, then down's, then the rest
        router, gate_up, _, _, down, _ = copies[1]
        made = [[router, gate_up]] * (len(points) - 2) + [[router, gate_up, down]]
        points = [p + m for p, m in zip(points, [*made, copies[1]], strict=True)]
    return points


def rope_table_bytes(
    spec: ModelSpec,
    width: int,
    setup: TrainSetup,
    dtypes: DtypePlan,
    blocks: Callable[[float], int],
) -> int:
    """Bytes of one rotary table of `width` rotated dims: cos and sin as wide (fp32 under
    autocast and where the family computes them in fp32, else the residual's dtype), half as
    wide for gpt-oss, or Llama 4's one complex64 cos + i sin of width / 2 frequencies."""
    if spec.rope_complex:
        return blocks(setup.seq * width // 2 * 2 * FP32)
    rope_dtype = FP32 if dtypes.autocast or spec.rope_in_fp32 else dtypes.residual
    # gpt-oss's tables hold one angle per rotated pair, applied to both halves
    halved = 2 if spec.rope_half_tables else 1
    rows = setup.batch if spec.rope_per_batch_row else 1  # Qwen3.5's per-row position grids
    return 2 * blocks(rows * setup.seq * width // halved * rope_dtype)


def layer_kind(ctx: LayerContext) -> tuple[bool | int, ...]:
    """What makes layers save different tensors: a sliding window, an input that needs no
    gradient (the first layer under LoRA), RoPE applied or not, a MoE or a dense MLP, chunked
    attention, the layer's attention geometry (Gemma 4's global layers)."""
    geometry = ctx.spec.head_dim, ctx.spec.num_key_value_heads, ctx.spec.values_from_keys
    geometry += (ctx.spec.deltanet,)
    return ctx.sliding, ctx.needs_input_grad, ctx.rope, ctx.moe, ctx.chunked, *geometry


def rope_tables_kept(spec: ModelSpec, contexts: list[LayerContext]) -> list[int]:
    """The width (rotated dims) of each cos/sin pair saved for backward: none where no layer
    that rotates saves its rotation (SmolLM3's NoPE layers only; Llama 4's first layer under
    LoRA, the only one that rotates in a short model). With one pair per layer type (OLMo 3,
    Gemma 4, whose global layers rotate their own head dim), a type's pair is saved where a
    layer of that type saves its rotation (not the first layer under LoRA when neither q nor k
    needs a gradient there), else freed when the forward returns."""
    rotating = [ctx for ctx in contexts if ctx.rope]
    if not any(rotation_saved(ctx) for ctx in rotating):
        return []
    if spec.rope_tables == 1 or spec.layer_types is None:
        return [rotating[0].spec.rotated_dim] * spec.rope_tables
    kept = {ctx.sliding: ctx.spec.rotated_dim for ctx in rotating if rotation_saved(ctx)}
    return list(kept.values())


def checkpointed_masks(
    setup: TrainSetup, dtypes: DtypePlan, contexts: list[LayerContext]
) -> list[tuple[int, int]]:
    """The attention masks checkpointed layers keep (as inputs of their recomputation) from the
    forward to their backward: SDPA's (seq x seq) bool mask, expanded over the batch, for the
    sliding layers once the sequence reaches the window (causal layers pass none); eager
    attention's additive (batch x seq x seq) mask in the residual dtype, one per layer type.
    Each with the lowest layer that reads it: its checkpoint releases the mask last."""
    if not setup.grad_checkpointing:
        return []
    if any(ctx.chunked for ctx in contexts):  # Llama 4's, each with the first layer that reads it
        masks = chunked_model_masks(setup, dtypes, contexts)
        return list(zip(masks, chunked_mask_readers(setup, contexts), strict=True))
    seq = setup.seq
    if setup.attn == "eager":
        first: dict[bool, int] = {}
        for index, ctx in enumerate(contexts):
            first.setdefault(ctx.sliding, index)
        return [(setup.batch * seq * seq * dtypes.residual, index) for index in first.values()]
    masked = [index for index, ctx in enumerate(contexts) if attention_masked(ctx)]
    return [(seq * seq, masked[0])] if masked else []


def loss_saved_bytes(spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan) -> int:
    hf_loss = not {"flce", "cross_entropy"} & set(setup.kernels)
    copy = lm_head_weight_copy(spec, dtypes) if hf_loss else 0
    return sum(loss_saved_entries(spec, setup, dtypes)) + copy


def lm_head_weight_copy(spec: ModelSpec, dtypes: DtypePlan) -> int:
    """Under autocast the lm_head matmul keeps its low-precision weight copy for its backward."""
    return spec.vocab_size * spec.hidden_size * dtypes.proj if dtypes.autocast else 0


def loss_saved_entries(spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan) -> list[int]:
    """What the loss saves for backward, one allocation each, in the order they are made; with
    Hugging Face's loss, not lm_head's weight copy (lm_head_weight_copy)."""
    tokens = setup.batch * setup.seq
    logits = tokens * spec.vocab_size
    kernels = set(setup.kernels)
    if "flce" in kernels:
        dx = kc.flce_saved_bytes(tokens, spec.hidden_size, spec.vocab_size, dtypes.proj, False)
        dw = spec.vocab_size * spec.hidden_size * dtypes.proj if not setup.lora_rank else 0
        return [n for n in (dx, dw) if n]
    if "cross_entropy" in kernels:  # the logits' gradient, in a buffer of its own
        gradient = kc.cross_entropy_saved_bytes(tokens, spec.vocab_size, dtypes.proj, False)
        return [n for n in (lm_head_weight_copy(spec, dtypes), gradient) if n]
    softcap = logits * dtypes.proj if spec.final_logit_softcapping else 0
    # log_softmax's output, the targets, nll_loss's total weight.
    return [n for n in (softcap, tokens * INT64, logits * FP32, FP32) if n]


@dataclass
class Walk:
    """One step's timeline: allocated bytes by category at each marked point. A transient of a
    point is allocated just before it and freed just after, so it counts in that point only."""

    points: list[tuple[str, str, int]] = field(default_factory=list)
    snapshots: list[dict[str, int]] = field(default_factory=list)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.points)), key=lambda i: self.points[i][2])

    @property
    def peak(self) -> int:
        return self.points[self.peak_index][2]

    def breakdown(self, index: int) -> dict[str, int]:
        return {k: v for k, v in self.snapshots[index].items() if v}

    def timeline(self) -> list[TimelinePoint]:
        return [
            TimelinePoint(phase=phase, label=label, allocated_bytes=nbytes)
            for phase, label, nbytes in self.points
        ]


class StepBuilder:
    """Keeps, for the step being walked, the allocated bytes by category (each allocation
    rounded as the allocator rounds it) at every marked point and, when `record`, writes every
    allocation and free to an EventLog for the allocator model."""

    def __init__(self, record: bool = True) -> None:
        self.log = EventLog()
        self.record = record
        self.alive: dict[str, int] = {}
        self.walk = Walk()
        self.phase, self.label = "start", "build"
        self._sizes: dict[int, tuple[int, str]] = {}
        self._next = 0

    def begin_step(self) -> Walk:
        self.walk = Walk()
        return self.walk

    def alloc(self, category: str, nbytes: int, stream: int = 0) -> int | None:
        """An allocation of `nbytes` (None for nothing) on `stream` (0: the default)."""
        if nbytes <= 0:
            return None
        self.alive[category] = self.alive.get(category, 0) + -(-int(nbytes) // 512) * 512
        if self.record:
            return self.log.alloc(int(nbytes), category, self.phase, self.label, stream)
        self._next += 1
        self._sizes[self._next] = (int(nbytes), category)
        return self._next

    def size_of(self, tensor: int) -> tuple[int, str]:
        return self.log.size_of(tensor) if self.record else self._sizes[tensor]

    def alloc_all(self, category: str, sizes: Iterable[int]) -> list[int]:
        """One allocation per size; without `record`, one for them all (only sums are kept)."""
        if self.record:
            return [t for t in (self.alloc(category, n) for n in sizes) if t is not None]
        total = sum(-(-int(n) // 512) * 512 for n in sizes if n > 0)
        tensor = self.alloc(category, total)
        return [] if tensor is None else [tensor]

    def free(self, tensor: int | None) -> None:
        if tensor is None:
            return
        nbytes, category = self.size_of(tensor)
        self.alive[category] -= -(-nbytes // 512) * 512
        if self.record:
            self.log.free(tensor, self.phase, self.label)
        else:
            del self._sizes[tensor]

    def free_all(self, tensors: Iterable[int | None]) -> None:
        for tensor in list(tensors):
            self.free(tensor)

    def retag(self, tensor: int, category: str) -> int:
        """Count a live allocation under another category (a saved output handed on as a
        gradient)."""
        nbytes, old = self.size_of(tensor)
        self.alive[old] -= round_block(nbytes)
        self.alive[category] = self.alive.get(category, 0) + round_block(nbytes)
        if self.record:
            self.log.retag(tensor, category)
        else:
            self._sizes[tensor] = (nbytes, category)
        return tensor

    def at(self, phase: str, label: str) -> None:
        self.phase, self.label = phase, label

    def mark(
        self, phase: str, label: str, transient: Iterable[int] = (), what: str = "transient"
    ) -> None:
        """Record a point of the timeline with `transient` allocations alive at it."""
        self.at(phase, label)
        held = self.alloc_all(what, transient)
        allocated = sum(self.alive.values())
        self.walk.points.append((phase, label, allocated))
        self.walk.snapshots.append(dict(self.alive))
        self.free_all(reversed(held))


# A kernel's scratch in backward: the tensors alive beside it (a weight gradient's summand),
# then its blocks in allocation order (a nested list: one launch of several, kernel_scratch).
ScratchSum = tuple[list[int], list]


@dataclass(frozen=True)
class StepSizes:
    """Every byte count the walk needs, computed once; lists are one allocation per entry."""

    counts: ParamCounts
    param_bytes: int
    trainable: int
    # Per trainable tensor, the optimizer states it gets at the first step.
    state_tensors: list[list[int]]
    step_temp_tensors: list[int]
    workspace: int
    saved: ForwardSaved
    loss_entries: list[int]
    lm_head_copy: int  # lm_head_weight_copy
    residual: int
    final_norm_fp32: int  # the final norm's fp32 product, alive beside its saved tensors
    logits_p: int
    logits_fp32: int
    grad_hidden: int
    lm_head_grad: int
    layer_fwd_transient: list[list[int]]  # per layer
    kv_cache: list[list[int]]  # per layer, the cache's keys and values attention does not save
    # per layer, what the model keeps of its k and v (ModelSpec.kv_kept_layers)
    kept_kv: list[KeptKv]
    autocast_cache: int
    mlp_bwd_transient: list[list[int]]  # per layer
    # per layer, the grouped experts' backward start (grouped_experts.experts_backward_start),
    # before the MLP's weight gradients exist; None elsewhere
    moe_bwd_start: list[list[int] | None]
    # gpt-oss's experts: their backward's peak less what the layer saved after attention (the
    # MLP mark then frees those first and holds this beside them); None: the MLP rule above.
    clamped_moe_bwd_delta: int | None
    # gpt-oss: the peak inside a layer's forward beyond its saved tensors, in the forward (with
    # the layer's input alive in the caller); per layer, in a checkpointed layer's recomputation
    # (gpt-oss's, or grouped-matmul experts': grouped_experts.recomputed_experts_peak), or None.
    layer_fwd_peak_delta: int | None
    recomputed_peak_delta: list[int | None]
    attention_bwd_transient: list[list[int]]  # per layer
    # the layer whose backward autotunes a kernel at step 1 (fla_autotuned_layer), or None
    autotuned_layer: int | None
    # per layer, the attention backward as a program where it materializes scores (its saved
    # tensors freed by name), else empty: attention_bwd_transient's mark instead
    attention_bwd_steps: list[list[BackwardStep]]
    gradients: list[LayerGradients]  # per layer, its weights' gradients (layer_gradients)
    flce_autocast_copies: list[int]
    flce_steps: list[tuple[str, str, int]]
    flce_grads_to_fp32: list[int]
    # CUDA kernels' scratch in backward (kernel_scratch): per layer, the sums after the MLP's
    # backward and after attention's; the final norm's; the embedding backward's.
    layer_bwd_scratch: list[tuple[list[ScratchSum], list[ScratchSum]]] = field(default_factory=list)
    final_norm_scratch: list[ScratchSum] = field(default_factory=list)
    embedding_scratch: ScratchSum = ([], [])

    @property
    def states(self) -> int:
        return sum(round_block(n) for tensor in self.state_tensors for n in tensor)


def optimizer_tensors(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, layout: OneGpu
) -> tuple[list[list[int]], list[int]]:
    """Per trainable tensor of this rank the bytes of its optimizer states on the GPU, and the
    step's temporaries alive at once: torch's foreach AdamW keeps one sqrt(exp_avg_sq) per
    tensor, the fused one none, Adafactor (one tensor at a time) the largest tensor's estimate;
    none of either when the optimizer steps on the CPU (offload)."""
    if layout.optimizer_on_host():
        return [], []
    lora = bool(setup.lora_rank)
    element = layout.state_element(FP32 if lora else dtypes.param)
    tensors = layout.local_trainable(trainable_tensors(spec, setup))
    if setup.optimizer == "adamw-8bit":  # updated in place by one kernel per tensor
        return bnb_8bit_states(tensors), []
    state_elems, temp_elems = OPTIMIZER_STATES[setup.optimizer]
    # states take each tensor's dtype: an fp32-kept router's on one GPU (router_weights_fp32)
    widths = [element] * len(tensors)
    if router_weights_fp32(spec, setup) and not lora:
        widths = trained_vision_tower_widths(spec, setup, element) + text_widths(
            spec, element, True
        )
    states = [[n * w] * int(state_elems) for n, w in zip(tensors, widths, strict=True)]
    if setup.optimizer in PER_TENSOR_STEP:
        largest = (
            max(tensors, default=0) if setup.distributed else largest_trainable_tensor(spec, setup)
        )
        return states, [largest * element]
    return states, [n * w for n, w in zip(tensors, widths, strict=True)] if temp_elems else []


def host_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """CPU memory per rank under CPU offload: what the strategy keeps there and the optimizer's
    states, as they would be on the GPU without offload (0 without offload)."""
    layout = layout_for(spec, setup)
    if not layout.optimizer_on_host():
        return 0
    on_gpu = layout_for(spec, setup.model_copy(update={"cpu_offload": False}))
    states, _ = optimizer_tensors(spec, setup, DtypePlan.of(setup.precision), on_gpu)
    return layout.host_bytes() + sum(n for tensor in states for n in tensor)


def router_weights_fp32(spec: ModelSpec, setup: TrainSetup) -> bool:
    """The release keeps a DeepSeek-style router's weight in fp32 in a bf16 model (under fp32
    weights and amp's it is fp32 anyway)."""
    return Release.of(setup.transformers).router_weight_in_fp32(spec.model_type)


def text_widths(spec: ModelSpec, param_bytes: int, router_fp32: bool) -> list[int]:
    """Bytes per element of each text-model parameter, in registration order."""
    tensors = param_tensors(spec)
    sizes = tensors.bytes_in_order(spec.num_hidden_layers, param_bytes, router_fp32)
    return [
        size // n if n else param_bytes
        for size, n in zip(sizes, tensors.in_order(spec.num_hidden_layers), strict=True)
    ]


def trained_vision_tower_widths(spec: ModelSpec, setup: TrainSetup, element: int) -> list[int]:
    return [element] * len(trained_vision_tower(spec, setup))


def step_sizes(spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None, backend: str) -> StepSizes:
    weights = DtypePlan.of(setup.precision)  # weights, their gradients, optimizer states
    states, step_temp = optimizer_tensors(spec, setup, weights, layout_for(spec, setup))
    under_autocast = runs_under_autocast(setup)
    gradients = [
        layer_gradients(spec.layer(index), setup, weights.param, index)
        for index in range(spec.num_hidden_layers)
    ]
    setup = computed_setup(setup)  # activations, as the step computes them
    dtypes = DtypePlan.of(setup.precision)
    counts = count_params(spec)
    lora = bool(setup.lora_rank)
    n_lora = lora_params(spec, setup)
    tokens = setup.batch * setup.seq
    h, p = spec.hidden_size, dtypes.proj
    budget = setup.flce_memory_budget
    if budget is not None:
        chunk = kc.flce_chunk_for_budget(tokens, h, spec.vocab_size, p, budget, not lora)
    else:
        chunk = setup.flce_chunk or kc.flce_default_chunk(tokens, h, spec.vocab_size)
    # Under autocast FLCE casts the fp32 hidden states and lm_head weight to bf16 copies.
    autocast_copies = [tokens * h * p, spec.vocab_size * h * p] if dtypes.autocast else []
    contexts = layer_contexts(spec, setup, dtypes, backend, under_autocast)
    device = cuda_device(gpu)
    return StepSizes(
        counts=counts,
        param_bytes=weights.param,
        trainable=n_lora if lora else counts.total + sum(trained_vision_tower(spec, setup)),
        state_tensors=states,
        step_temp_tensors=step_temp,
        workspace=cublas_workspace_bytes(gpu),
        saved=forward_saved(spec, setup, backend, under_autocast=under_autocast),
        loss_entries=loss_saved_entries(spec, setup, dtypes),
        lm_head_copy=lm_head_weight_copy(spec, dtypes),
        residual=round_block(tokens * h * dtypes.residual),
        final_norm_fp32=final_norm_fp32(tokens * h, dtypes.residual, setup.kernels),
        logits_p=round_block(tokens * spec.vocab_size * p),
        logits_fp32=round_block(tokens * spec.vocab_size * FP32),
        grad_hidden=round_block(tokens * h * p),
        lm_head_grad=0 if lora else round_block(spec.vocab_size * h * weights.param),
        # Raw q, k, v before RoPE and its rotate_half temporaries (latent attention: q, k and
        # kv_b_proj's output), plus the residual pair.
        layer_fwd_transient=[
            deltanet_forward_transient(ctx, tokens)
            if ctx.spec.deltanet
            else raw_qkv(ctx, tokens) + [tokens * dtypes.residual * h] * 2
            for ctx in contexts
        ],
        # Adapters' weights under LoRA, else every layer's matmul weights (lm_head's copy is
        # saved by its matmul, counted with the loss).
        autocast_cache=round_block((n_lora if lora else layers_autocast_weight_params(spec)) * p)
        if dtypes.autocast
        else 0,
        kv_cache=kv_cache_added(spec, setup, dtypes, backend, under_autocast),
        kept_kv=kept_kv(spec, setup, dtypes, backend, under_autocast),
        mlp_bwd_transient=[
            mlp_backward_transient(spec, setup, dtypes, spec.moe_layer(index))
            for index in range(spec.num_hidden_layers)
        ],
        moe_bwd_start=[experts_backward_start(ctx, tokens) for ctx in contexts],
        clamped_moe_bwd_delta=clamped_moe_backward_delta(spec, setup, dtypes, weights.param)
        if spec.num_experts and moe_rules(spec).clamped_glu
        else None,
        layer_fwd_peak_delta=sink_layer_forward_peak(spec, setup, dtypes, backend, False)
        if spec.attention_sinks and setup.attn == "eager"
        else None,
        recomputed_peak_delta=[sink_layer_forward_peak(spec, setup, dtypes, backend, True)]
        * spec.num_hidden_layers
        if spec.attention_sinks and setup.attn == "eager"
        else [recomputed_experts_peak(ctx, tokens) for ctx in contexts],
        # A fused kernel's backward holds dq, dk, dv and an fp32 dq accumulator; memplan's sink
        # attention its kernel's; where attention materializes scores its program walks it
        # (attention_bwd_steps).
        attention_bwd_transient=[
            sink_kernel_backward_held(spec, setup, dtypes, backend, ctx.spec)
            if sink_kernel(ctx)
            else sink_attention_backward_held(spec, setup, dtypes, backend)
            if setup.attn == "eager" and spec.attention_sinks
            else deltanet_backward_transient(ctx, tokens)
            if ctx.spec.deltanet
            else (
                []
                if attention_path(ctx) == "scores"
                else attention_backward_transient(ctx.spec, tokens, p, cudnn_runs(ctx))
            )
            + ([tokens * p * h] if ctx.spec.attention_output_gate else [])
            for ctx in contexts
        ],
        autotuned_layer=fla_autotuned_layer(spec, setup),
        attention_bwd_steps=[
            scores_backward_steps(ctx, tokens, grads)
            for ctx, grads in zip(contexts, gradients, strict=True)
        ],
        gradients=gradients,
        flce_autocast_copies=autocast_copies,
        flce_steps=kc.flce_allocations(
            tokens, h, spec.vocab_size, p, chunk, not lora, budget_bytes=budget
        ),
        flce_grads_to_fp32=[tokens * h * FP32] + ([] if lora else [spec.vocab_size * h * FP32])
        if autocast_copies
        else [],
        layer_bwd_scratch=[
            layer_backward_scratch(ctx, tokens, weights.param, device) for ctx in contexts
        ],
        final_norm_scratch=[
            norm_weight_sum(spec, tokens, h, dtypes.residual, weights.param, device)
        ]
        if backend == "cuda" and not lora and spec.norm == "rms" and "rms_norm" not in setup.kernels
        else [],
        embedding_scratch=embedding_backward_scratch(spec, setup, tokens, backend),
    )


def cuda_device(gpu: Gpu | None) -> CudaDevice:
    """What the reductions' launch configuration reads of the GPU (None: an H100)."""
    return CudaDevice.of(gpu.sm_count if gpu else None, gpu.compute_capability if gpu else None)


def norm_weight_sum(
    spec: ModelSpec, rows: int, width: int, p_in: int, param: int, device: CudaDevice
) -> ScratchSum:
    """A Hugging Face RMSNorm's weight gradient: grad * normed (weight * h.to(dtype)'s product
    dtype; Gemma's in fp32) summed over its rows into a tensor of that dtype."""
    scalar = FP32 if gemma_norms(spec) else max(p_in, param)
    return [rows * width * scalar], sum_staging_blocks((rows, width), (0,), scalar, scalar, device)


def bias_sum(rows: int, width: int, p: int, device: CudaDevice) -> ScratchSum:
    """A Linear's bias gradient: its output's gradient summed over the tokens."""
    return [], sum_staging_blocks((rows, width), (0,), p, p, device)


def layer_backward_scratch(
    ctx: LayerContext, tokens: int, param: int, device: CudaDevice
) -> tuple[list[ScratchSum], list[ScratchSum]]:
    """The CUDA sums of a layer's trainable norms' weight gradients and biases' gradients, by
    where the walk runs them: after the MLP's backward (its biases, the norms between it and
    attention) and after attention's (its biases, the head norms, the input norm)."""
    spec, d = ctx.spec, ctx.dtypes
    if ctx.backend != "cuda" or not ctx.trainable_base:
        return [], []
    h, p = spec.hidden_size, d.proj
    hf_norm = spec.norm == "rms" and "rms_norm" not in ctx.kernels
    before_attention = 3 if spec.sandwich_norm else 2 if spec.post_norm else 1
    after_attention = 0 if spec.post_norm else 1
    mlp: list[ScratchSum] = []
    attention: list[ScratchSum] = []
    if spec.mlp_bias and not ctx.moe:  # down_proj's, then up_proj's and gate_proj's
        inter = spec.intermediate_size
        widths = [h] + ([2 * inter] if spec.fused_gate_up else [inter, inter])
        mlp += [bias_sum(tokens, w, p, device) for w in widths]
    if hf_norm:
        mlp += [norm_weight_sum(spec, tokens, h, d.residual, param, device)] * before_attention
    nh, kv, hd = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    if spec.attention_out_bias and not spec.deltanet:
        attention.append(bias_sum(tokens, h, p, device))
    if spec.qk_norm and hf_norm and not spec.mla:
        by_head = spec.qk_norm_scope == "head"
        attention += [  # k_norm's, then q_norm's
            norm_weight_sum(spec, tokens * n, hd, p, param, device)
            if by_head
            else norm_weight_sum(spec, tokens, n * hd, p, param, device)
            for n in (kv, nh)
        ]
    if spec.attention_bias and not spec.deltanet and not spec.mla:  # v's, k's, then q's
        attention += [bias_sum(tokens, w * hd, p, device) for w in (kv, kv, nh)]
    if hf_norm:
        attention += [norm_weight_sum(spec, tokens, h, d.residual, param, device)] * after_attention
    return mlp, attention


def embedding_backward_scratch(
    spec: ModelSpec, setup: TrainSetup, tokens: int, backend: str
) -> ScratchSum:
    """The embedding backward's scratch beside its gradient: CUDA's dense kernel's (sorted ids,
    segments, partial sums), or memplan's kernel's sort of the ids (its sorted ids and their
    positions, then the sort's iota and cub's storage)."""
    if backend != "cuda" or setup.lora_rank:
        return [], []
    if "embedding" in setup.kernels:
        return [tokens * INT64] * 2, sort_blocks(tokens)
    return [], embedding_backward_bytes(tokens, spec.hidden_size, spec.vocab_size)


def raw_qkv(ctx: LayerContext, tokens: int) -> list[int]:
    """The forward mark's raw q, k and v, each as wide as q (with RoPE's rotate_half
    temporaries); one block of their sum where one qkv_proj makes them (its views)."""
    sizes = [
        tokens * ctx.dtypes.proj * ctx.spec.num_attention_heads * w for w in qkv_widths(ctx.spec)
    ]
    return [sum(sizes)] if ctx.spec.fused_qkv else sizes


def qkv_widths(layer: ModelSpec) -> tuple[int, int, int]:
    """Per head, the widths of the three head-sized tensors a layer's attention makes before
    its core: q, k, v (head_dim each), or latent attention's q, k and kv_b_proj's output."""
    if layer.mla:
        return layer.head_dim, layer.head_dim, layer.qk_nope_dim + layer.value_dim
    return (layer.head_dim,) * 3


def scores_backward_steps(
    ctx: LayerContext, tokens: int, gradients: LayerGradients
) -> list[BackwardStep]:
    """A layer's attention backward as contracts.scores_attention_backward's program where it
    materializes scores (gpt-oss's sinks: sink_attention_backward_held); empty elsewhere.
    Where nothing before o_proj needs a gradient, o_proj's backward alone."""
    if attention_path(ctx) != "scores" or ctx.spec.attention_sinks or ctx.spec.deltanet:
        return []
    o_grads = gradients.attention[: gradients.attention_o]
    rest = gradients.attention[gradients.attention_o :]
    if not ctx.output_needs_grad(0):
        return [("grad", n) for n in gradients.attention]
    return scores_attention_backward(ctx, tokens, o_grads, rest)


def layers_autocast_weight_params(spec: ModelSpec) -> int:
    """The weights of every decoder layer (each as ModelSpec.layer sees it, a MoE layer's router
    and shared expert) that autocast caches a low-precision copy of."""
    return sum(
        autocast_weight_params(layer, moe=spec.moe_layer(index))
        for index, layer in enumerate(spec.layers())
    )


def final_norm_fp32(elements: int, residual_bytes: int, kernels: Iterable[str]) -> int:
    """The final HF RMSNorm's fp32 product (x * rstd, or Gemma's times 1 + weight), which it
    casts to the residual's dtype for its output: unsaved, alive until the cast. In fp32 the
    product is the output itself; memplan's kernel makes none."""
    if residual_bytes >= FP32 or "rms_norm" in kernels:
        return 0
    return round_block(elements * FP32)


def mlp_backward_transient(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, moe: bool
) -> list[int]:
    """MLP backward holds d(product), d(act) and d(up) at once: in a dense layer less the saved
    product, which down_proj's backward has freed where it trains (gate_proj's and up_proj's
    input gradients come after: traced step); a MoE layer's over its routed rows, plus the
    input gradients (memplan's GLU kernel writes d(gate) and d(up) over the saved gate and up,
    so only d(product) when the projections are separate)."""
    tokens, p, h = setup.batch * setup.seq, dtypes.proj, spec.hidden_size
    inter = spec.moe_intermediate_size * spec.num_experts_per_tok if moe else spec.intermediate_size
    glu_in_place = (
        GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act) in setup.kernels
        and not spec.fused_gate_up
        and not moe
    )
    if not moe and not glu_in_place:
        return [tokens * p * inter] * (3 - (not setup.lora_rank))
    return [tokens * p * inter] * (1 if glu_in_place else 3) + [tokens * p * h] * 2


def attention_backward_transient(
    layer: ModelSpec, tokens: int, p: int, cudnn: bool = False
) -> list[int]:
    """What one layer's (a ModelSpec.layer view) fused attention backward holds: dq, dk, dv and
    its scratch: cuDNN's workspace for an unmasked call (fp32 tensors of q's size, two with
    grouped KV heads and one without, an fp32 per query row and 512 bytes:
    traced/sdpa.backward_scratch_bytes), else an fp32 dq accumulator."""
    nh, kv, hd = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    vd = layer.value_dim  # latent attention's v heads are narrower than q's and k's
    dq, dk = tokens * p * nh * hd, tokens * p * kv * hd
    accumulator = tokens * FP32 * nh * hd
    q_sized = 2 if kv < nh else 1
    scratch = q_sized * accumulator + tokens * nh * FP32 + 512 if cudnn else accumulator
    return [dq, dk, tokens * p * kv * vd, scratch]


def cudnn_runs(ctx: LayerContext) -> bool:
    """cuDNN runs this layer's attention on the GPU (the fused path's kernel)."""
    return (
        ctx.backend == "cuda"
        and attention_path(ctx) == "fused"
        and fused_attention_kernel(ctx) == "cudnn"
    )


def kv_cache_dtypes(
    setup: TrainSetup, dtypes: DtypePlan, keys_in_residual_dtype: bool = True
) -> tuple[int, int]:
    """Bytes per element of a layer's KV cache keys and values. k takes the residual's dtype (fp32
    under autocast) where `keys_in_residual_dtype` (LayerContext.keys_in_residual_dtype: after
    HF's RoPE, not memplan's or OLMo's; in a layer without RoPE, after a Llama-cast k_norm
    only), the projection's otherwise; the values take the keys' dtype before transformers 5.24
    (the cache was made from the keys' dtype), their own (the projection's) after."""
    key = dtypes.residual if keys_in_residual_dtype else dtypes.proj
    value = key if Release.of(setup.transformers).kv_values_in_key_dtype else dtypes.proj
    return key, value


def kv_cache_tensors(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, keys_in_residual_dtype: bool = True
) -> tuple[int, int]:
    """The bytes of one layer's KV cache entries, keys then values (kv_cache_dtypes)."""
    elements = setup.batch * setup.seq * spec.num_key_value_heads * spec.head_dim
    key, value = kv_cache_dtypes(setup, dtypes, keys_in_residual_dtype)
    return round_block(elements * key), round_block(elements * value)


def kv_cache_added(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str, under_autocast: bool
) -> list[list[int]]:
    """Per layer, the cache tensors that are not also attention's saved inputs: what the cache
    adds to the forward's memory (contracts.kv_cache_shares_saved)."""
    added = []
    for ctx in layer_contexts(spec, setup, dtypes, backend, under_autocast):
        if spec.mla:
            added.append(latent_kv_cache_added(ctx))
            continue
        if ctx.spec.deltanet:
            added.append([round_block(n) for n in deltanet_cache_bytes(ctx)])
            continue
        tensors = kv_cache_tensors(ctx.spec, setup, dtypes, ctx.keys_in_residual_dtype)
        shared = kv_cache_shares_saved(
            ctx, *kv_cache_dtypes(setup, dtypes, ctx.keys_in_residual_dtype)
        )
        added.append([n for n, kept in zip(tensors, shared, strict=True) if not kept])
    return added


def latent_kv_cache_added(ctx: LayerContext) -> list[int]:
    """Latent attention's cache holds the latents, not k and v: the normed kv latent (its keys;
    fp32 under autocast, out of HF's norm, whose fp32 weight multiplies last, and memplan's)
    and the rotated shared key (its values, in cos/sin's dtype). kv_b_proj keeps the cache's
    latent as its input where it trains without autocast, or where an fp32 adapter on it takes
    it as it is; nothing keeps the rotated key (it is copied into k)."""
    spec, setup, d = ctx.spec, ctx.setup, ctx.dtypes
    tokens = setup.batch * setup.seq
    latent_bytes = rotated_bytes = d.residual if d.autocast else d.proj
    trained = ctx.trainable_base and not d.autocast
    adapted = ctx.adapted("kv_b_proj") and adapters_share_inputs(d) and bool(setup.lora_rank)
    kept = ctx.output_needs_grad(0) and (trained or adapted)
    latent = 0 if kept else round_block(tokens * spec.kv_lora_rank * latent_bytes)
    return [n for n in (latent, round_block(tokens * spec.rotated_dim * rotated_bytes)) if n]


@dataclass(frozen=True)
class KeptKv:
    """A layer's k and v as HF's attention keeps them in the model's shared_kv_states: those
    attention does not save and those it does (k after RoPE, v after v_norm, each in its own
    dtype), and what their autograd graph holds after a checkpointed recomputation."""

    unsaved: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    graph: list[int] = field(default_factory=list)


def kept_kv(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str, under_autocast: bool
) -> list[KeptKv]:
    """Per layer, KeptKv of the layers ModelSpec.kv_kept_layers names (memplan's attention
    keeps none)."""
    if not spec.kv_kept_layers or "rope" in setup.kernels:
        return [KeptKv()] * spec.num_hidden_layers
    kept = []
    tokens = setup.batch * setup.seq
    for index, ctx in enumerate(layer_contexts(spec, setup, dtypes, backend, under_autocast)):
        if index not in spec.kv_kept_layers:
            kept.append(KeptKv())
            continue
        layer = ctx.spec
        elements = tokens * layer.num_key_value_heads * layer.head_dim
        key = dtypes.residual if ctx.keys_in_residual_dtype else dtypes.proj
        sizes = (round_block(elements * key), round_block(elements * dtypes.proj))
        shared = kv_cache_shares_saved(ctx, key, dtypes.proj)
        graph = kv_path_saved(ctx, layer_saved(ctx))
        kept.append(
            KeptKv(
                unsaved=[n for n, kept in zip(sizes, shared, strict=True) if not kept],
                saved=[n for n, kept in zip(sizes, shared, strict=True) if kept],
                graph=[n for n in (round_block(int(p * tokens) + c) for p, c in graph) if n],
            )
        )
    return kept


def largest_trainable_tensor(spec: ModelSpec, setup: TrainSetup) -> int:
    """Elements of the largest trainable tensor: a LoRA factor (rank x the larger side), else
    the embedding, one projection matrix, transformers 5's stacked experts (one tensor of
    experts x 2 x moe_intermediate x hidden), or a trained vision tower's."""
    layers = spec.layers()
    if setup.lora_rank:
        shapes = [shape for layer in layers for shape in lora_shapes(layer, setup)]
        return max((setup.lora_rank * max(shape) for shape in shapes), default=0)
    h = spec.hidden_size
    heads = max(
        (layer.num_attention_heads + 2 * layer.num_key_value_heads) * layer.head_dim
        for layer in layers
    )
    if spec.mla:  # the largest latent projection, as elements per hidden row
        heads = max(rows * cols for _, rows, cols in latent_attention_tensors(spec)) // h
    dense = spec.intermediate_size * h * (2 if spec.fused_gate_up else 1)
    dense = max(dense, spec.shared_expert_intermediate_size * h)
    experts = spec.num_experts * 2 * spec.moe_intermediate_size * h
    tower = max(trained_vision_tower(spec, setup), default=0)
    return max(spec.vocab_size * h, dense, heads * h, experts, tower)


def sink_layer_forward_peak(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str, recomputed: bool
) -> int:
    """gpt-oss: the peak inside one layer's forward less what the layer saves (traced step), the
    higher of (a) the sink attention's subtraction of the row max: the masked scores, their
    concatenation with the sinks and the difference alive, (seq + 1)-wide, before the softmax
    output, o_proj's input and everything after attention are saved, and (b) the clamped gate:
    the gathered gate_up biases and the clamped up alive, the down output and the inverse
    permutation not yet saved (under LoRA also the block's input, the gathered rows, their
    expert ids and the gate's product, which frozen weights do not save). Residual-stream
    tensors alive: the layer's input (in the caller; the checkpoint holds it when `recomputed`)
    and, in the MoE, the sum after attention. Under autocast q, the repeated k and v also live
    in fp32 (RoPE's, the KV cache's) beside their saved casts; without the KV cache the
    unrepeated k and v are the attention's own. A recomputation runs beside the layer output's
    gradient expanded over the k routed rows, which autograd has copied by then, and under
    autocast beside that gradient in fp32, where the walk's running gradient is bf16."""
    nh, kv, hd, seq = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, setup.seq
    h, p, p_logits = spec.hidden_size, dtypes.proj, dtypes.residual
    tokens = setup.batch * seq
    ctx = layer_contexts(spec, setup, dtypes, backend)[-1]
    saved = layer_saved(ctx)
    residual = tokens * h * dtypes.residual
    later = saved.bytes_of(tokens, ("attn.probs", "attn.out") + AFTER_ATTENTION)
    later -= saved.bytes_of(tokens, (MLP_AUTOCAST_WEIGHTS,))  # counted below
    if dtypes.autocast:  # o_proj's and the router's weight copies are made after the scores
        later += p * h * (nh * hd + spec.num_experts)
    scores = tokens * nh * p_logits * (seq + 2 * (seq + 1) + 1)
    cached = not set(setup.kernels) & {"flce", "cross_entropy"} and not recomputed
    cached = cached and spec.use_cache and not setup.grad_checkpointing
    locals_ = 0
    if dtypes.autocast:
        v_bytes = values_bytes(spec, setup, dtypes, ctx)
        k_bytes = dtypes.residual if ctx.keys_in_residual_dtype else p
        locals_ += tokens * nh * hd * (k_bytes * 2 + v_bytes) if k_bytes != p else 0
    if not cached:
        locals_ += tokens * kv * hd * 2 * p
    attention = scores - later + locals_ + (0 if recomputed else residual)
    if sink_kernel(ctx):
        # memplan's sink attention: L - s and r beside O, nothing after attention made yet
        after = saved.bytes_of(tokens, AFTER_ATTENTION)
        attention = tokens * kc.sink_attention_forward_transient(nh, p) - after
        attention += 0 if recomputed else residual
    k, inter, p_e = spec.num_experts_per_tok, spec.moe_intermediate_size, dtypes.param
    biases = 2 * inter if moe_rules(spec).expert_biases else 0
    rows = tokens * k
    moe = rows * ((biases + inter) * p_e + 4 - h * p_e - INT64)
    if not ctx.trainable_base:  # alive though frozen experts and router save them not
        moe += rows * ((inter + h) * p_e + INT64) + tokens * h * p
    moe += residual * (1 if recomputed else 2)
    expanded_gradient = rows * h * dtypes.residual if recomputed else 0
    if recomputed:
        expanded_gradient += tokens * h * (dtypes.residual - p)
    return max(attention, moe) + expanded_gradient


def clamped_moe_backward_delta(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, grad_bytes: int
) -> int:
    """gpt-oss's MoE backward at its peak (traced step), beside what the layer saved after
    attention: the higher of (a) the down projection's backward done, three moe-wide gradients
    alive (of the product, up + 1 and the gate's sigmoid product) with the inverse permutation,
    the routing weights, the down output and the product freed, or (b) the gate_up projection's
    backward, its 2 x moe-wide input gradient and two hidden-wide ones alive, every saved expert
    tensor but the indices freed. The mark counts every gradient of the block: less those not
    yet written at that point (on one GPU)."""
    k, h, inter = spec.num_experts_per_tok, spec.hidden_size, spec.moe_intermediate_size
    e, p = spec.num_experts, dtypes.param
    tokens = setup.batch * setup.seq
    trained = 0 if setup.lora_rank else 1
    down_done = tokens * k * (3 * inter * p - INT64 - h * p - trained * inter * p)
    gate_up_done = -tokens * k * (INT64 + (4 + trained) * inter * p) - 4 * e
    if not trained or setup.distributed:
        return max(down_done, gate_up_done)
    rules = moe_rules(spec)
    router = e * h + (e if rules.router_bias else 0)
    gate_up_bias = e * 2 * inter if rules.expert_biases else 0
    down_done -= (router + e * h * 2 * inter + gate_up_bias) * grad_bytes
    gate_up_done -= (router + gate_up_bias) * grad_bytes
    return max(down_done, gate_up_done)


def sink_attention_backward_held(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str
) -> list[int]:
    """What gpt-oss's eager attention backward holds at its peak, the softmax's backward, beyond
    what the attention mark counts (the layer's saved tensors before attention, the softmax
    output among them, every gradient of the attention part): three (seq + 1)-wide tensors in
    the logits' dtype (the residual stream's), the softmax's input gradient (the sliced-off sink
    column padded back with zeros), the d(logits) it writes and grad * output, which CUDA's
    kernel forms beside it (cuda_scratch.softmax_backward_scratch_bytes), and the repeated v's
    gradient in v's dtype where that is not the saved v's (autocast's cast of the KV cache's
    fp32 values); less what is gone or not yet made by then: the probabilities' cast and
    o_proj's weight copy (autocast), o_proj's input and, on one GPU, the gradients q, k, v and
    the sinks get after it. The row max's backward after it holds less: its zeros, their
    scatter and the max gradient's sum, the input gradient and the softmax output freed."""
    nh, hd, seq, p = spec.num_attention_heads, spec.head_dim, setup.seq, dtypes.proj
    p_logits = dtypes.residual
    per_token = nh * 3 * (seq + 1) * p_logits
    ctx = layer_contexts(spec, setup, dtypes, backend)[-1]
    if p_logits != p:
        per_token -= nh * seq * p
        per_token += nh * hd * (values_bytes(spec, setup, dtypes, ctx) - p)
    if o_input_kept(ctx):
        per_token -= p * nh * hd
    held = setup.batch * seq * per_token
    if dtypes.autocast:
        held -= p * spec.hidden_size * nh * hd
    if not setup.distributed:
        held -= attention_gradients_after_core(spec, setup)
    return [held]


def sink_kernel_backward_held(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str, layer: ModelSpec
) -> list[int]:
    """What memplan's sink attention backward holds at its peak in one layer (a ModelSpec.layer
    view): kernel_contracts.sink_attention_backward_transient of the kernel it runs."""
    p = dtypes.proj
    kernel = kc.sink_attention_kernel(backend, p, layer.head_dim)
    return kc.sink_attention_backward_transient(
        setup.batch * setup.seq,
        setup.seq,
        layer.num_attention_heads,
        layer.num_key_value_heads,
        layer.head_dim,
        p,
        kernel,
    )


def values_bytes(spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, ctx: LayerContext) -> int:
    """Bytes per element of v as attention takes it: the KV cache's values where transformers
    builds one in training (walk_step: no loss kernel, no checkpointing), else v_proj's."""
    hf_loss = not {"flce", "cross_entropy"} & set(setup.kernels)
    if hf_loss and not setup.grad_checkpointing and spec.use_cache:
        return kv_cache_dtypes(setup, dtypes, ctx.keys_in_residual_dtype)[1]
    return dtypes.proj


def attention_gradients_after_core(spec: ModelSpec, setup: TrainSetup) -> int:
    """Bytes of the attention part's gradients written after its core's backward: all but
    o_proj's (weight and bias, or its adapter's two factors), which its backward writes first."""
    if setup.lora_rank:
        shapes = zip(layer_lora_targets(spec, setup), lora_shapes(spec, setup), strict=True)
        return sum(
            FP32 * setup.lora_rank * (fan_in + fan_out)
            for target, (fan_in, fan_out) in shapes
            if LORA_TARGET_STAGE[target] == 0
        )
    tensors = param_tensors(spec).attention
    o_proj = 2 if spec.attention_out_bias else 1
    return sum(tensors[:-o_proj]) * DtypePlan.of(setup.precision).param


@dataclass
class RunTensors:
    """The allocations that outlive one step: weights, gradients, optimizer states, the cuBLAS
    workspaces, the embedding leaf of checkpointed LoRA, and a strategy's own (DDP's buckets,
    FSDP2's sharded gradients by group)."""

    weights: list[int] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    gradients: list[int] = field(default_factory=list)
    workspaces: list[int] = field(default_factory=list)
    embedding_leaf: list[int] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)
    gradients_by_group: dict[str, int] = field(default_factory=dict)


def trainable_tensors(spec: ModelSpec, setup: TrainSetup) -> list[int]:
    """Elements of each trainable tensor, in model.parameters() order: the adapters' A and B
    of each adapted linear of each layer under LoRA, else every parameter (a trained vision
    tower's and projector's first, as the multimodal model registers them)."""
    if setup.lora_rank:
        return [
            n
            for layer in spec.layers()
            for fan_in, fan_out in lora_shapes(layer, setup)
            for n in (setup.lora_rank * fan_in, fan_out * setup.lora_rank)
        ]
    text = model_param_tensors(spec)
    return trained_vision_tower(spec, setup) + text


def counted_vision_tower(spec: ModelSpec, setup: TrainSetup) -> list[int]:
    """Elements of each vision tower and projector parameter the estimate holds: all of them
    when the setup counts the tower (TrainSetup.count_vision_tower), else none."""
    return list(spec.vision_tower_tensors) if setup.count_vision_tower else []


def trained_vision_tower(spec: ModelSpec, setup: TrainSetup) -> list[int]:
    """The vision tower and projector parameters that get gradients and optimizer states (none
    under LoRA, which freezes the base model)."""
    trained = setup.count_vision_tower == "trained" and not setup.lora_rank
    return list(spec.vision_tower_tensors) if trained else []


def build(
    builder: StepBuilder, spec: ModelSpec, setup: TrainSetup, sizes: StepSizes, layout: OneGpu
) -> RunTensors:
    """The model as the protocol builds it: every weight in registration order, then the LoRA
    adapters (fp32) that peft adds; under FSDP2 rank 0's shards; then what the strategy keeps
    from its preparation on (DDP's buckets)."""
    run = RunTensors()
    builder.at("start", "model build")
    # A multimodal model builds its vision tower and projector before the text model.
    elements = counted_vision_tower(spec, setup) + model_param_tensors(spec)
    adapters = trainable_tensors(spec, setup) if setup.lora_rank else []
    weights = layout.weight_tensors(elements, adapters, sizes.param_bytes)
    if router_weights_fp32(spec, setup):  # on one GPU only (parallel.strategies_modelled)
        text = param_tensors(spec).bytes_in_order(spec.num_hidden_layers, sizes.param_bytes, True)
        tower = [n * sizes.param_bytes for n in counted_vision_tower(spec, setup)]
        weights = tower + text + [n * FP32 for n in adapters]
    if spec.tie_word_embeddings and layout.builds_whole_model:
        made = len(weights) - len(adapters)
        run.weights = builder.alloc_all("weights", weights[:made])
        # nn.Linear makes lm_head's own weight last; post_init's tie_weights frees it
        builder.free(
            builder.alloc("transient", spec.vocab_size * spec.hidden_size * sizes.param_bytes)
        )
        run.weights += builder.alloc_all("weights", weights[made:])
    else:
        run.weights = builder.alloc_all("weights", weights)
    run.weights += builder.alloc_all("weights", model_buffers(spec))
    run.buffers = layout.prepare(builder, sizes.param_bytes, trainable_tensors(spec, setup))
    return run


def model_buffers(spec: ModelSpec) -> list[int]:
    """Bytes of the buffers the estimate counts with the weights: a DeepSeek-style router's fp32
    e_score_correction_bias (one per expert) in each MoE layer, whatever the weights' dtype."""
    router = FAMILIES[spec.model_type].config.moe
    if router is None or router.router != "sigmoid_fp32":
        return []
    moe_layers = sum(spec.moe_layer(i) for i in range(spec.num_hidden_layers))
    return [FP32 * spec.num_experts] * moe_layers


@dataclass(frozen=True)
class LayerGradients:
    """Bytes of the gradients one layer's backward writes, by the part whose backward writes
    them (each part's in reverse registration order)."""

    mlp: list[int]
    attention: list[int]  # o_proj's first
    norms: list[int]
    attention_o: int = 0  # how many of `attention` o_proj's backward writes


def layer_gradients(
    spec: ModelSpec, setup: TrainSetup, param_bytes: int, index: int = 0
) -> LayerGradients:
    """Layer `index`'s gradients (`spec`: its ModelSpec.layer view; `param_bytes` per element
    of a weight's gradient)."""
    if setup.lora_rank:
        adapters = [
            (target, n * FP32)
            for target, (fan_in, fan_out) in zip(
                layer_lora_targets(spec, setup), lora_shapes(spec, setup)
            )
            for n in (fan_out * setup.lora_rank, setup.lora_rank * fan_in)
        ]
        mlp = [n for t, n in reversed(adapters) if LORA_TARGET_STAGE[t] >= 2]
        o_proj = [n for t, n in reversed(adapters) if LORA_TARGET_STAGE[t] == 1]
        qkv = [n for t, n in reversed(adapters) if LORA_TARGET_STAGE[t] == 0]
        return LayerGradients(mlp=mlp, attention=o_proj + qkv, norms=[], attention_o=len(o_proj))
    tensors = param_tensors(spec)
    router_fp32 = router_weights_fp32(spec, setup)
    first = len(tensors.attention)
    mlp = [
        n * tensors.width_at(index, first + position, param_bytes, router_fp32)
        for position, n in enumerate(tensors.mlp_at(index))
    ]
    # registration order: ..., o_proj (and its bias), then q_norm and k_norm (but Gemma 4's)
    attention = [n * param_bytes for n in reversed(tensors.attention)]
    norms_after = 0 if spec.v_norm else len(qk_norm_widths(spec))
    o_proj = 2 if spec.attention_out_bias else 1
    o_first = attention[norms_after : norms_after + o_proj]
    return LayerGradients(
        mlp=mlp[::-1],
        attention=o_first + attention[:norms_after] + attention[norms_after + o_proj :],
        norms=[n * param_bytes for n in reversed(tensors.norms)],
        attention_o=o_proj,
    )


def walk_step(
    builder: StepBuilder,
    run: RunTensors,
    spec: ModelSpec,
    setup: TrainSetup,
    sizes: StepSizes,
    steady: bool,
    accumulating: bool = False,
    layout: OneGpu | None = None,
    sync: bool = True,
) -> Walk:
    """One micro-step's forward and backward. `accumulating`: a later micro-step of gradient
    accumulation, which starts with every gradient alive; each new gradient is then added into
    the one there (in place) and freed, instead of kept. `layout`: the strategy's allocations
    at each part of the model (parallel.py); `sync`: the micro-step reduces its gradients
    across ranks (accelerate skips that on all but the last micro-step)."""
    layout = layout or OneGpu(spec, setup)
    kernels = set(setup.kernels)
    saved = sizes.saved
    ckpt = setup.grad_checkpointing
    lora = bool(setup.lora_rank)
    walk = builder.begin_step()
    builder.at("start", "step start")
    if not run.workspaces:  # the forward thread's cuBLAS workspace, at its first matmul
        run.workspaces.append(builder.alloc("cublas_workspace", sizes.workspace))
    grad_bytes = layout.gradient_bytes(sizes.param_bytes)
    embedding_grad = 0 if lora else sizes.counts.embedding * grad_bytes
    final_norm_grad = 0 if lora else sizes.counts.final_norm * grad_bytes
    tied = spec.tie_word_embeddings

    def keep_gradients(group: str, part: str, *nbytes: int) -> list[int]:
        """The gradients made here, kept (or added into those kept already); returns them."""
        if layout.owns_gradients():
            layout.gradients(builder, group, part, run, accumulating)
            return []
        tensors = builder.alloc_all("gradients", nbytes)
        if accumulating:
            builder.free_all(tensors)  # added into the gradients already there
            return []
        run.gradients += tensors
        return tensors

    builder.mark("start", "weights + optimizer states")
    # Under checkpointing nothing saves the low-precision copies autocast caches of trainable
    # weights, but the cache holds them until the forward's autocast region ends; each is made
    # as its matmul first runs, layer by layer (layer_autocast_copies)
    by_layer = bool(saved.autocast_cache_by_layer)
    autocast_cache = builder.alloc(
        "autocast_cache", sizes.autocast_cache if ckpt and not by_layer else 0
    )
    cached_copies: list[int | None] = []

    hf_loss = "flce" not in kernels and "cross_entropy" not in kernels
    # memplan's loss divides the hidden states by Granite's logits_scaling (HF: the logits)
    hidden_scaled = not hf_loss and spec.logits_scaling not in (None, 1.0)
    # transformers builds a KV cache in training too, unless checkpointing turns it off or
    # memplan's causal-LM forward (patched with a loss kernel) does: every layer's k and v, held
    # by the model output until forward returns; memory of its own where attention saves others.
    cached = hf_loss and not ckpt and spec.use_cache
    layout.forward_enter(builder, "tail" if tied else "embedding")
    forward_kept = builder.alloc_all("activations", (saved.shared, saved.embedding))
    masks = [(builder.alloc("activations", n), layer) for n, layer in saved.checkpoint_masks]
    # peft's leaf under checkpointed LoRA is the embedding's output; where the model multiplies
    # that output, the leaf is a tensor of its own beside layer 0's input, from here on.
    leaf = None
    if ckpt and lora and spec.embedding_multiplier is not None:
        leaf = builder.alloc("embedding_leaf", sizes.residual)
    if not tied:
        layout.forward_exit(builder, "embedding")
    kv_cache: list[int] = []
    # k and v the model keeps (kept_kv): unsaved ones, or all of them in a checkpointed forward
    kv_kept: dict[int, list[int]] = {}
    layer_kept: list[tuple[list[int], list[int]]] = []  # saved before and after attention
    for index, (before, after) in enumerate(saved.layer_entries):
        kv_cache += builder.alloc_all("kv_cache", sizes.kv_cache[index] if cached else ())
        kept = sizes.kept_kv[index]
        if not cached:
            in_forward = kept.unsaved + (kept.saved if ckpt else [])
            kv_kept[index] = builder.alloc_all("activations", in_forward)
        layout.forward_enter(builder, f"layer {index}")
        attention_copies, moe_copies = (
            saved.autocast_cache_by_layer[index] if saved.autocast_cache_by_layer else ([], [])
        )
        cached_copies += [builder.alloc("autocast_cache", n) for n in attention_copies]
        transient = sizes.layer_fwd_transient[index]
        # checkpoint's saved-tensor hooks drop what a checkpointed layer saves: not held here
        builder.mark("forward", f"layer {index}", transient)
        # the model's forward holds its masks, and its embedding output past the first layer
        held_by_model = saved.forward_masks + saved.embedding_output * (index > 0)
        for held in saved.moe_peaks[index] if saved.moe_peaks else ():
            builder.mark("forward", f"layer {index}", held + held_by_model)
        cached_copies += [builder.alloc("autocast_cache", n) for n in moe_copies]
        if ckpt:  # down_proj's output is freed once the residual sum is made
            held_to_output = no_grad_forward(builder, saved, sizes, index)
            layer_kept.append((builder.alloc_all("activations", [sizes.residual]), []))
            builder.free_all(held_to_output)
        else:
            by_name = bool(sizes.attention_bwd_steps[index])
            programs = saved.forward_programs[index] if saved.forward_programs else {}
            names = saved.before_names[index]
            kept_before = alloc_saved(builder, before, by_name, names=names, programs=programs)
            layer_kept.append((kept_before, alloc_saved_after(builder, saved, index, after)))
            if saved.unsaved_experts and saved.unsaved_experts[index]:
                play_forward(builder, saved.unsaved_experts[index], list, [], marked=False)
            if sizes.layer_fwd_peak_delta is not None:
                builder.mark("forward", f"layer {index}", [sizes.layer_fwd_peak_delta])
        layout.forward_exit(builder, f"layer {index}")
    layout.forward_enter(builder, "tail")
    final_norm = builder.alloc("activations", saved.final_norm)
    builder.mark("forward", "final norm", [sizes.residual, sizes.final_norm_fp32])

    upcast = sizes.logits_fp32 if sizes.logits_p < sizes.logits_fp32 else 0
    # The final norm's output, the loss's input, is alive until forward returns; it counts here
    # where nothing saved it: FLCE, a frozen lm_head (LoRA), autocast (lm_head saves a copy), or
    # memplan's loss dividing it by logits_scaling (lm_head saves the quotient).
    autocast = DtypePlan.of(computed_setup(setup).precision).autocast
    unsaved = "flce" in kernels or lora or autocast or hidden_scaled
    norm_out = builder.alloc("activations", sizes.residual if unsaved else 0)
    # The divided hidden states, alive through the loss kernel; where lm_head keeps them (it
    # trains, without autocast) the final norm's saved output counts them.
    kept_by_lm_head = "cross_entropy" in kernels and not lora and not autocast
    scaled_bytes = sizes.residual if hidden_scaled and not kept_by_lm_head else 0
    if "flce" in kernels:
        builder.at("loss", "fused linear cross entropy")
        scaled = builder.alloc("logits_and_loss", scaled_bytes)
        copies = builder.alloc_all("logits_and_loss", sizes.flce_autocast_copies)
        loss_saved = play_flce(builder, sizes.flce_steps)
        builder.free_all(copies)
        builder.free(scaled)
    elif "cross_entropy" in kernels:
        builder.at("loss", "logits + cross-entropy kernel")
        scaled = builder.alloc("logits_and_loss", scaled_bytes)
        loss_saved = builder.alloc_all("logits_and_loss", sizes.loss_entries)
        builder.mark("loss", "logits + cross-entropy kernel")
        builder.free(scaled)
    else:
        # lm_head output (held by the model output until forward returns), its fp32 upcast,
        # then log_softmax's output and the shifted targets (saved.loss); the upcast is freed
        # once log_softmax has run.
        builder.at("loss", "logits, fp32 upcast, log_softmax")
        # autocast casts lm_head's weight before its matmul allocates the logits
        weight_copy = builder.alloc("logits_and_loss", sizes.lm_head_copy)
        logits = builder.alloc("logits_and_loss", sizes.logits_p)
        if spec.logits_scaling is not None:
            # logits / logits_scaling: lm_head's output is freed once the quotient is made
            builder.mark("loss", "logits / logits_scaling", [sizes.logits_p], "logits_and_loss")
        upcast_tensor = builder.alloc("logits_and_loss", upcast)
        loss_saved = builder.alloc_all("logits_and_loss", sizes.loss_entries)
        builder.mark("loss", "logits, fp32 upcast, log_softmax")
        builder.free(upcast_tensor)
        if setup.distributed and DtypePlan.of(setup.precision).autocast:
            # accelerate's autocast forward returns its floating outputs made fp32
            builder.mark("forward", "logits made fp32 by accelerate", [sizes.logits_fp32])
        builder.free(logits)
    builder.free(norm_out)
    builder.free_all(kv_cache)
    if not ckpt:
        builder.free_all([n for tensors in kv_kept.values() for n in tensors])
        kv_kept.clear()
    builder.free(autocast_cache)
    builder.free_all(cached_copies)
    layout.forward_end(builder)
    if not accumulating:  # the previous step's graph, held by its loss until this forward ends
        builder.free_all(run.embedding_leaf)
        run.embedding_leaf = []
    builder.mark("forward", "end of forward")

    if "flce" in kernels:  # FLCE's forward hook sits on the loss: the tail's pre-backward is first
        layout.backward_enter(builder, "tail")
    if hf_loss:
        # nll_loss backward writes a dense fp32 gradient; log_softmax backward another.
        builder.at("backward", "loss backward")
        nll_grad = builder.alloc("logits_and_loss", sizes.logits_fp32)
        softmax_grad = builder.alloc("logits_and_loss", sizes.logits_fp32)
        builder.mark("backward", "loss backward")
        builder.free(nll_grad)
        builder.free_all(loss_saved)
        to_model_dtype = sizes.logits_p if upcast else 0
        builder.at("backward", "logits gradient")
        logits_grad = builder.alloc("logits_and_loss", to_model_dtype)
        builder.mark("backward", "logits gradient")
        if logits_grad is not None:
            builder.free(softmax_grad)
        else:
            logits_grad = softmax_grad
        if spec.final_logit_softcapping:
            builder.mark(
                "backward", "softcap backward", [sizes.logits_p, sizes.logits_p], "logits_and_loss"
            )
        if spec.logits_scaling is not None:
            builder.mark("backward", "logits_scaling backward", [sizes.logits_p], "logits_and_loss")
        # lm_head's backward reads its weight copy: freed with the logits' gradient after it
        loss_saved = [t for t in (logits_grad, weight_copy) if t is not None]
    if "flce" not in kernels:  # the pre-backward hook on lm_head's output, the logits
        layout.backward_enter(builder, "tail")
    builder.at("backward", "lm_head backward")
    lm_head_part = "embedding" if tied else "lm_head"
    lm_head_grads: list[int] = []
    if "flce" in kernels and not sizes.flce_grads_to_fp32:
        # FLCE computed dX and dW in its forward; backward hands them on as they are.
        grad_hidden = builder.retag(loss_saved[0], "transient")
        if len(loss_saved) > 1:
            if accumulating:
                builder.free(loss_saved[1])  # added into the gradient already there
            elif layout.owns_gradients():
                layout.adopt_gradient(builder, "tail", lm_head_part, loss_saved[1])
            else:
                run.gradients.append(builder.retag(loss_saved[1], "gradients"))
    else:
        if "flce" in kernels:  # under autocast dX and dW are cast to the fp32 inputs' dtype
            builder.mark("backward", "FLCE gradients cast to fp32", sizes.flce_grads_to_fp32)
        lm_head_grads = keep_gradients("tail", lm_head_part, sizes.lm_head_grad)
        # lm_head's backward matmuls are the autograd thread's first (not FLCE's backward)
        if lm_head_grads and "flce" not in kernels:
            start_autograd_workspace(builder, run, sizes.workspace)
        grad_hidden = builder.alloc("transient", sizes.grad_hidden)
        if "flce" not in kernels:
            start_autograd_workspace(builder, run, sizes.workspace)
        builder.mark("backward", "lm_head backward")
        builder.free_all(loss_saved)
    if hidden_scaled:  # the gradient divided by logits_scaling, a new tensor beside the first
        builder.mark("backward", "logits_scaling backward", [sizes.residual])
    play_scratch(builder, "final norm backward", sizes.final_norm_scratch)
    builder.free(final_norm)
    if layout.owns_gradients():
        keep_gradients("tail", "final_norm")
        layout.backward_exit(builder, "tail", run, sync)

    # down_proj's input gradient, the frozen MLP's first matmul output in a layer's backward,
    # comes before the workspace its matmul makes (a checkpointed layer recomputes first)
    down_first = lora and not ckpt and "down_proj" not in layer_lora_targets(spec, setup)
    if not down_first:
        start_autograd_workspace(builder, run, sizes.workspace)
    for index in reversed(range(len(saved.layer_entries))):
        gradients = sizes.gradients[index]
        label = f"layer {index} backward"
        checkpoint_input: list[int] = []
        builder.at("backward", label)
        layout.backward_enter(builder, f"layer {index}")
        recomputed_kv: list[int] = []
        if ckpt:  # the recomputed forward's saved tensors, alive through the layer's backward
            checkpoint_input = layer_kept[index][0]
            # the recomputation's k and v replace the forward's in shared_kv_states
            builder.free_all(kv_kept.pop(index, []))
            recomputed_kv = builder.alloc_all("activations", sizes.kept_kv[index].unsaved)
            recomputed_before, recomputed_after = saved.recomputed_entries[index]
            by_name = bool(sizes.attention_bwd_steps[index])
            layer_kept[index] = (
                alloc_saved(
                    builder,
                    recomputed_before,
                    by_name,
                    "transient",
                    saved.recomputed_before_names[index],
                    saved.forward_programs[index] if saved.forward_programs else {},
                ),
                alloc_saved_after(builder, saved, index, recomputed_after, "transient"),
            )
            if sizes.recomputed_peak_delta[index] is not None:
                builder.mark("backward", label, [sizes.recomputed_peak_delta[index]])
        # The MLP's backward runs first, writing its weights' gradients among its temporaries;
        # by attention's, what the layer saved after attention is freed.
        kept_before, kept_after = layer_kept[index]
        scratch = sizes.layer_bwd_scratch[index] if sizes.layer_bwd_scratch else ([], [])
        for part, nbytes, transient, kept in (
            ("mlp", gradients.mlp, sizes.mlp_bwd_transient[index], kept_after),
            (
                "attention",
                gradients.attention,
                attention_transient(sizes, index, steady),
                kept_before,
            ),
        ):
            builder.at("backward", label)
            if part == "mlp" and saved.mlp_backward and saved.mlp_backward[index]:
                names = saved.after_names[index]
                program = saved.mlp_backward[index]
                kept_here = None if layout.owns_gradients() else run.gradients
                grads = play_backward(builder, program, names, kept, label, accumulating, kept_here)
                keep_gradients(f"layer {index}", part, *grads)
                play_scratch(builder, label, scratch[part == "attention"])
                continue
            if part == "attention" and sizes.attention_bwd_steps[index]:
                names = (saved.recomputed_before_names if ckpt else saved.before_names)[index]
                program = sizes.attention_bwd_steps[index]
                grads = play_backward(builder, program, names, kept, label, accumulating)
                keep_gradients(f"layer {index}", part, *grads)
                play_scratch(builder, label, scratch[part == "attention"])
                continue
            start = sizes.moe_bwd_start[index]
            if part == "mlp" and start is not None:
                builder.mark("backward", label, start)
            delta = sizes.clamped_moe_bwd_delta
            if part == "mlp" and delta is not None and spec.moe_layer(index):
                kept_bytes = sum(builder.size_of(t)[0] for t in kept)
                builder.free_all(kept)
                kept = []
                transient = [max(0, kept_bytes + delta)]
            held = builder.alloc_all("transient", transient[:1])
            start_autograd_workspace(builder, run, sizes.workspace)
            held += builder.alloc_all("transient", transient[1:])
            keep_gradients(f"layer {index}", part, *nbytes)
            builder.mark("backward", label)
            builder.free_all(held)
            builder.free_all(kept)
            play_scratch(builder, label, scratch[part == "attention"])
        start_autograd_workspace(builder, run, sizes.workspace)  # where no part made it
        keep_gradients(f"layer {index}", "norms", *gradients.norms)
        builder.free_all(checkpoint_input)
        builder.free_all([mask for mask, layer in masks if layer == index])
        if ckpt:  # shared_kv_states holds what the recomputation saved on the path of k and v
            kept = sizes.kept_kv[index]
            recomputed_kv += builder.alloc_all("activations", kept.saved + kept.graph)
            kv_kept[index] = recomputed_kv
        layout.backward_exit(builder, f"layer {index}", run, sync)
    builder.free_all(forward_kept)
    builder.free_all([n for tensors in kv_kept.values() for n in tensors])
    builder.free(grad_hidden)
    if trained_vision_tower(spec, setup):
        # The tower's nodes come after the embedding lookup in forward, so autograd runs them
        # first: its gradients, in reverse registration order, before the embedding's.
        builder.at("backward", "vision tower backward")
        tower = reversed(trained_vision_tower(spec, setup))
        keep_gradients("vision tower", "vision tower", *(n * grad_bytes for n in tower))
    if ckpt and lora:
        # peft makes the frozen embedding's output a leaf that requires grad: the step's graph
        # keeps it and, after backward, its gradient, until the next step's forward returns.
        kept = [leaf] if leaf is not None else builder.alloc_all("embedding_leaf", [sizes.residual])
        run.embedding_leaf += kept + builder.alloc_all("embedding_leaf", [sizes.residual])
    if not lora:
        builder.at("backward", "embedding backward")
        if not tied:
            layout.backward_enter(builder, "embedding")
        scratch = [sizes.embedding_scratch]  # made beside the embedding's gradient
        if tied and lm_head_grads and "flce" not in kernels:
            # autograd's input buffer adds the embedding's gradient to lm_head's out of place
            # (to FLCE's fp32 dW in place, as the elif below does)
            sum_tied_gradients(builder, run, lm_head_grads[0], embedding_grad, scratch)
        elif tied:
            # The tied weight's two gradients meet here. One lm_head gradient from autograd
            # (no FLCE) plus the embedding's make a third tensor, their sum; FLCE's dW is summed
            # in place. Measured on an H200 (qwen2.5-1.5b, batch 1 x 256, SGD with momentum and
            # Adafactor, whose peak falls here): one more vocab x hidden gradient without FLCE.
            copies = 1 if "flce" in kernels else 2
            grads = builder.alloc_all("transient", [embedding_grad] * copies)
            play_scratch(builder, "embedding backward", scratch)
            builder.mark("backward", "embedding backward")
            builder.free_all(reversed(grads))
        elif accumulating:
            # The embedding backward's dense gradient, until it is added into the one there.
            grad = builder.alloc("transient", embedding_grad)
            play_scratch(builder, "embedding backward", scratch)
            builder.mark("backward", "embedding backward")
            builder.free(grad)
        else:
            keep_gradients("embedding", "embedding", embedding_grad)
            play_scratch(builder, "embedding backward", scratch)
        if not layout.owns_gradients():
            keep_gradients("tail", "final_norm", final_norm_grad)
        if not tied:
            layout.backward_exit(builder, "embedding", run, sync)
    builder.mark("backward", "end of backward")
    layout.backward_end(builder, run, sync)
    return walk


def attention_transient(sizes: StepSizes, index: int, steady: bool) -> list[int]:
    """What layer `index`'s attention backward holds beside its saved tensors; at step 1, in the
    layer that autotunes there, Triton's benchmark buffer too."""
    held = sizes.attention_bwd_transient[index]
    if not steady and index == sizes.autotuned_layer:
        return [*held, TRITON_BENCHMARK_BUFFER]
    return held


def start_autograd_workspace(builder: StepBuilder, run: RunTensors, nbytes: int) -> None:
    """The autograd thread's cuBLAS workspace, made as its first matmul launches (after that
    matmul's output), once."""
    if len(run.workspaces) == 1:
        run.workspaces.append(builder.alloc("cublas_workspace", nbytes))


def sum_tied_gradients(
    builder: StepBuilder,
    run: RunTensors,
    lm_head_grad: int,
    embedding_grad: int,
    scratch: list[ScratchSum] = (),  # type: ignore[assignment]
) -> None:
    """The tied weight's two gradients meet in autograd's input buffer: the embedding
    backward's dense gradient (its kernel's `scratch` beside it), then their sum (a new tensor,
    the weight's gradient from here on), then both addends freed, lm_head's first."""
    addend = builder.alloc("transient", embedding_grad)
    play_scratch(builder, "embedding backward", scratch)
    total = builder.alloc("gradients", embedding_grad)
    builder.mark("backward", "embedding backward")
    builder.free(lm_head_grad)
    run.gradients.remove(lm_head_grad)
    builder.free(addend)
    if total is not None:
        run.gradients.append(total)


def play_scratch(builder: StepBuilder, label: str, sums: Iterable[ScratchSum]) -> None:
    """Each kernel's scratch in turn: the tensors beside it, then its blocks, allocated in order
    and freed in reverse, a nested list's (one launch of several) in between."""
    for beside, blocks in sums:
        if not blocks:
            continue
        held = builder.alloc_all("transient", beside)
        _play_blocks(builder, label, blocks)
        builder.free_all(reversed(held))


def _play_blocks(builder: StepBuilder, label: str, blocks: list) -> None:
    held = []
    for block in blocks:
        if isinstance(block, list):
            _play_blocks(builder, label, block)
        else:
            held += builder.alloc_all("transient", [block])
    builder.mark("backward", label)
    builder.free_all(reversed(held))


def no_grad_forward(
    builder: StepBuilder, saved: ForwardSaved, sizes: StepSizes, index: int
) -> list[int]:
    """A checkpointed layer's first forward (checkpoint's hooks keep nothing), so that its
    segments exist before backward as in the real run: where programs surround its entries
    (adapters, norms, eager scores) what its recomputation makes, attention's freed once the
    MLP starts; the MLP's freed after it, or, for a dense MLP as transformers runs it, its own
    program (contracts.gated_mlp_first_forward), whose last output is returned for the caller
    to free once the layer's output is made. Unmarked: the allocated high point is the
    recomputation's."""
    programs = saved.forward_programs[index] if saved.forward_programs else {}
    mlp = saved.mlp_first_forward[index] if saved.mlp_first_forward else []
    if not (programs or mlp) or not saved.first_forward:
        return []
    before, after = saved.recomputed_entries[index]
    by_name = bool(sizes.attention_bwd_steps[index])
    names = saved.recomputed_before_names[index]
    part = alloc_saved(builder, before, by_name, "transient", names, programs, False, False)
    builder.free_all(part)
    if not mlp:
        builder.free_all(
            alloc_saved_after(builder, saved, index, after, "transient", marked=False, grad=False)
        )
        return []
    # what comes before the MLP (its norm, whose output its first two matmuls read), its own
    # ops, then what comes after it (a post-MLP norm: plain, its program reads the MLP's)
    names = saved.after_names[index]
    at = [i for i, name in enumerate(names) if name.startswith("mlp.")] or [len(names)]
    first, last = at[0], at[-1] + 1
    part = alloc_saved(
        builder, after[:first], False, "transient", names[:first], programs, False, False
    )
    held: dict[str, int | None] = {}
    play_forward(builder, mlp, list, [], marked=False, held=held)
    part += builder.alloc_all("transient", after[last:])
    builder.free_all(part)
    return list(held.values())


def alloc_saved_after(
    builder: StepBuilder,
    saved: ForwardSaved,
    index: int,
    sizes: list[int],
    category: str = "activations",
    marked: bool = True,
    grad: bool = True,
) -> list[int]:
    """A layer's allocations saved after attention: one each where the MLP's backward program
    frees them one by one (ForwardSaved.mlp_backward), else as alloc_all makes them."""
    by_name = bool(saved.mlp_backward and saved.mlp_backward[index])
    programs = saved.forward_programs[index] if saved.forward_programs else {}
    names = saved.after_names[index]
    return alloc_saved(builder, sizes, by_name, category, names, programs, marked, grad)


def alloc_saved(
    builder: StepBuilder,
    sizes: list[int],
    by_name: bool,
    category: str = "activations",
    names: list[str] | None = None,
    programs: dict[str, list[ForwardStep]] | None = None,
    marked: bool = True,
    grad: bool = True,
) -> list[int]:
    """Saved allocations: one each where a backward program frees them by name (`by_name`),
    else as alloc_all makes them; those of a name (`names`) that `programs` holds inside the
    forward's temporaries around them (adapters.forward_programs), marked where `marked`;
    without `grad` (a no_grad forward) the programs free what nothing keeps there."""

    def plain(part: list[int]) -> list[int]:
        if not by_name:
            return builder.alloc_all(category, part)
        return [t for t in (builder.alloc(category, n) for n in part) if t is not None]

    if not programs or names is None:
        return plain(sizes)
    tensors: list[int] = []
    held: dict[str, int | None] = {}  # a program's temporaries, which a later one may free
    start = index = 0
    while index < len(sizes):
        program = programs.get(names[index])
        if program is None:
            index += 1
            continue
        end = index
        while end < len(sizes) and names[end] == names[index]:
            end += 1
        tensors += plain(sizes[start:index])
        part = sizes[index:end]
        tensors += play_forward(builder, program, plain, part, marked, held, grad)
        start = index = end
    tensors += plain(sizes[start:])
    builder.free_all(held.pop(key) for key in list(held))  # where no later program freed them
    return tensors


def play_forward(
    builder: StepBuilder,
    program: list[ForwardStep],
    alloc: Callable[[list[int]], list[int]],
    sizes: list[int],
    marked: bool = True,
    held: dict[str, int | None] | None = None,
    grad: bool = True,
) -> list[int]:
    """A forward program (adapters.forward_programs): its temporaries (into `held`, shared with
    the layer's other programs), marked at their high point where `marked`, around saved
    allocations (`sizes`, made by `alloc`: the next n at ("saved", n), the rest at ("saved",));
    returns those. Without `grad`, ("unsaved",) frees those made so far: no graph keeps them."""
    held = {} if held is None else held
    kept: list[int] = []
    for step in program:
        if step[0] == "alloc":
            held[step[1]] = builder.alloc("transient", step[2])
        elif step[0] == "free":
            builder.free(held.pop(step[1]))
        elif step[0] == "saved":
            count = step[1] if len(step) > 1 else len(sizes)
            kept += alloc(sizes[:count])
            sizes = sizes[count:]
        elif step[0] == "unsaved":
            if not grad:
                builder.free_all(kept)
                kept = []
        elif marked:
            builder.mark(builder.phase, builder.label)
    return kept


def play_backward(
    builder: StepBuilder,
    steps: list[BackwardStep],
    names: list[str],
    kept: list[int],
    label: str,
    accumulating: bool,
    gradients: list[int] | None = None,
) -> list[int]:
    """A backward program (contracts.BackwardStep) on the walk: its temporaries, the saved
    allocations it frees as it goes (`kept`, named by `names`), its high points; the rest of
    `kept` freed at its end. Returns the gradients of its "grad" steps, in order, for the
    caller to keep (allocated there, after the last high point); those of its "grad_kept"
    steps are allocated where they are made and added to `gradients` (where given and not
    `accumulating`), else returned as the others. `accumulating`: each gradient is added into
    the one kept as soon as it is made, and holds nothing at the high points."""
    temporaries: dict[str, int | None] = {}
    saved = dict(enumerate(zip(names, kept, strict=True)))
    by_name: dict[str, list[int]] = {}
    for key, name in enumerate(names):
        by_name.setdefault(name, []).append(key)
    grads: list[int] = []
    for step in steps:
        action = step[0]
        if action == "alloc":
            temporaries[step[1]] = builder.alloc("transient", step[2])
        elif action == "free":
            builder.free(temporaries.pop(step[1], None))
        elif action.startswith("free_saved"):
            keys = by_name.get(step[1], [])
            chosen = {"free_saved_one": keys[:1], "free_saved_last": keys[-1:]}.get(action, keys)
            for key in list(chosen):
                builder.free(saved.pop(key)[1])
                keys.remove(key)
        elif action == "grad_kept" and gradients is not None and not accumulating:
            gradients += builder.alloc_all("gradients", [step[1]])
        elif action in ("grad", "grad_kept"):
            grads.append(step[1])
            made = 0 if accumulating else step[1]
            temporaries[f"grad {len(grads)}"] = builder.alloc("gradients", made)
        else:
            builder.mark("backward", label)
    for key in [k for k in temporaries if k.startswith("grad ")]:
        builder.free(temporaries.pop(key))
    builder.free_all(tensor for _, tensor in saved.values())
    return [n for n in grads if n]


def play_flce(builder: StepBuilder, steps: list[tuple[str, str, int]]) -> list[int]:
    """FLCE's forward allocations (kernel_contracts.flce_allocations), marked at their peak;
    returns what it saves (dX, dW)."""
    alive: dict[str, int] = {}
    totals = []
    for action, name, nbytes in steps:
        alive[name] = nbytes if action == "alloc" else 0
        totals.append(sum(alive.values()))
    peak = max(range(len(totals)), key=totals.__getitem__)
    held: dict[str, int | None] = {}
    for index, (action, name, nbytes) in enumerate(steps):
        if action == "alloc":
            held[name] = builder.alloc("logits_and_loss", nbytes)
        else:
            builder.free(held.pop(name))
        if index == peak:
            builder.mark("loss", "fused linear cross entropy")
    return [t for t in held.values() if t is not None]


def optimizer_step(
    builder: StepBuilder,
    run: RunTensors,
    spec: ModelSpec,
    setup: TrainSetup,
    sizes: StepSizes,
    layout: OneGpu | None = None,
) -> None:
    """The optimizer step (states created at the first: per tensor, in parameter order) and
    zero_grad(set_to_none=True)."""
    builder.at("optimizer", "optimizer step")
    held = layout.optimizer_enter(builder, run) if layout else []
    if not run.states:
        run.states = builder.alloc_all(
            "optimizer_states", (n for nbytes in sizes.state_tensors for n in nbytes)
        )
    builder.mark("optimizer", "optimizer step", sizes.step_temp_tensors)
    builder.free_all(held)
    builder.at("optimizer", "zero_grad")
    builder.free_all(run.gradients)
    run.gradients = []
    run.gradients_by_group = {}


def estimate_step(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None, backend: str = "cuda"
) -> MemoryEstimate:
    sizes = step_sizes(spec, setup, gpu, backend)
    walks, _ = walk_run(spec, setup, sizes, steady_steps=1, record=False)
    first, steady = walks
    phase, label, peak_bytes = steady.points[steady.peak_index]
    return MemoryEstimate(
        peak_bytes=peak_bytes,
        peak_step1_bytes=first.peak,
        peak_phase=phase,
        peak_label=label,
        breakdown=steady.breakdown(steady.peak_index),
        params=sizes.counts.total
        + (sizes.trainable if setup.lora_rank else 0)
        + sum(counted_vision_tower(spec, setup)),
        trainable_params=sizes.trainable,
        timeline=steady.timeline(),
        host_bytes=host_bytes(spec, setup),
    )


def walk_run(
    spec: ModelSpec,
    setup: TrainSetup,
    sizes: StepSizes,
    steady_steps: int = 1,
    record: bool = True,
) -> tuple[tuple[Walk, Walk], EventLog]:
    """The protocol's run: the model build, step 1 (no optimizer states yet) and steady steps.
    Returns the walks of step 1 and of the last steady step (each the higher of its first and
    later micro-steps under gradient accumulation) and, when `record`, the run's event stream.
    One steady step predicts the reserved peaks of the recorded traces as well as two or three
    (tests/data/allocator_traces)."""
    builder = StepBuilder(record)
    layout = layout_for(spec, setup)
    run = build(builder, spec, setup, sizes, layout)
    walks: list[Walk] = []
    for step in range(1 + steady_steps):
        steady = step > 0
        run.buffers = layout.step_start(builder, step, run.buffers)
        layout.steady = steady
        accumulates = setup.grad_accum > 1
        micro = [
            walk_step(builder, run, spec, setup, sizes, steady, False, layout, not accumulates)
        ]
        if accumulates:
            micro.append(walk_step(builder, run, spec, setup, sizes, steady, True, layout))
        optimizer_step(builder, run, spec, setup, sizes, layout)
        builder.log.step_ends.append(len(builder.log.events))
        walks.append(max(micro, key=lambda w: w.peak))
    return (walks[0], walks[-1]), builder.log
