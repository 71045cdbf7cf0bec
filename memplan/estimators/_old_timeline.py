"""Walk one training step as a timeline of allocated bytes and take its maximum.

The walk follows the measurement protocol (shared/reference/measurement_protocol.md): forward layer
by layer, the loss, backward layer by layer, the optimizer step, zero_grad(set_to_none=True).
Step 1 runs without optimizer states; a steady step (the protocol's figure) starts with them and
with the cuBLAS workspace of the autograd thread, which step 1's backward created."""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.estimators import kernel_contracts as kc
from memplan.estimators.contracts import (
    AFTER_ATTENTION,
    FP32,
    INT64,
    DtypePlan,
    LayerContext,
    Saved,
    attention_masked,
    autocast_weight_params,
    gemma_norms,
    layer_saved,
    norm_saved,
    sdpa_math_path,
)
from memplan.estimators.params import ParamCounts, count_params, lora_params, lora_shapes
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
    "adam": (2, 1),
    "sgd": (0, 0),
    "sgd-momentum": (1, 0),
    "adafactor": (0, 0),
}
PER_TENSOR_STEP = ("adafactor",)
# Optimizers whose states do not follow the parameters' dtype: (state bytes, step temporary
# bytes) per trainable element. bitsandbytes' AdamW8bit: two uint8 states plus one fp32 absmax
# per 2048-element block each, updated in place by one fused kernel (not measured here:
# bitsandbytes is not on the measurement machine).
QUANTIZED_STATE_BYTES: dict[str, tuple[float, float]] = {"adamw-8bit": (2 + 2 * 4 / 2048, 0)}


def cublas_workspace_bytes(gpu: Gpu | None) -> int:
    """torch's default cuBLAS workspace per (handle, stream): 32 MiB from Hopper on, else
    4096 KiB * 2 + 16 KiB * 8 (CublasHandlePool.cpp)."""
    major = gpu.compute_capability[0] if gpu else 9
    return 32 * MIB if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def round_block(nbytes: float) -> int:
    """The caching allocator hands out multiples of 512 bytes."""
    return -(-int(nbytes) // 512) * 512


def layer_contexts(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str
) -> list[LayerContext]:
    lora = bool(setup.lora_rank)
    layer_types = spec.layer_types or ()
    return [
        LayerContext(
            spec=spec,
            setup=setup,
            dtypes=dtypes,
            backend=backend,
            kernels=frozenset(setup.kernels),
            trainable_base=not lora,
            needs_input_grad=not (lora and index == 0),
            sliding=index < len(layer_types) and layer_types[index] == "sliding_attention",
        )
        for index in range(spec.num_hidden_layers)
    ]


@dataclass
class ForwardSaved:
    """What the forward leaves saved for backward, in bytes, by where it was saved."""

    layers: list[int]
    final_norm: int
    # Of each layer's bytes, what the norms and MLP after attention saved: backward frees it
    # before it reaches attention.
    layers_after_attention: list[int]
    embedding: int
    shared: int  # rotary cos/sin, shared by every layer
    loss: int

    @property
    def total(self) -> int:
        return sum(self.layers) + self.final_norm + self.embedding + self.shared + self.loss


def forward_saved(
    spec: ModelSpec, setup: TrainSetup, backend: str = "cuda", rounded: bool = True
) -> ForwardSaved:
    """Bytes autograd saves during one forward (no checkpointing), parameters excluded."""
    dtypes = DtypePlan.of(setup.precision)
    tokens = setup.batch * setup.seq
    blocks = round_block if rounded else int
    lora = bool(setup.lora_rank)
    contexts = layer_contexts(spec, setup, dtypes, backend)
    by_kind: dict[tuple[bool, bool], tuple[int, int]] = {}  # layers differ only in these flags
    for ctx in contexts:
        kind = (ctx.sliding, ctx.needs_input_grad)
        if kind not in by_kind:
            saved = layer_saved(ctx)
            after = saved.bytes_of(tokens, AFTER_ATTENTION)
            by_kind[kind] = (blocks(saved.bytes(tokens)), blocks(after) if after else 0)
    layers = [by_kind[(ctx.sliding, ctx.needs_input_grad)][0] for ctx in contexts]
    after_attention = [by_kind[(ctx.sliding, ctx.needs_input_grad)][1] for ctx in contexts]
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
    rope_dtype = FP32 if dtypes.autocast else dtypes.residual
    shared = 2 * blocks(setup.seq * spec.head_dim * rope_dtype)
    embedding = 0 if lora else blocks(tokens * INT64)
    if gemma_norms(spec) and not lora:
        embedding += blocks(dtypes.residual)  # the sqrt(hidden) normalizer, a 0-d tensor
    return ForwardSaved(
        layers=layers,
        layers_after_attention=after_attention,
        final_norm=blocks(final.bytes(tokens)),
        embedding=embedding,
        shared=shared,
        loss=blocks(loss_saved_bytes(spec, setup, dtypes)),
    )


def loss_saved_bytes(spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan) -> int:
    tokens = setup.batch * setup.seq
    logits = tokens * spec.vocab_size
    kernels = set(setup.kernels)
    if "flce" in kernels:
        return kc.flce_saved_bytes(
            tokens, spec.hidden_size, spec.vocab_size, dtypes.proj, not setup.lora_rank
        )
    # Under autocast the lm_head matmul keeps its low-precision weight copy.
    lm_head_copy = spec.vocab_size * spec.hidden_size * dtypes.proj if dtypes.autocast else 0
    if "cross_entropy" in kernels:
        return logits * dtypes.proj + lm_head_copy  # the gradient, in place of the logits
    softcap = logits * dtypes.proj if spec.final_logit_softcapping else 0
    # log_softmax's output, the targets, nll_loss's total weight.
    return logits * FP32 + tokens * INT64 + FP32 + softcap + lm_head_copy


@dataclass
class Walk:
    """Allocated bytes by category as the step advances; `mark` records a timeline point with
    an optional transient on top."""

    alive: dict[str, int] = field(default_factory=dict)
    points: list[tuple[str, str, int]] = field(default_factory=list)
    transients: list[tuple[str, int]] = field(default_factory=list)
    snapshots: list[dict[str, int]] = field(default_factory=list)

    def add(self, category: str, nbytes: int) -> None:
        self.alive[category] = self.alive.get(category, 0) + nbytes

    @property
    def allocated(self) -> int:
        return sum(self.alive.values())

    def mark(self, phase: str, label: str, transient: int = 0, what: str = "transient") -> None:
        self.points.append((phase, label, self.allocated + transient))
        self.transients.append((what, transient))
        self.snapshots.append(dict(self.alive))

    @property
    def peak_index(self) -> int:
        return max(range(len(self.points)), key=lambda i: self.points[i][2])

    def breakdown(self, index: int) -> dict[str, int]:
        alive = {k: v for k, v in self.snapshots[index].items() if v}
        what, transient = self.transients[index]
        if transient:
            alive[what] = alive.get(what, 0) + transient
        return alive

    def timeline(self) -> list[TimelinePoint]:
        return [
            TimelinePoint(phase=phase, label=label, allocated_bytes=nbytes)
            for phase, label, nbytes in self.points
        ]


@dataclass(frozen=True)
class StepSizes:
    """Every byte count the walk needs, computed once."""

    counts: ParamCounts
    param_bytes: int
    weights: int
    trainable: int
    trainable_bytes: int
    states: int
    step_temp: int
    workspace: int
    saved: ForwardSaved
    residual: int
    logits_p: int
    logits_fp32: int
    grad_hidden: int
    lm_head_grad: int
    layer_grad: int
    layer_fwd_transient: int
    kv_cache_per_layer: int
    autocast_cache: int
    mlp_bwd_transient: int
    attention_bwd_transient: int
    flce_transient: int
    flce_grads_to_fp32: int


def step_sizes(spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None, backend: str) -> StepSizes:
    dtypes = DtypePlan.of(setup.precision)
    counts = count_params(spec)
    lora = bool(setup.lora_rank)
    n_lora = lora_params(spec, setup)
    trainable = n_lora if lora else counts.total
    trainable_bytes = n_lora * FP32 if lora else counts.total * dtypes.param
    if setup.optimizer in QUANTIZED_STATE_BYTES:
        per_element, temp_per_element = QUANTIZED_STATE_BYTES[setup.optimizer]
        state_bytes, temp_bytes = trainable * per_element, trainable * temp_per_element
    else:
        state_elems, temp_elems = OPTIMIZER_STATES[setup.optimizer]
        state_bytes, temp_bytes = state_elems * trainable_bytes, temp_elems * trainable_bytes
        if setup.optimizer in PER_TENSOR_STEP:
            temp_bytes = largest_trainable_tensor(spec, setup) * (FP32 if lora else dtypes.param)
    tokens = setup.batch * setup.seq
    h, p = spec.hidden_size, dtypes.proj
    nh, kv, hd = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    inter = (
        spec.moe_intermediate_size * spec.num_experts_per_tok
        if spec.num_experts
        else spec.intermediate_size
    )
    glu_in_place = (
        GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act) in setup.kernels
        and not spec.fused_gate_up
        and not spec.num_experts
    )
    budget = setup.flce_memory_budget
    if budget is not None:
        chunk = kc.flce_chunk_for_budget(tokens, h, spec.vocab_size, p, budget, not lora)
    else:
        chunk = setup.flce_chunk or kc.flce_default_chunk(tokens, h, spec.vocab_size)
    # Under autocast FLCE casts the fp32 hidden states and lm_head weight to bf16 copies.
    autocast_copies = (
        round_block(tokens * h * p) + round_block(spec.vocab_size * h * p) if dtypes.autocast else 0
    )
    return StepSizes(
        counts=counts,
        param_bytes=dtypes.param,
        weights=counts.total * dtypes.param + n_lora * FP32,
        trainable=trainable,
        trainable_bytes=trainable_bytes,
        states=int(state_bytes),
        step_temp=int(temp_bytes),
        workspace=cublas_workspace_bytes(gpu),
        saved=forward_saved(spec, setup, backend),
        residual=round_block(tokens * h * dtypes.residual),
        logits_p=round_block(tokens * spec.vocab_size * p),
        logits_fp32=round_block(tokens * spec.vocab_size * FP32),
        grad_hidden=round_block(tokens * h * p),
        lm_head_grad=0 if lora else round_block(spec.vocab_size * h * dtypes.param),
        layer_grad=(n_lora // spec.num_hidden_layers) * FP32
        if lora
        else counts.per_layer * dtypes.param,
        # Raw q, k, v before RoPE and its rotate_half temporaries, plus the residual pair.
        layer_fwd_transient=round_block(tokens * (3 * p * nh * hd + 2 * dtypes.residual * h)),
        # Adapters' weights under LoRA, else every layer's matmul weights (lm_head's copy is
        # saved by its matmul, counted with the loss).
        autocast_cache=round_block(
            (n_lora if lora else autocast_weight_params(spec) * spec.num_hidden_layers) * p
        )
        if dtypes.autocast
        else 0,
        # k after HF's RoPE takes the dtype of cos/sin, the residual's (fp32 under autocast;
        # memplan's RoPE keeps k's); the cache's v follows k (transformers 5 lazy-initializes
        # both from the keys' dtype).
        kv_cache_per_layer=2
        * round_block(tokens * kv * hd * (p if "rope" in setup.kernels else dtypes.residual)),
        # MLP backward holds d(product), d(act) and d(up) at once, plus the input gradients
        # (memplan's GLU kernel writes d(gate) and d(up) over the saved gate and up, so only
        # d(product) when the projections are separate).
        mlp_bwd_transient=round_block(
            tokens * ((1 if glu_in_place else 3) * p * inter + 2 * p * h)
        ),
        # Attention backward holds dq, dk, dv and an fp32 dq accumulator, or the score-sized
        # gradients where attention materializes scores.
        attention_bwd_transient=round_block(
            tokens
            * max(
                p * (nh + 2 * kv) * hd + FP32 * nh * hd,
                attention_scores_backward_bytes(spec, setup, dtypes, backend),
            )
        ),
        flce_transient=kc.flce_transient_bytes(
            tokens, h, spec.vocab_size, p, chunk, not lora, budget_bytes=budget
        )
        + autocast_copies,
        flce_grads_to_fp32=(
            round_block(tokens * h * FP32)
            + (0 if lora else round_block(spec.vocab_size * h * FP32))
            if autocast_copies
            else 0
        ),
    )


def largest_trainable_tensor(spec: ModelSpec, setup: TrainSetup) -> int:
    """Elements of the largest trainable tensor: a LoRA factor (rank x the larger side), else
    the embedding, one projection matrix, or transformers 5's stacked experts (one tensor of
    experts x 2 x moe_intermediate x hidden)."""
    if setup.lora_rank:
        return max((setup.lora_rank * max(shape) for shape in lora_shapes(spec, setup)), default=0)
    h = spec.hidden_size
    heads = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    dense = spec.intermediate_size * h * (2 if spec.fused_gate_up else 1)
    experts = spec.num_experts * 2 * spec.moe_intermediate_size * h
    return max(spec.vocab_size * h, dense, heads * h, experts)


def attention_scores_backward_bytes(
    spec: ModelSpec, setup: TrainSetup, dtypes: DtypePlan, backend: str
) -> int:
    """Per token: what backward holds beyond the saved probabilities when attention materializes
    (heads x seq) scores (by then the layer's MLP has freed what it saved). In bf16, eager
    softmax(scores, dtype=float32).to(bf16) holds d(probs) (2), its fp32 upcast (4) and the
    fp32 d(scores) softmax backward writes (4) at once:
    measured on an H200, llama-3.2-1b batch 2 x 2048 with kernels, whose peak falls there. In
    fp32 eager: d(probs) and d(scores), 4 bytes each. CUDA SDPA's math path (fp32 with grouped
    KV heads) holds three fp32 (heads x seq) tensors at once in its backward: seen in an H200
    allocation trace of smollm2-135m batch 8 x 2048 with kernels (probe_memory.py peak)."""
    math_sdpa = any(
        sdpa_math_path(spec, dtypes, backend, attention_masked(ctx))
        for ctx in layer_contexts(spec, setup, dtypes, backend)
    )
    if setup.attn != "eager" and not math_sdpa:
        return 0
    if setup.attn != "eager":  # the math path
        per_score = 3 * FP32
    else:
        per_score = 2 * FP32 if dtypes.proj == FP32 else dtypes.proj + 2 * FP32
    return spec.num_attention_heads * setup.seq * per_score


def walk_step(
    spec: ModelSpec, setup: TrainSetup, sizes: StepSizes, steady: bool, accumulating: bool = False
) -> Walk:
    """One micro-step's forward and backward (and the optimizer step after it). `accumulating`:
    a later micro-step of gradient accumulation, which starts with every gradient alive; each
    new gradient is then added into the one there (in place) and freed, instead of kept."""
    kernels = set(setup.kernels)
    saved = sizes.saved
    ckpt = setup.grad_checkpointing
    walk = Walk()
    walk.add("weights", sizes.weights)
    walk.add("optimizer_states", sizes.states if steady else 0)
    # Forward thread's cuBLAS workspace, and in a steady step the autograd thread's too.
    walk.add("cublas_workspace", sizes.workspace * (2 if steady else 1))
    embedding_grad = (
        0 if setup.lora_rank else round_block(sizes.counts.embedding * sizes.param_bytes)
    )
    final_norm_grad = (
        0 if setup.lora_rank else round_block(sizes.counts.final_norm * sizes.param_bytes)
    )

    def keep_gradient(nbytes: int) -> None:
        if not accumulating:
            walk.add("gradients", nbytes)

    if accumulating:
        tied_embedding = embedding_grad if not spec.tie_word_embeddings else 0
        walk.add(
            "gradients",
            sizes.lm_head_grad
            + len(saved.layers) * sizes.layer_grad
            + tied_embedding
            + final_norm_grad,
        )
    # Under checkpointing peft makes the frozen embedding's output a leaf that requires grad:
    # the step's graph keeps it and, after backward, its gradient, for as long as the caller
    # keeps the loss, i.e. until the next step's forward returns.
    embedding_leaf = 2 * sizes.residual if ckpt and setup.lora_rank else 0
    walk.add("embedding_leaf", embedding_leaf if steady or accumulating else 0)
    walk.mark("start", "weights + optimizer states")
    # Under checkpointing nothing saves the low-precision copies autocast caches of trainable
    # weights, but the cache holds them until the forward's autocast region ends.
    walk.add("autocast_cache", sizes.autocast_cache if ckpt else 0)

    hf_loss = "flce" not in kernels and "cross_entropy" not in kernels
    # transformers builds a KV cache in training too, unless checkpointing turns it off or
    # memplan's causal-LM forward (patched with a loss kernel) does: a copy of every layer's k
    # and v, held by the model output until forward returns.
    cache_per_layer = sizes.kv_cache_per_layer if hf_loss and not ckpt and spec.use_cache else 0
    walk.add("activations", saved.shared + saved.embedding)
    for index, layer_bytes in enumerate(saved.layers):
        recomputed_later = layer_bytes if ckpt else 0
        walk.add("kv_cache", cache_per_layer)
        walk.mark("forward", f"layer {index}", sizes.layer_fwd_transient + recomputed_later)
        walk.add("activations", sizes.residual if ckpt else layer_bytes)
    walk.add("activations", saved.final_norm)
    walk.mark("forward", "final norm", sizes.residual)

    upcast = sizes.logits_fp32 if sizes.logits_p < sizes.logits_fp32 else 0
    # The final norm's output, the loss's input, is alive until forward returns; it counts here
    # where nothing saved it: FLCE, a frozen lm_head (LoRA), or autocast (lm_head saves a copy).
    unsaved = "flce" in kernels or bool(setup.lora_rank) or DtypePlan.of(setup.precision).autocast
    norm_out = sizes.residual if unsaved else 0
    if "flce" in kernels:
        walk.mark(
            "loss",
            "fused linear cross entropy",
            norm_out + saved.loss + sizes.flce_transient,
            "logits_and_loss",
        )
    elif "cross_entropy" in kernels:
        walk.mark("loss", "logits + cross-entropy kernel", norm_out + saved.loss, "logits_and_loss")
    else:
        # lm_head output (held by the model output until forward returns), its fp32 upcast
        # and log_softmax's output (part of saved.loss).
        walk.mark(
            "loss",
            "logits, fp32 upcast, log_softmax",
            norm_out + sizes.logits_p + upcast + saved.loss,
            "logits_and_loss",
        )
    walk.add("logits_and_loss", saved.loss)
    walk.alive["kv_cache"] = walk.alive["autocast_cache"] = walk.alive["embedding_leaf"] = 0
    walk.mark("forward", "end of forward")

    if hf_loss:
        # nll_loss backward writes a dense fp32 gradient; log_softmax backward another.
        walk.mark("backward", "loss backward", 2 * sizes.logits_fp32, "logits_and_loss")
        walk.add("logits_and_loss", -saved.loss)
        to_model_dtype = sizes.logits_p if upcast else 0
        walk.mark(
            "backward", "logits gradient", sizes.logits_fp32 + to_model_dtype, "logits_and_loss"
        )
        walk.add("logits_and_loss", to_model_dtype or sizes.logits_fp32)
        if spec.final_logit_softcapping:
            walk.mark("backward", "softcap backward", 2 * sizes.logits_p, "logits_and_loss")
    if "flce" in kernels and sizes.flce_grads_to_fp32:
        walk.mark("backward", "FLCE gradients cast to fp32", sizes.flce_grads_to_fp32)
    if "flce" not in kernels:
        walk.mark("backward", "lm_head backward", sizes.grad_hidden + sizes.lm_head_grad)
    # FLCE computed dX and dW in its forward; backward hands them on.
    walk.alive["logits_and_loss"] = 0
    keep_gradient(sizes.lm_head_grad)
    walk.add("transient", sizes.grad_hidden)
    walk.add("activations", -saved.final_norm)

    for index in reversed(range(len(saved.layers))):
        recompute = saved.layers[index] if ckpt else 0
        # The MLP's backward runs first; by attention's, what the layer saved after attention
        # is freed.
        transient = max(
            sizes.mlp_bwd_transient,
            sizes.attention_bwd_transient - saved.layers_after_attention[index],
        )
        walk.mark("backward", f"layer {index} backward", recompute + transient)
        walk.add("activations", -(sizes.residual if ckpt else saved.layers[index]))
        keep_gradient(sizes.layer_grad)
    walk.alive["activations"] = 0
    walk.alive["transient"] = 0
    walk.add("embedding_leaf", embedding_leaf)
    if not setup.lora_rank:
        if spec.tie_word_embeddings:
            # The tied weight's two gradients meet here. One lm_head gradient from autograd
            # (no FLCE) plus the embedding's make a third tensor, their sum; FLCE's dW is summed
            # in place. Measured on an H200 (qwen2.5-1.5b, batch 1 x 256, SGD with momentum and
            # Adafactor, whose peak falls here): one more vocab x hidden gradient without FLCE.
            copies = 1 if "flce" in kernels else 2
            walk.mark("backward", "embedding backward", copies * embedding_grad)
        elif accumulating:
            # The embedding backward's dense gradient, until it is added into the one there.
            walk.mark("backward", "embedding backward", embedding_grad)
        else:
            walk.add("gradients", embedding_grad)
        keep_gradient(final_norm_grad)
    walk.mark("backward", "end of backward")
    walk.alive["optimizer_states"] = sizes.states
    walk.mark("optimizer", "optimizer step", sizes.step_temp)
    return walk


def _peak(walk: Walk) -> int:
    return walk.points[walk.peak_index][2]


def estimate_step(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None, backend: str = "cuda"
) -> MemoryEstimate:
    sizes = step_sizes(spec, setup, gpu, backend)
    first = walk_step(spec, setup, sizes, steady=False)
    steady = walk_step(spec, setup, sizes, steady=True)
    if setup.grad_accum > 1:
        # The step's peak is that of its first micro-step or of a later one, whichever is higher.
        first = max(first, walk_step(spec, setup, sizes, False, accumulating=True), key=_peak)
        steady = max(steady, walk_step(spec, setup, sizes, True, accumulating=True), key=_peak)
    peak_index = steady.peak_index
    phase, label, peak_bytes = steady.points[peak_index]
    return MemoryEstimate(
        peak_bytes=peak_bytes,
        peak_step1_bytes=first.points[first.peak_index][2],
        peak_phase=phase,
        peak_label=label,
        breakdown=steady.breakdown(peak_index),
        params=sizes.counts.total + (sizes.trainable if setup.lora_rank else 0),
        trainable_params=sizes.trainable,
        timeline=steady.timeline(),
    )
