"""Memory contracts of the ops of a Hugging Face decoder layer, and of memplan's replacements:
what each saves for backward and what it holds transiently, in bytes per token row.

Every figure below was read off the tensors autograd saves (benchmarks/probe_memory.py, on CPU and
on an H200 with torch 2.11 / transformers 5.17; tests/data/saved_cuda_probe.json) and is checked
by tests/test_estimator_contracts.py against a live forward of every family.

Notation: w is a row width, p the bytes of the projections' output dtype (2 in bf16 and under
autocast, 4 in fp32), p_res the bytes of the residual stream (2 in bf16, 4 in fp32 and under
autocast, whose embedding and residual adds stay fp32)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from memplan.estimators import kernel_contracts as kc
from memplan.estimators.cudnn import CUDNN_RELEASE, cudnn_trains
from memplan.estimators.deltanet import deltanet_saved
from memplan.estimators.events import ForwardStep
from memplan.estimators.params import (
    LORA_TARGET_SHAPES,
    deltanet_projection_widths,
    latent_attention_tensors,
    layer_lora_targets,
    linear_value_dim,
    moe_rules,
    shared_expert_gated,
)
from memplan.estimators.releases import Release
from memplan.families import FAMILIES
from memplan.schema import GLU_KERNEL_BY_ACTIVATION, ModelSpec, TrainSetup

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class DtypePlan:
    """Byte sizes that a precision setting gives each kind of tensor."""

    param: int  # weights, their gradients and the optimizer states
    proj: int  # outputs of matmuls (and so attention and MLP activations)
    residual: int  # the residual stream between blocks
    autocast: bool  # whether linears save low-precision copies of inputs and weights

    @classmethod
    def of(cls, precision: str) -> DtypePlan:
        if precision == "bf16":
            return cls(param=2, proj=2, residual=2, autocast=False)
        if precision == "fp32":
            return cls(param=4, proj=4, residual=4, autocast=False)
        return cls(param=4, proj=2, residual=4, autocast=True)  # amp-bf16 / amp-fp16


def runs_under_autocast(setup: TrainSetup) -> bool:
    """Whether the forward runs inside torch.autocast: amp-* as accelerate runs it on one GPU,
    under DDP and under FSDP2 (whose weights are then gathered in bf16 already); DeepSpeed
    casts the model itself and leaves autocast off."""
    strategy = setup.strategy or ""
    return DtypePlan.of(setup.precision).autocast and not strategy.startswith("zero")


@dataclass
class Saved:
    """Bytes one block saves for backward: per token row, plus a constant per block."""

    per_token: dict[str, float] = field(default_factory=dict)
    constant: dict[str, int] = field(default_factory=dict)
    # Each saved tensor, in the order the forward allocates them: (name, per token, constant).
    tensors: list[tuple[str, float, int]] = field(default_factory=list)

    def add(self, name: str, per_token: float = 0.0, constant: int = 0) -> None:
        """One saved tensor (per token bytes, or a constant size) under `name`."""
        if per_token:
            self.per_token[name] = self.per_token.get(name, 0.0) + per_token
            self.tensors.append((name, per_token, 0))
        if constant:
            self.constant[name] = self.constant.get(name, 0) + constant
            self.tensors.append((name, 0.0, constant))

    def add_each(self, name: str, *per_token: float) -> None:
        """Several saved tensors under one name."""
        for nbytes in per_token:
            self.add(name, nbytes)

    def bytes(self, tokens: int) -> int:
        return int(sum(self.per_token.values()) * tokens) + sum(self.constant.values())

    def bytes_of(self, tokens: int, prefixes: tuple[str, ...]) -> int:
        """Bytes of the entries whose names start with one of `prefixes`."""
        per_token = sum(v for k, v in self.per_token.items() if k.startswith(prefixes))
        constant = sum(v for k, v in self.constant.items() if k.startswith(prefixes))
        return int(per_token * tokens) + constant


# The suffix of a norm's saved entry that is its fp32 input itself (norm_saved).
INPUT_ITSELF = ".input"


def walked_tensor_by_tensor(spec: ModelSpec) -> bool:
    """Whether the walk follows a checkpointed layer's forward and recomputation tensor by
    tensor (Llama 4's MoE layers: moe_forward_peaks, every_expert_moe_backward), and with it
    what checkpointing keeps: the first layer's input requiring grad under LoRA (peft's leaf),
    the layer input a norm saves held once."""
    return spec.moe_router == "sigmoid_every_expert"


# Entries of layer_saved that the layer saves after attention (its MLP or MoE block and the norms
# around it, the MLP's adapters and autocast's copies of its weights): its backward frees them.
AFTER_ATTENTION = ("norm.post_attn", "norm.mlp", "mlp.", "moe.", "norm.post_mlp")
AFTER_ATTENTION += tuple(f"lora.{w}{m}" for w in ("", "weights.") for m in ("gate", "up", "down"))
# Qwen3.5's output gate (output_gate_saved) runs after attention's core, and its backward before
AFTER_ATTENTION += ("attn.gate",)
# The entry of layer_saved for what q, k and v keep of the layer's input in a post-norm layer.
LAYER_INPUT = "attn.in"
# What matmul(probs, v) keeps where attention materializes scores: the probabilities' cast (or
# their dropped copy) for v's gradient and the repeated v for theirs; its backward frees them.
PV_SAVED = ("attn.probs.cast", "attn.qkv.v")
# What the backward of o_proj (and of the dropout after it, which runs first) frees: its input,
# its adapter's saved tensors, autocast's weight copies, the dropout's mask.
O_PROJ_SAVED = ("attn.out", "lora.o_proj", "lora.weights.o_proj", "autocast.weights.o_proj")
O_PROJ_SAVED += ("attn.residual_dropout",)


@dataclass(frozen=True)
class LayerContext:
    spec: ModelSpec
    setup: TrainSetup
    dtypes: DtypePlan
    backend: str  # "cuda" or "cpu": SDPA picks other kernels on each
    kernels: frozenset[str]
    trainable_base: bool  # False under LoRA: frozen weights save no inputs for their grads
    needs_input_grad: bool  # False for the first layer under LoRA (embedding frozen)

    def adapted(self, *modules: str) -> bool:
        return any(m in self.lora_targets for m in modules) if self.setup.lora_rank else True

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The adapted linears this layer has (no v_proj where its values are its keys, none of
        the attention's in a gated DeltaNet layer)."""
        return tuple(layer_lora_targets(self.spec, self.setup))

    def output_needs_grad(self, stage: int) -> bool:
        """Whether the output of a matmul stage (LORA_TARGET_STAGE: 0 q/k/v, 1 o, 2 gate/up, 3
        down) needs a gradient: always, but in the first layer under LoRA only from the first
        adapted stage on; before it nothing needs a gradient and nothing is saved."""
        return self.needs_input_grad or first_stage_after(self.lora_targets) <= stage + 1

    sliding: bool  # this layer attends through a sliding window
    under_autocast: bool  # inside torch.autocast, whatever the weights' dtype
    rope: bool = True  # this layer rotates q and k (not one of SmolLM3's NoPE layers)
    moe: bool = False  # this layer's MLP is a mixture of experts (not a dense layer)
    chunked: bool = False  # this layer attends within chunks (Llama 4's layers with RoPE)
    # the model's cache takes each layer's state (use_cache, HF's loss, no checkpointing)
    cached: bool = False

    @property
    def rope_kernel(self) -> bool:
        """memplan's RoPE kernel rotates this layer's q and k."""
        return self.rope and "rope" in self.kernels

    @property
    def hf_rope(self) -> bool:
        """transformers' RoPE rotates this layer's q and k."""
        return self.rope and "rope" not in self.kernels

    @property
    def rotated_in_cos_dtype(self) -> bool:
        """q and k leave this layer's RoPE in cos/sin's dtype (the residual stream's, fp32 under
        autocast): HF's RoPE does, except where the family casts them back to their own dtype
        (OLMo); memplan's kernel, and a layer without RoPE, keep q's and k's."""
        return self.hf_rope and not (self.spec.rope_in_fp32 or self.spec.rope_complex)

    @property
    def keys_in_residual_dtype(self) -> bool:
        """k reaches attention and the KV cache in the residual stream's dtype: out of HF's RoPE
        (rotated_in_cos_dtype) or, in a layer without RoPE, out of a Llama-cast k_norm, whose
        weight (fp32 under autocast) multiplies last (EXAONE 4's full layers)."""
        llama_cast_k_norm = self.spec.qk_norm and not gemma_norms(self.spec)
        return self.rotated_in_cos_dtype or (not self.rope and llama_cast_k_norm)

    @property
    def queries_heads_major(self) -> bool:
        """q leaves RoPE contiguous as (batch, heads, seq, head_dim): where only part of each
        head rotates, HF's RoPE and memplan's both concatenate the rotated and passed parts
        (a full rotation keeps the projection's (batch, seq, heads, head_dim) layout)."""
        return self.rope and self.spec.rotary_dim is not None

    @property
    def seq(self) -> int:
        return self.setup.seq


def norm_saved(
    ctx: LayerContext,
    out: Saved,
    name: str,
    width: float,
    p_in: int,
    consumers: int,
    weight_trainable: bool,
    gemma: bool,
    rows_per_token: float = 1.0,
    input_requires_grad: bool = True,
) -> None:
    """An RMSNorm. HF Llama style: x.float(), rsqrt, weight * h.to(dtype); Gemma style: all in
    fp32, times (1 + w.float()) (Gemma) or w (OLMo). `consumers` linears read its output
    (linear_inputs_saved)."""
    if not input_requires_grad and not weight_trainable:
        return
    w = width * rows_per_token
    if "rms_norm" in ctx.kernels:
        out.add_each(name, *kc.rms_norm_saved_tensors(rows_per_token, width, p_in))
    elif gemma:
        # x.float(), rsqrt, and x * rstd kept for the weight's gradient when it trains; Gemma's
        # product also keeps its fp32 (1 + w), OLMo's the weight itself, Gemma 4's w.float().
        norm = FAMILIES[ctx.spec.model_type].patch.norm
        normalized = FP32 * w if weight_trainable else 0
        rstd = [FP32 * rows_per_token] * (2 if norm.rstd_by_pow else 1)
        # x.float() of an fp32 input is the input itself (a checkpoint's, when it is the layer's)
        out.add(name + (INPUT_ITSELF if p_in == FP32 else ""), FP32 * w)
        out.add_each(name, *rstd, normalized)
        cast_copy = norm.weight_cast and ctx.dtypes.param != FP32
        if FAMILIES[ctx.spec.model_type].norm_weight_copied or cast_copy:
            out.add(name, constant=FP32 * int(width))
    else:
        h_saved = p_in * w if weight_trainable else 0
        # x.float() of an fp32 input is the input itself, which pow keeps
        out.add(name + (INPUT_ITSELF if p_in == FP32 else ""), FP32 * w)
        out.add_each(name, FP32 * rows_per_token, h_saved)
    linear_inputs_saved(ctx, out, name + ".out", w, p_in, consumers)


def linear_inputs_saved(
    ctx: LayerContext, out: Saved, name: str, width: float, p_in: int, consumers: int
) -> None:
    """What `consumers` trainable linears that read one tensor (width per token, p_in bytes an
    element) save of it: a low-precision copy each under autocast, the tensor itself otherwise."""
    if not consumers:
        return
    if ctx.dtypes.autocast:
        out.add_each(name, *[ctx.dtypes.proj * width] * consumers)
    else:
        out.add(name, p_in * width)


def attention_saved(ctx: LayerContext, out: Saved) -> None:
    if not ctx.output_needs_grad(0):
        return
    spec, d = ctx.spec, ctx.dtypes
    if spec.mla:
        latent_attention_saved(ctx, out)
        return
    nh, kv, hd = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    p = d.proj
    seq = ctx.seq
    if spec.qk_norm:
        gemma = gemma_norms(spec)
        over_projection = spec.qk_norm_scope == "projection"
        for proj_name, heads, proj in (("q_norm", nh, "q_proj"), ("k_norm", kv, "k_proj")):
            norm_saved(
                ctx,
                out,
                "attn." + proj_name,
                heads * hd if over_projection else hd,
                p,
                0,
                ctx.trainable_base,
                gemma,
                rows_per_token=1 if over_projection else heads,
                input_requires_grad=ctx.needs_input_grad or ctx.adapted(proj, "qkv_proj"),
            )
    # whether q_proj's output (the gated q and the output gate) needs a gradient
    q_grad = ctx.needs_input_grad or ctx.adapted("q_proj", "qkv_proj")
    gated_q_norm = spec.qk_norm and spec.attention_output_gate and q_grad
    if gated_q_norm and "rms_norm" in ctx.kernels:
        # q is a strided slice of the gated q_proj's output: memplan's RMSNorm keeps the
        # contiguous copy it normalizes
        out.add("attn.q_norm", p * nh * hd)
    elif gated_q_norm and p == FP32 and not d.autocast:
        # q is a slice of the gated q_proj's output: q_norm's x.float() keeps all of it
        out.add("attn.q_norm", FP32 * nh * hd)
    if spec.v_norm:
        v_norm_saved(ctx, out)
    if ctx.rope_kernel:  # memplan's RoPE saves nothing per layer (cos/sin are shared)
        out.add("attn.rope", kc.rope_saved_bytes(1, (nh + kv) * hd, p))
    if spec.qk_l2_norm and ctx.rope:
        l2_norms_saved(ctx, out)
    if spec.nope_query_temperature and not ctx.rope and qkv_need_grad(ctx)[0]:
        # q * attn_scales keeps the fp32 (1, seq, 1, 1) temperatures for q's gradient
        out.add("attn.temperature", constant=seq * FP32)
    if spec.llama4_query_scale and qkv_need_grad(ctx)[0]:
        # q * get_llama_4_attn_scale(position_ids).to(q.dtype) keeps the (1, 1, seq, 1) factor
        # for q's gradient, one per layer, in the dtype of q after RoPE (HF's: cos/sin's).
        out.add("attn.llama4_scale", constant=seq * rotated_dtype(ctx))
    masked = attention_masked(ctx)
    path = attention_path(ctx)
    if path == "sinks":
        kernel = kc.sink_attention_kernel(ctx.backend, p, hd)
        for name, per_token, constant in kc.sink_attention_saved(seq, nh, kv, hd, p, kernel):
            out.add(name, per_token, constant)
        return
    if path == "scores":
        # matmul(q, k^T) saves each operand for the other's gradient, as does matmul(probs, v):
        # q when k needs a gradient, k (repeated to all heads) when q does, v (repeated) when
        # the scores do; the fp32 softmax output when the scores do, its low-precision cast
        # when v does (in fp32 the cast is the softmax output itself). SDPA's math path (fp32
        # with grouped KV heads on CUDA: no fused kernel takes it) runs the same ops in fp32.
        # Dropout on the probabilities keeps its mask (or noise) when the scores need a
        # gradient, and matmul(probs, v) then keeps the dropped copy instead of the cast.
        q_grad, k_grad, v_grad = qkv_need_grad(ctx)
        scores_grad = q_grad or k_grad
        p_scores = scores_bytes(ctx)
        dropout = spec.attention_dropout > 0
        # q and k (for each other's gradient), then v (PV_SAVED: freed by that matmul's backward)
        out.add_each("attn.qkv", *[p_scores * nh * hd] * (k_grad + q_grad))
        v_name = "attn.qkv" if spec.attention_sinks else PV_SAVED[1]
        out.add(v_name, p_scores * nh * hd * scores_grad)
        if ctx.setup.attn == "eager" and not spec.eager_softmax_fp32:
            # Llama 4's softmax in q's dtype: its output is the one tensor it and
            # matmul(probs, v) keep
            out.add("attn.probs", p_scores * nh * seq * (scores_grad or v_grad))
            if o_input_kept(ctx):
                out.add("attn.out", p * nh * hd)
            return
        if spec.attention_sinks:
            sink_probs_saved(ctx, out, scores_grad, v_grad)
        else:
            cast_kept = v_grad and (dropout or p_scores < FP32 or not scores_grad)
            out.add("attn.probs", FP32 * nh * seq * scores_grad)
            out.add(PV_SAVED[0], p_scores * nh * seq * cast_kept)
        if dropout and scores_grad:
            out.add("attn.dropout", dropout_saved_bytes(ctx, p_scores) * nh * seq)
        if ctx.setup.attn == "eager" and spec.attn_logit_softcapping and scores_grad:
            out.add("attn.softcap", p * nh * seq)
        # kept by o_proj, or where there is an output gate, by the product with it where the
        # gate needs a gradient (o_proj keeps the product: output_gate_saved)
        gate = spec.attention_output_gate
        if (o_input_kept(ctx) and not gate) or (gate and q_grad):
            out.add("attn.out", p * nh * hd)
        output_gate_saved(ctx, out)
        return
    if ctx.backend == "cuda":
        out.add("attn.rng", constant=2 * INT64)  # philox seed and offset of the fused kernels
    if path == "memory_efficient":
        # With a mask HF repeats k and v itself, and the memory-efficient kernel saves its own
        # copy of the (batch x 1 x seq x seq) mask and a logsumexp padded to 32 positions. In
        # fp32 without a mask and without grouped heads (kv == heads), flash attention refuses
        # fp32 and the same kernel runs, without a mask.
        kv_saved = p * (kv if repeat_is_view(ctx) else nh) * hd
        out.add_each("attn.qkv", p * nh * hd, kv_saved, kv_saved)
        out.add("attn.lse", FP32 * nh * (-(-seq // 32) * 32) / seq)
        if masked:
            out.add("attn.mask", p * seq)
    else:
        out.add_each("attn.qkv", p * nh * hd, p * kv * hd, p * kv * hd)
        out.add("attn.lse", FP32 * nh)
    out.add("attn.out", p * nh * hd)
    hf_attention = "rope" not in ctx.kernels  # memplan's patched attention makes no copy
    # Where the output takes q's layout (attention_output_follows_query) and q is heads-major,
    # the (batch, seq, heads x head_dim) reshape copies it. phi3's RoPE concatenates its rotated
    # part with the rest (empty or not): its q is heads-major, and the output of every kernel
    # but the memory-efficient one (on CUDA: fp32; bf16 with a mask goes to cuDNN) is copied.
    efficient_output = path == "memory_efficient" and ctx.backend == "cuda" and p == FP32
    copied = (spec.fused_qkv and hf_attention and not efficient_output) or (
        ctx.queries_heads_major and attention_output_follows_query(ctx, path)
    )
    if copied and spec.attention_output_gate:
        # kept by the product with the gate where the gate needs a gradient
        out.add("attn.gate.in", p * nh * hd * q_grad)
    elif copied and o_input_kept(ctx):
        out.add("attn.o_proj_in", p * nh * hd)
    output_gate_saved(ctx, out)


def output_gate_saved(ctx: LayerContext, out: Saved) -> None:
    """Qwen3.5's output gate: attention's output times sigmoid(gate), the second half of
    q_proj's output (copied out of it by a reshape). The product keeps the sigmoid's output
    (which its backward reuses) and the attention output (counted with attention's own), and
    o_proj keeps the product where it trains (o_input_kept)."""
    spec = ctx.spec
    if not spec.attention_output_gate:
        return
    width = ctx.dtypes.proj * spec.num_attention_heads * spec.head_dim
    out.add("attn.gate", width)
    if o_input_kept(ctx):
        out.add("attn.gate.product", width)


@dataclass(frozen=True)
class LatentGrads:
    """Which tensors of a latent attention layer need a gradient (all of them, but in the
    first layer under LoRA only those downstream of an adapter): q_a_proj's output (q_latent),
    q, kv_a_proj_with_mqa's output (kv_latent: the shared rotated key among it), and k and v
    (kv_b_proj's output, or the rotated key)."""

    q_latent: bool
    q: bool
    kv_latent: bool
    kv: bool


def latent_grads(ctx: LayerContext) -> LatentGrads:
    if ctx.needs_input_grad:
        return LatentGrads(True, True, True, True)
    q_latent = ctx.adapted("q_a_proj")
    kv_latent = ctx.adapted("kv_a_proj_with_mqa")
    return LatentGrads(
        q_latent=q_latent,
        q=q_latent or ctx.adapted("q_b_proj", "q_proj"),
        kv_latent=kv_latent,
        kv=kv_latent or ctx.adapted("kv_b_proj"),
    )


def latent_attention_saved(ctx: LayerContext, out: Saved) -> None:
    """DeepSeek-V3's latent attention (transformers' forward, RoPE included): q_a_layernorm on
    q_a_proj's output and kv_a_layernorm on the latent slice of kv_a_proj_with_mqa's output (in
    fp32 the slice's x.float() is a view of that whole output, which pow keeps, as memplan's
    RMSNorm keeps its input), each keeping
    what an RMSNorm keeps and its output for the up-projection that reads it; the rotation
    keeps cos/sin (shared tables); q (the concatenation of its passed and rotated parts) and k
    (a new tensor the latent's key parts are copied into) head_dim wide, v a view of kv_b_proj's
    output, which a kernel that keeps v keeps whole (qk_nope + v_head_dim per head). Attention
    as attention_path picks it: materialized scores keep q, k, a contiguous copy of v (fp32
    copies on the CPU's math path) and the probabilities; a fused kernel (cuDNN) or the
    memory-efficient one keeps q, k, v, its output and logsumexp; o_proj its input, a copy
    where the output takes q's heads-major layout."""
    spec, d = ctx.spec, ctx.dtypes
    nh, hd, vd = spec.num_attention_heads, spec.head_dim, spec.value_dim
    p, seq = d.proj, ctx.seq
    grads = latent_grads(ctx)
    lora = bool(ctx.setup.lora_rank)
    up_readers = 0 if lora else 1
    if spec.q_lora_rank:
        norm_saved(
            ctx, out, "attn.q_a_norm", spec.q_lora_rank, p, up_readers, ctx.trainable_base,
            False, input_requires_grad=grads.q_latent,
        )  # fmt: skip
    kv_rank, rope = spec.kv_lora_rank, spec.rotated_dim
    norm_saved(
        ctx, out, "attn.kv_a_norm", kv_rank, p, up_readers, ctx.trainable_base, False,
        input_requires_grad=grads.kv_latent,
    )  # fmt: skip
    # memplan's kernel keeps its input, an fp32 x.float() is its input: the sliced output whole
    keeps_slice = p == FP32 or "rms_norm" in ctx.kernels
    if keeps_slice and (grads.kv_latent or ctx.trainable_base):
        out.add("attn.kv_a_norm" + INPUT_ITSELF, p * rope)
    v_storage = p * nh * (spec.qk_nope_dim + vd)  # kv_b_proj's output, of which v is a view
    path = attention_path(ctx)
    if path == "scores":
        q_grad, k_grad, v_grad = grads.q, grads.kv, grads.kv
        scores_grad = q_grad or k_grad
        p_scores = scores_bytes(ctx)
        # matmul(probs, v) keeps a contiguous copy of v's strided view (the math path its
        # fp32 copy), which only it keeps: freed by its backward (PV_SAVED), as is the cast
        out.add_each("attn.qkv", p_scores * nh * hd * k_grad, p_scores * nh * hd * q_grad)
        out.add(PV_SAVED[1], p_scores * nh * vd * scores_grad)
        cast_kept = v_grad and (p_scores < FP32 or not scores_grad)
        out.add("attn.probs", FP32 * nh * seq * scores_grad)
        out.add(PV_SAVED[0], p_scores * nh * seq * cast_kept)
        if o_input_kept(ctx):
            out.add("attn.out", p * nh * vd)
        return
    if ctx.backend == "cuda":
        out.add("attn.rng", constant=2 * INT64)
    out.add_each("attn.qkv", p * nh * hd, p * nh * hd, v_storage)
    padded = -(-seq // 32) * 32 if path == "memory_efficient" else seq
    out.add("attn.lse", FP32 * nh * padded / seq)
    out.add("attn.out", p * nh * vd)
    if path == "fused" and o_input_kept(ctx):  # the output is heads-major as q is
        out.add("attn.o_proj_in", p * nh * vd)


def attention_output_follows_query(ctx: LayerContext, path: str) -> bool:
    """Whether SDPA's output takes q's memory layout, so that a heads-major q gives an output
    the (batch, seq, heads x head_dim) reshape must copy: flash attention and cuDNN on CUDA
    (torch's meta kernels: empty_like / alloc_with_matching_layout of q), the CPU's fused
    kernel (measured); the memory-efficient kernel writes (batch, seq, heads, head_dim)."""
    return path == "fused" or (path == "memory_efficient" and ctx.backend != "cuda")


def v_norm_saved(ctx: LayerContext, out: Saved) -> None:
    """Gemma 4's scale-free RMSNorm on each value head: v.float(), the mean square plus eps
    and its pow(-0.5) (no weight, so the normalized product is kept by nothing). Where v is
    k_proj's output in fp32 without autocast, v.float() is that output, which k_norm keeps
    already."""
    spec, p = ctx.spec, ctx.dtypes.proj
    source = "k_proj" if spec.values_from_keys else "v_proj"
    if not (ctx.needs_input_grad or ctx.adapted(source)):
        return
    heads, hd = spec.num_key_value_heads, spec.head_dim
    shared_input = spec.values_from_keys and p == FP32
    out.add_each("attn.v_norm", 0 if shared_input else FP32 * heads * hd, FP32 * heads)
    out.add("attn.v_norm", FP32 * heads)


def sink_probs_saved(ctx: LayerContext, out: Saved, scores_grad: bool, v_grad: bool) -> None:
    """gpt-oss's eager attention: cat(scores + mask, sinks) in the residual stream's dtype (the
    mask's; under autocast cat promotes to the fp32 sinks), minus its row max (max keeps its
    int64 indices), softmax in that dtype (its (seq + 1)-wide output kept), the sink column
    dropped by a slice, cast to v's dtype for matmul(probs, v): a copy under autocast, else a
    view of the softmax output, whose storage the matmul then keeps where nothing else does."""
    nh, seq, p = ctx.spec.num_attention_heads, ctx.seq, ctx.dtypes.proj
    p_logits = ctx.dtypes.residual
    if scores_grad:
        out.add("attn.sink_max", INT64 * nh)
        out.add("attn.probs", p_logits * nh * (seq + 1))
    if not v_grad:
        return
    if p_logits != p:
        out.add("attn.probs", p * nh * seq)
    elif not scores_grad:
        out.add("attn.probs", p_logits * nh * (seq + 1))


def l2_norms_saved(ctx: LayerContext, out: Saved) -> None:
    """Llama 4's L2 norm of q and k after RoPE, x.float() * rsqrt(mean(x^2) + eps) without
    weight: pow and the product keep the fp32 x, the product its fp32 rsqrt per head row."""
    spec = ctx.spec
    q_grad, k_grad, _ = qkv_need_grad(ctx)
    for needs_grad, heads in (
        (q_grad, spec.num_attention_heads),
        (k_grad, spec.num_key_value_heads),
    ):
        if needs_grad:
            out.add_each("attn.l2_norm", FP32 * heads * spec.head_dim, FP32 * heads)


def qkv_need_grad(ctx: LayerContext) -> tuple[bool, bool, bool]:
    """Whether q, k and v after RoPE need a gradient: always, but in the first layer under LoRA
    only those whose projection is adapted; memplan's RoPE kernel (one custom op over q and k)
    gives both outputs a gradient when either input has one."""
    if ctx.needs_input_grad:
        return True, True, True
    if ctx.spec.mla:  # k and v both come out of kv_b_proj (k's rotated part: the kv latent)
        grads = latent_grads(ctx)
        return grads.q, grads.kv, grads.kv
    q, k, v = (ctx.adapted(name, "qkv_proj") for name in ("q_proj", "k_proj", "v_proj"))
    if ctx.rope_kernel:
        q = k = q or k
    return q, k, v


def rotated_dtype(ctx: LayerContext) -> int:
    """Bytes per element of q and k after RoPE (LayerContext.rotated_in_cos_dtype: the
    residual's, or their own)."""
    return ctx.dtypes.residual if ctx.rotated_in_cos_dtype else ctx.dtypes.proj


def rotation_saved(ctx: LayerContext) -> bool:
    """Whether the layer's RoPE saves cos/sin: where q or k after it needs a gradient."""
    if ctx.spec.mla:  # q's rotated part, or the shared rotated key of the latent
        grads = latent_grads(ctx)
        return ctx.output_needs_grad(0) and (grads.q or grads.kv_latent)
    q_grad, k_grad, _ = qkv_need_grad(ctx)
    return ctx.output_needs_grad(0) and (q_grad or k_grad)


def o_input_kept(ctx: LayerContext) -> bool:
    """Whether o_proj's input, a copy nothing else keeps (the contiguous eager or math-path
    attention output, phi3's reshape of SDPA's output), is saved: by a trainable o_proj, or by
    its adapter in fp32, which casts nothing (under bf16 weights or autocast the adapter keeps
    its own cast instead)."""
    return ctx.trainable_base or (ctx.adapted("o_proj") and adapters_share_inputs(ctx.dtypes))


def adapters_share_inputs(dtypes: DtypePlan) -> bool:
    """fp32 weights without autocast: peft's fp32 adapters take their input as it is, so
    adapters that read the same tensor save it once."""
    return dtypes.param == FP32 and not dtypes.autocast


def sdpa_math_path(spec: ModelSpec, dtypes: DtypePlan, backend: str, masked: bool) -> bool:
    """Whether SDPA falls back to its math path, which materializes (heads x seq) fp32
    probabilities. On CUDA: fp32 q, k, v with grouped KV heads and no mask. transformers passes
    enable_gqa=True only when there is no mask and the KV heads are grouped
    (integrations/sdpa_attention.use_gqa_in_sdpa); on CUDA only flash attention and the math
    path take enable_gqa, and flash attention takes no fp32. Without grouped heads the
    memory-efficient kernel takes fp32. On the CPU: with dropout, which its fused kernel does
    not take (the math path then computes bf16 in fp32)."""
    if backend != "cuda":  # the CPU's fused kernel takes no dropout, nor v narrower than q
        return spec.attention_dropout > 0 or spec.value_dim != spec.head_dim
    grouped = spec.num_key_value_heads < spec.num_attention_heads
    return dtypes.proj == FP32 and grouped and not masked


def scores_bytes(ctx: LayerContext) -> int:
    """Bytes per element of q, k, v and the probabilities where attention materializes scores:
    the projections' dtype for eager attention, fp32 on SDPA's math path."""
    return ctx.dtypes.proj if ctx.setup.attn == "eager" else FP32


def dropout_saved_bytes(ctx: LayerContext, input_bytes: int) -> int:
    """Bytes per element dropout saves for backward in training: CUDA's fused native_dropout a
    bool mask; on other devices at::dropout multiplies by a noise tensor of the input's dtype,
    which the product saves."""
    return 1 if ctx.backend == "cuda" else input_bytes


def fused_attention_kernel(ctx: LayerContext) -> Literal["cudnn", "flash"] | None:
    """The fused SDPA kernel of a bf16/fp16 layer without a mask on CUDA (sm90): cuDNN where
    the assumed release trains its head dims and dropout (cudnn.cudnn_trains: from 9.19, head
    dims up to 256, multiples of 8); else flash, which takes only one head dim for q, k and v
    (None: neither; the memory-efficient kernel runs). As traced/sdpa.py's choose_kernel."""
    qk, v = ctx.spec.head_dim, ctx.spec.value_dim
    if cudnn_trains(qk, v, ctx.spec.attention_dropout, CUDNN_RELEASE):
        return "cudnn"
    return "flash" if qk == v and qk <= 256 else None


def sink_kernel(ctx: LayerContext) -> bool:
    """memplan's sink attention runs this layer's attention (memplan.kernels.sink_attention):
    the family has sinks, and the kernel runs inside memplan's attention forward (rope's)."""
    return ctx.spec.attention_sinks and {"rope", "sink_attention"} <= ctx.kernels


def attention_path(ctx: LayerContext) -> Literal["scores", "memory_efficient", "fused", "sinks"]:
    """How a layer's attention runs: materializing (heads x seq) scores (eager, or SDPA's math
    path), SDPA's memory-efficient kernel (a mask, or fp32 on CUDA), a fused kernel that
    takes the grouped KV heads as they are, or memplan's sink attention (sink_kernel)."""
    if sink_kernel(ctx):
        return "sinks"
    masked = attention_masked(ctx)
    if ctx.setup.attn == "eager" or sdpa_math_path(ctx.spec, ctx.dtypes, ctx.backend, masked):
        return "scores"
    if masked or (ctx.dtypes.proj == FP32 and ctx.backend == "cuda"):
        return "memory_efficient"
    if ctx.backend == "cuda" and fused_attention_kernel(ctx) is None:
        return "memory_efficient"
    return "fused"


def repeat_is_view(ctx: LayerContext) -> bool:
    """With one KV head HF's repeat_kv makes a view, and the memory-efficient kernel saves k
    and v as they are, unless autocast casts them to a full-size copy (HF's RoPE leaves k in
    fp32 under autocast): CPU and H200 probes, gemma3 with kv = 1."""
    return ctx.spec.num_key_value_heads == 1 and not (
        ctx.dtypes.autocast and ctx.keys_in_residual_dtype
    )


def kv_cache_shares_saved(ctx: LayerContext, key_bytes: int, value_bytes: int) -> tuple[bool, bool]:
    """Whether the KV cache's keys and values (of `key_bytes` and `value_bytes` per element) are
    the very tensors attention saves for backward, so that the cache adds no memory: attention
    saves the cache's tensors where it saves k and v at all (attention_saved), takes them in
    their dtype (not autocast's cast of fp32 keys) and unrepeated (HF's repeat_kv returns them
    as they are with one group, kv == heads)."""
    if not ctx.output_needs_grad(0):
        return False, False
    one_group = ctx.spec.num_key_value_heads == ctx.spec.num_attention_heads
    key_saved = value_saved = True
    path = attention_path(ctx)
    if path == "scores":
        q_grad, k_grad, _ = qkv_need_grad(ctx)
        key_saved, value_saved = q_grad, q_grad or k_grad
        unrepeated = one_group
    elif path == "memory_efficient":
        unrepeated = one_group or repeat_is_view(ctx)
    else:
        unrepeated = True
    p = scores_bytes(ctx) if path == "scores" else ctx.dtypes.proj
    return (
        key_saved and unrepeated and key_bytes == p,
        value_saved and unrepeated and value_bytes == p,
    )


def attention_masked(ctx: LayerContext) -> bool:
    """Whether SDPA gets an explicit mask: sliding-window layers once the sequence reaches the
    window (seen on gemma3 with seq == window), Llama 4's chunked layers at every length."""
    window = ctx.spec.sliding_window
    return ctx.chunked or (ctx.sliding and window is not None and ctx.seq >= window)


def mlp_saved(ctx: LayerContext, out: Saved) -> None:
    if not ctx.output_needs_grad(2 if not ctx.moe else 1):
        return  # the MLP's input and its gate/up outputs need no gradient (experts: no adapters)
    if ctx.moe and ctx.spec.moe_router == "sigmoid_every_expert":
        every_expert_moe_saved(ctx, out)
        return
    if ctx.moe:
        moe_saved(ctx, out)
        if ctx.spec.shared_expert_intermediate_size:
            gated_mlp_saved(ctx, out, "mlp.shared", ctx.spec.shared_expert_intermediate_size)
        if shared_expert_gated(ctx.spec):
            # sigmoid(shared_expert_gate(x)) * shared: the product keeps both factors, the
            # sigmoid's output (one per token, which its own backward reuses) and the shared
            # expert's output
            p = ctx.dtypes.proj
            out.add_each(SHARED_EXPERT_GATE, p, p * ctx.spec.hidden_size)
        return
    gated_mlp_saved(ctx, out, "mlp", ctx.spec.intermediate_size)


def gated_mlp_saved(ctx: LayerContext, out: Saved, name: str, inter: int) -> None:
    """A gated MLP `inter` wide: a dense layer's, or a MoE layer's shared experts."""
    spec, p = ctx.spec, ctx.dtypes.proj
    glu = GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act)
    half = kc.glu_saved_bytes(1, inter, p) / 2 if glu in ctx.kernels else p * inter
    if spec.fused_gate_up and name == "mlp":
        # one gate_up_proj output, of which gate and up are views: one allocation
        out.add(name + ".gate_up", 2 * half)
    else:
        # gate for the activation, up for the product
        out.add_each(name + ".gate_up", half, half)
    if glu not in ctx.kernels:
        out.add(name + ".act", p * inter)
    # down_proj keeps its input for its weight's gradient: not when frozen (an adapter keeps its
    # own cast, counted with the adapters), nor when the GLU kernel runs a plain down_proj itself
    # and recomputes the product in backward (memplan.kernels._glu.recompute_product: not under
    # autocast, nor under ZeRO-3, whose hooks on every module make down_proj run as its own call).
    recomputed = glu in ctx.kernels and not ctx.under_autocast and ctx.setup.strategy != "zero3"
    if ctx.trainable_base and not recomputed:
        out.add(name + ".down_in", p * inter)


def moe_saved(ctx: LayerContext, out: Saved) -> None:
    """transformers 5's sparse MoE block: the router (moe_router_saved), then each routed row
    (tokens x k of them) goes through gathered expert matmuls. Those (grouped_mm) are not
    autocast ops: under autocast they run in the weights' dtype and copy no weight."""
    spec, p = ctx.spec, ctx.dtypes.param
    e, k, inter, h = (
        spec.num_experts,
        spec.num_experts_per_tok,
        spec.moe_intermediate_size,
        spec.hidden_size,
    )
    routing_weight = moe_router_saved(ctx, out)
    router = moe_rules(spec)
    # Per routed row: the gathered input (twice when the expert matmuls keep it for their
    # weight's gradient), gate, up, act(gate) and the product (each moe_intermediate wide),
    # three index rows, the routing weight and, before transformers 5.18, the mask bool; frozen
    # expert matmuls keep neither input.
    inputs = [p * h] * (2 if ctx.trainable_base else 1)
    if router.clamped_glu:
        # gpt-oss: the gate_up output (both clamps keep it, 2 x moe wide), then the clamped gate,
        # sigmoid(alpha x gate), up + 1 and their product's other factor, and the product
        intermediates = [p * 2 * inter] + [p * inter] * (5 if ctx.trainable_base else 4)
    else:
        intermediates = [p * inter] * (4 if ctx.trainable_base else 3)
    # the expert ids that gather each row's biases, kept where the biases train
    bias_index = [INT64] if router.expert_biases and ctx.trainable_base else []
    mask = [1] if Release.of(ctx.setup.transformers).moe_sentinel_mask else []
    if not router.clamped_glu:
        # grouped_mm_experts_forward's order (grouped_experts.experts_program): the sort's
        # permutation, the gather's index, the gathered rows (where trained), the sorted routing
        # weights, the offsets, the mask, the masked gate_up output (one tensor, gate and up its
        # views), act(gate), the product (where trained), the masked down output, inv_perm
        trained = [p * inter] if ctx.trainable_base else []
        out.add_each("moe.experts", k * INT64, k * INT64, *(k * n for n in inputs[1:]))
        out.add("moe.experts", k * routing_weight)
        out.add("moe.experts", constant=4 * e)
        gathered = [k * n for n in (*mask, *bias_index)]
        out.add_each("moe.experts", *gathered, k * 2 * p * inter, k * p * inter)
        out.add_each("moe.experts", *(k * n for n in trained), k * p * h, k * INT64)
        return
    routed_row = [
        *inputs, *intermediates, INT64, INT64, INT64, *bias_index, routing_weight, *mask
    ]  # fmt: skip
    out.add_each("moe.experts", *(k * n for n in routed_row))
    out.add("moe.experts", constant=4 * e)


def moe_router_saved(ctx: LayerContext, out: Saved) -> int:
    """What the router saves; returns the bytes of each routed row's weight.

    softmax: softmax in fp32 (its output), top-k (its indices), the renormalization (the sum and
    the weights before it). Each routed row keeps its routing weight (for the product that
    applies it): fp32 from Mixtral's router softmax; qwen3_moe's router casts it to the router
    logits' dtype.
    topk_softmax (gpt-oss): top-k (its indices), the softmax over the k logits (its output, in
    the logits' dtype, which each routed row's weight is).
    sigmoid_fp32 (DeepSeek-style): the linear on fp32 copies of its input and weight keeps
    them (bf16 weights, the weight's before transformers 5.24, which keeps it in fp32; in fp32
    they are the tensors themselves, under autocast its casts as any linear's), sigmoid its
    output, gather its index; the renormalization as softmax's; the
    routing weights in the router logits' dtype. The group-limited top-k's own saves go with
    the nodes freed when the router returns (only the final indices are kept, by gather)."""
    spec, d = ctx.spec, ctx.dtypes
    e, k, h = spec.num_experts, spec.num_experts_per_tok, spec.hidden_size
    router = moe_rules(spec)
    normalized = router.normalizes_by_default
    if router.reads_norm_topk_prob:
        normalized = spec.hf_config.get("norm_topk_prob", normalized)
    if router.router == "topk_softmax":
        out.add_each("moe.router", INT64 * k, d.proj * k)
    if router.router == "softmax":
        out.add_each("moe.router", FP32 * e, INT64 * k, *((FP32, FP32 * k) if normalized else ()))
    if router.router != "sigmoid_fp32":
        return FP32 if router.fp32_routing_weights else d.proj
    logits = d.proj if d.autocast else FP32
    if router_copies_input(ctx):
        if ctx.trainable_base:
            out.add("moe.router", FP32 * h)
        if not Release.of(ctx.setup.transformers).router_weight_in_fp32(spec.model_type):
            out.add("moe.router", constant=FP32 * e * h)
    out.add_each("moe.router", logits * e, INT64 * k, *((FP32, logits * k) if normalized else ()))
    return logits


def router_copies_input(ctx: LayerContext) -> bool:
    """A DeepSeek-style router casts its input and weight to fp32 copies of their own: bf16
    weights without autocast (in fp32 the casts are the tensors themselves; under autocast the
    linear's own casts are saved instead)."""
    router = FAMILIES[ctx.spec.model_type].config.moe
    sigmoid = router is not None and router.router == "sigmoid_fp32"
    return sigmoid and not ctx.dtypes.autocast and ctx.dtypes.param != FP32


def every_expert_moe_saved(ctx: LayerContext, out: Saved) -> None:
    """Llama 4's MoE block: the router's top-k indices and its fp32 sigmoid scores; every token
    repeated for every expert (in the norm output's dtype, the residual's under autocast) and
    times its score (a column copy of the scores), through batched matmuls: their input (the
    product, or autocast's cast of it) where the weights train, gate_up, act(gate) and, where
    down_proj trains, act(gate) * up; beside them the shared expert, a gated MLP."""
    spec, p = ctx.spec, ctx.dtypes.proj
    e, k, inter, h = (
        spec.num_experts,
        spec.num_experts_per_tok,
        spec.moe_intermediate_size,
        spec.hidden_size,
    )
    out.add("mlp.router.indices", INT64 * k)
    out.add("mlp.router.sigmoid", FP32 * e)
    out.add("mlp.router.scores", p * e)
    trained = ctx.trainable_base
    out.add("mlp.experts.in", e * ctx.dtypes.residual * h)
    out.add("mlp.experts.scaled", e * p * h * trained)
    out.add("mlp.experts.gate_up", e * 2 * p * inter)
    out.add("mlp.experts.act", e * p * inter)
    out.add("mlp.experts.product", e * p * inter * trained)
    gated_mlp_saved(ctx, out, SHARED_EXPERT, spec.shared_expert_intermediate_size)


# One step of a backward program (every_expert_moe_backward, gated_mlp_backward): ("alloc",
# key, bytes), ("free", key), ("free_saved", name: the layer's saved entries of that name),
# ("free_saved_one", name: the first of them), ("free_saved_last", name: the last of them),
# ("grad", bytes: a weight's gradient, which the caller keeps after the program), ("grad_kept",
# bytes: one kept where it is made), ("mark",): a high point.
BackwardStep = tuple


def gated_mlp_backward(ctx: LayerContext, tokens: int) -> list[BackwardStep]:
    """A dense gated MLP's backward in autograd's order (the traced step's, and H200 allocator
    traces' under FSDP2), for a trained layer with separate gate and up projections and no
    biases. The residual dropout's gradient (where it saves a mask); down_proj's weight
    gradient and d(product); then

    - without autocast, memplan's GLU kernel, a strategy or checkpointing (with it this order
      alone moved recorded reserved peaks away from the GPU's: docs/accuracy.md): the saved
      product freed, d(act) and d(up) (the high point), the product's factors freed, up's
      first; up_proj's weight and input gradients; d(gate), gate freed; gate_proj's;
    - with memplan's GLU kernel inside FSDP2's mixed precision (down_proj saves the product
      in autocast; the weights are gathered in bf16): the high point at d(product), beside
      gate, up, the product and down_proj's weight gradient; the product and d(product) freed
      (the kernel writes d(gate) and d(up) over gate and up); up_proj's weight and input
      gradients, up freed; gate_proj's, gate freed (docs/distributed.md);

    the MLP's input freed (the norm's output, or the residual stream after a post-norm layer's
    attention); the input gradients' sum. Each weight gradient is kept where it is made. Empty
    elsewhere, where the MLP's mark stands instead (timeline.mlp_backward_transient)."""
    spec = ctx.spec
    glu = GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act) in ctx.kernels
    saved_product = glu and ctx.under_autocast and not ctx.dtypes.autocast
    plain = not (glu or ctx.under_autocast or ctx.setup.strategy or ctx.setup.grad_checkpointing)
    if (
        not (plain or saved_product)
        or ctx.moe
        or not ctx.output_needs_grad(2)
        or not ctx.trainable_base
        or ctx.setup.lora_rank
        or spec.fused_gate_up
        or spec.mlp_bias
    ):
        return []
    p = ctx.dtypes.proj
    inter, hidden = tokens * p * spec.intermediate_size, tokens * p * spec.hidden_size
    weight = ctx.dtypes.param * spec.hidden_size * spec.intermediate_size
    dropout = bool(spec.residual_dropout) and ctx.output_needs_grad(3)
    steps: list[BackwardStep] = []
    if dropout:
        steps += [("alloc", "g_dropout", hidden), ("free_saved", "mlp.dropout")]
    steps += [("grad_kept", weight), ("alloc", "g_product", inter)]
    if saved_product:
        steps += [("mark",)]
    if dropout:
        steps += [("free", "g_dropout")]
    steps += [("free_saved", "mlp.down_in")]
    if saved_product:
        steps += [("free", "g_product"), ("grad_kept", weight), ("alloc", "g_in_up", hidden)]
        steps += [("free_saved_last", "mlp.gate_up"), ("grad_kept", weight)]
        steps += [("alloc", "g_in_gate", hidden), ("free_saved", "mlp.gate_up")]
    else:
        steps += [("alloc", "g_act", inter), ("alloc", "g_up", inter)]
        steps += [("mark",), ("free", "g_product")]
        steps += [("free_saved", "mlp.act"), ("free_saved_last", "mlp.gate_up")]
        steps += [("grad_kept", weight), ("alloc", "g_in_up", hidden), ("free", "g_up")]
        steps += [("alloc", "g_gate", inter), ("free", "g_act"), ("free_saved", "mlp.gate_up")]
        steps += [("grad_kept", weight), ("alloc", "g_in_gate", hidden), ("free", "g_gate")]
    steps += [("free_saved", "mlp.in" if spec.post_norm else "norm.mlp.out")]  # its input
    steps += [("alloc", "g_in", hidden), ("free", "g_in_up"), ("free", "g_in_gate")]
    return [*steps, ("free", "g_in")]


def fused_qkv_programs(
    ctx: LayerContext, saved: Saved, tokens: int, programs: dict[str, list[ForwardStep]]
) -> dict[str, list[ForwardStep]]:
    """One qkv_proj's output (Phi-3), of which q, k and v are views: alive from before the
    saved q, k and v (RoPE's outputs) until attention's output is made. None where another
    program surrounds those entries or they are not saved."""
    spec = ctx.spec
    names = {name for name, _, _ in saved.tensors}
    if not spec.fused_qkv or not {"attn.qkv", "attn.out"} <= names:
        return {}
    if "attn.qkv" in programs or "attn.out" in programs:
        return {}
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    fused = tokens * ctx.dtypes.proj * (q_out + 2 * kv_out)
    return {
        "attn.qkv": [("alloc", "attn.fused_qkv", fused), ("saved",)],
        "attn.out": [("saved",), ("free", "attn.fused_qkv")],
    }


def gated_mlp_first_forward(ctx: LayerContext, tokens: int) -> list[ForwardStep]:
    """A checkpointed dense gated MLP's first forward (checkpoint's hooks keep nothing), as the
    traced step runs transformers' MLP: each output freed once nothing reads it. Separate
    projections: gate, act(gate), gate freed, up, the product, act and up freed, down_proj's
    output, the product freed; with memplan's GLU kernel gate and up are both read by the
    product, then freed. One gate_up_proj: its output (of which gate and up are views, alive
    until the MLP returns), act(gate) (not with the kernel), the product, down_proj's output.
    down_proj's output is left for the caller to free once the residual sum is made. Empty
    where adapters, biases or dropout change the ops."""
    spec = ctx.spec
    glu = GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act) in ctx.kernels
    if (
        not ctx.setup.grad_checkpointing
        or ctx.moe
        or ctx.setup.lora_rank
        or spec.mlp_bias
        or spec.residual_dropout
        or spec.post_norm
    ):
        return []
    p = ctx.dtypes.proj
    inter, hidden = tokens * p * spec.intermediate_size, tokens * p * spec.hidden_size
    if spec.fused_gate_up:
        steps: list[ForwardStep] = [("alloc", "gate_up", 2 * inter)]
        if glu:
            steps += [("alloc", "product", inter)]
        else:
            steps += [("alloc", "act", inter), ("alloc", "product", inter), ("free", "act")]
        steps += [("alloc", "down", hidden)]
        return [*steps, ("free", "product"), ("free", "gate_up")]
    if glu:
        steps = [("alloc", "gate", inter), ("alloc", "up", inter), ("alloc", "product", inter)]
        steps += [("free", "gate"), ("free", "up")]
        return [*steps, ("alloc", "down", hidden), ("free", "product")]
    steps = [("alloc", "gate", inter), ("alloc", "act", inter), ("free", "gate")]
    steps += [("alloc", "up", inter), ("alloc", "product", inter), ("free", "act")]
    return [*steps, ("free", "up"), ("alloc", "down", hidden), ("free", "product")]


def every_expert_moe_backward(ctx: LayerContext, tokens: int) -> list[BackwardStep]:
    """Llama 4's MoE block backward, in autograd's order, as allocations, frees and high points
    (bytes for `tokens` rows): the experts' output gradient, a copy of the sum's expanded
    gradient, first; the shared expert's backward (down, up, gate), its input gradient kept; the
    experts': down_proj's weight gradient, d(product), the saved product freed, d(up) and
    d(act); d(gate), gate_up's gradient (the two halves joined); gate_up_proj's weight
    gradient and the experts' input gradient; the product with the scores' two gradients; the
    repeat's sum over experts, added to the shared expert's; the router's weight gradient.
    Under autocast each weight gradient is made in bf16 and cast to the fp32 weight's dtype,
    the copies autocast saved are freed with their matmul, and the gradients of the fp32
    tensors (the sum, the scaled input, the residual's) are fp32."""
    spec, d = ctx.spec, ctx.dtypes
    p, res, amp = d.proj, d.residual, ctx.under_autocast
    e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    shared = spec.shared_expert_intermediate_size
    t = tokens
    glu = GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act) in ctx.kernels

    def weight_grad(key: str, elements: int) -> tuple[list[BackwardStep], list[BackwardStep]]:
        """A weight's gradient: made where its matmul's backward runs, and, under autocast,
        cast to fp32 once the matmul is done."""
        if not ctx.trainable_base:
            return [], []
        if not amp:
            return [("grad_kept", d.param * elements)], []
        return [("alloc", key, p * elements)], [("grad_kept", d.param * elements), ("free", key)]

    # the residual's gradient, fp32 under autocast: the walk's running gradient has p bytes
    steps: list[BackwardStep] = [("alloc", "g_residual", t * (res - p) * h)] if amp else []
    if amp:  # the bf16 output's and the fp32 sum's gradients, cast from the residual's
        steps += [("alloc", "g_out", t * p * h), ("alloc", "g_sum", t * FP32 * h)]
    steps += [("alloc", "g_next", t * e * p * h), ("free", "g_sum")]
    # the shared expert: down_proj, then d(up) and d(act) (the GLU kernel writes them over its
    # saved gate and up), up_proj, act(gate), gate_proj
    made, cast = weight_grad("w_down_s", h * shared)
    steps += [*made, ("alloc", "g_prod_s", t * p * shared), ("free", "g_out")]
    steps += [("free_saved", SHARED_EXPERT + ".autocast.down")]
    steps += [("free_saved", SHARED_EXPERT + ".down_in"), *cast]
    if not glu:
        steps += [("alloc", "g_up_s", t * p * shared), ("alloc", "g_act_s", t * p * shared)]
    steps += [("mark",), ("free", "g_prod_s"), ("free", "g_up_s"), ("free", "g_act_s")]
    for name in ("act", "gate_up", "autocast.up", "autocast.gate"):
        steps += [("free_saved", f"{SHARED_EXPERT}.{name}")]
    for key in ("w_up_s", "w_gate_s"):
        made, cast = weight_grad(key, h * shared)
        steps += [*made, *cast]
    if amp:  # gate_proj's and up_proj's own casts of the norm's output
        steps += [("free_saved_one", "norm.mlp.out"), ("free_saved_one", "norm.mlp.out")]
    steps += [("alloc", "g_in_s", t * res * h)]
    # the experts
    made, cast = weight_grad("w_down", e * inter * h)
    steps += [*made, ("alloc", "g_prod", t * e * p * inter), ("free", "g_next")]
    steps += [("free_saved", "mlp.autocast.down"), ("free_saved", "mlp.experts.product"), *cast]
    steps += [("alloc", "g_up", t * e * p * inter), ("alloc", "g_act", t * e * p * inter)]
    steps += [("mark",), ("free", "g_prod"), ("free_saved", "mlp.experts.act")]
    steps += [("alloc", "g_gate", t * e * p * inter), ("free", "g_act")]
    steps += [("free_saved", "mlp.experts.gate_up"), ("alloc", "g_gate_up", t * e * 2 * p * inter)]
    steps += [("mark",), ("free", "g_gate"), ("free", "g_up")]
    made, cast = weight_grad("w_gate_up", e * h * 2 * inter)
    steps += [*made, ("alloc", "g_scaled", t * e * p * h), ("mark",), ("free", "g_gate_up")]
    steps += [("free_saved", "mlp.autocast.gate_up"), ("free_saved", "mlp.experts.scaled")]
    steps += cast
    if amp:  # to the fp32 product's dtype
        steps += [("alloc", "g_scaled_fp32", t * e * res * h), ("free", "g_scaled")]
    steps += [("alloc", "g_product", t * e * res * h), ("alloc", "g_in", t * e * res * h)]
    steps += [("mark",), ("alloc", "g_scores", t * e * res)]
    if amp:  # to the bf16 scores' dtype
        steps += [("alloc", "g_scores_p", t * e * p), ("free", "g_scores")]
    steps += [("free", "g_product"), ("free", "g_scaled"), ("free", "g_scaled_fp32")]
    steps += [("free_saved", "mlp.router.scores"), ("free_saved", "mlp.experts.in")]
    steps += [("alloc", "g_repeat", t * res * h), ("free", "g_in")]
    steps += [("alloc", "g_mlp", t * res * h), ("free", "g_in_s"), ("free", "g_repeat")]
    made, cast = weight_grad("w_router", e * h)
    steps += [("free", "g_scores"), ("free", "g_scores_p"), *made, *cast, ("free", "g_mlp")]
    return [*steps, ("free", "g_residual")]


def scores_attention_backward(
    ctx: LayerContext, tokens: int, o_grads: list[int], rest_grads: list[int]
) -> list[BackwardStep]:
    """The backward of attention that materializes (heads x seq) scores (eager, SDPA's math
    path; latent attention's too, its v heads value_dim wide; not gpt-oss's sinks), in
    autograd's order, as BackwardSteps over the layer's entries saved before its MLP: o_proj's (its
    weight gradients `o_grads`, its input's gradient, what it saved freed; the output gate's
    gradient, held until q's joins it in q_proj's output), matmul(probs, v)'s
    (d(v) repeated to all heads and d(probs); the cast or dropped probabilities and the
    repeated v freed), dropout's (its mask freed), the cast of d(probs) to the softmax's dtype,
    softmax backward at the high point: d(probs), the d(scores) it writes and grad * output,
    which CUDA's kernel forms first and frees before it returns
    (benchmarks/results_softmax_backward_trace_h100.json); then matmul(q, k)'s, and the
    gradients of q, k, v and their projections (`rest_grads`) after it."""
    spec = ctx.spec
    nh, hd, seq = spec.num_attention_heads, spec.head_dim, ctx.seq
    p, ps = ctx.dtypes.proj, scores_bytes(ctx)
    softmax = FP32 if ctx.setup.attn != "eager" or spec.eager_softmax_fp32 else ps
    q_grad, k_grad, v_grad = qkv_need_grad(ctx)
    scores_grad = q_grad or k_grad
    heads, scores = tokens * nh * hd, tokens * nh * seq
    values = tokens * nh * spec.value_dim  # latent attention's v heads: narrower than q's
    steps: list[BackwardStep] = [("grad", n) for n in o_grads]
    if spec.attention_output_gate and q_grad:
        steps += [("alloc", "d_gate", heads * p)]
    steps += [("alloc", "d_out", values * p)]
    steps += [("free_saved", name) for name in O_PROJ_SAVED]
    steps += [("alloc", "d_v", values * ps * v_grad)]
    steps += [("alloc", "d_probs", scores * ps * scores_grad)]
    steps += [("free", "d_out"), *(("free_saved", name) for name in PV_SAVED)]
    if scores_grad:
        grad = "d_probs"
        if spec.attention_dropout > 0:  # d(probs) before dropout, from its kept mask
            steps += [("alloc", "d_undropped", scores * ps), ("free", grad)]
            steps += [("free_saved", "attn.dropout")]
            grad = "d_undropped"
        if softmax != ps:
            steps += [("alloc", "d_probs_cast", scores * softmax), ("free", grad)]
        steps += [("alloc", "d_scores", scores * softmax)]
        steps += [("alloc", "grad_x_out", scores * softmax)]
        steps += [("mark",), ("free", "grad_x_out"), ("free", grad), ("free", "d_probs_cast")]
        steps += [("free_saved", "attn.probs")]
        steps += [("alloc", "d_q", heads * ps * q_grad), ("alloc", "d_k", heads * ps * k_grad)]
        steps += [("free", "d_scores")]
    steps += [("grad", n) for n in rest_grads]
    return [*steps, ("free", "d_q"), ("free", "d_k"), ("free", "d_v"), ("free", "d_gate")]


# The entries of layer_saved of Llama 4's shared expert, which runs after the experts.
SHARED_EXPERT = "mlp.shared"
# Qwen3-Next's product of the shared expert's output with its sigmoid gate.
SHARED_EXPERT_GATE = "mlp.shared_gate"


def every_expert_moe_peaks(ctx: LayerContext, grad: bool) -> list[list[float]]:
    """Per token, what Llama 4's MoE block holds beyond what the layer saves at its highest
    points: the second expert matmul's output allocated (without a graph, its input too), and
    the sum of the experts' outputs beside the shared expert's. Each holds the layer's input
    and the residual after attention (the model's loop and the layer's locals) where no norm
    saves them as they are, the attention's output (a local until the layer returns), the
    router's scores and logits, the norm's output and the scaled expert input where nothing
    saves them as they are, and the experts' output; the first the product before down_proj
    where it is not saved (and, without grad, gate_up), the second the shared expert's output
    and the sum. `grad`: the forward records the graph (not a checkpointed layer's first
    forward)."""
    spec, d = ctx.spec, ctx.dtypes
    e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    res, p = d.residual, d.proj
    inputs_kept = grad and ctx.trainable_base and not d.autocast
    # fp32 residuals are the very tensors the norms' pow keeps (x.float() returns x)
    norm_keeps = grad and res == FP32 and "rms_norm" not in ctx.kernels
    input_norm_keeps = norm_keeps and (ctx.needs_input_grad or ctx.trainable_base)
    residuals = [res * h] * (2 - norm_keeps - input_norm_keeps)
    # in fp32 the router's scores are its sigmoid's saved output (.to returns it)
    scores = [] if grad and p == FP32 else [p * e]
    common = [*residuals, p * h, *scores, p * e]
    common += [] if inputs_kept else [res * h, e * res * h]
    # eager attention returns its probabilities, a local of the layer (`_`) unless saved
    probs_saved = grad and any(qkv_need_grad(ctx))
    if ctx.setup.attn == "eager" and not probs_saved:
        common.append(p * spec.num_attention_heads * ctx.seq)
    experts_out = e * p * h
    product = [] if grad and ctx.trainable_base else [e * p * inter]
    # CUDA autocast sums in fp32 (sum gets dtype=float32)
    summed = [experts_out, p * h, (FP32 if ctx.under_autocast else p) * h]
    if grad:
        return [[*common, *product, experts_out], [*common, *summed]]
    # without a graph act(gate) lives until the product is made, gate_up until the experts
    # return
    gate_up = [e * 2 * p * inter]
    return [
        [*common, *gate_up, e * p * inter, *product],
        [*common, *gate_up, *product, experts_out],
        [*common, *summed],
    ]


def layer_saved(ctx: LayerContext) -> Saved:
    """Everything one decoder layer saves for backward, per token."""
    spec, d = ctx.spec, ctx.dtypes
    out = Saved()
    gemma_norm = gemma_norms(spec)
    qkv_consumers = 1 if spec.fused_qkv else 2 if spec.values_from_keys else 3
    if spec.mla:  # q's projection (or its latent's) and the kv latent's
        qkv_consumers = 2
    mlp_consumers = 1 if spec.fused_gate_up else 2
    if ctx.moe:
        # the router (unless it keeps an fp32 copy of its own), the shared experts' gate and
        # up and their output's gate linear; the experts gather their rows from the input
        shared = 2 if spec.shared_expert_intermediate_size else 0
        shared += shared_expert_gated(spec)
        mlp_consumers = shared + (0 if router_copies_input(ctx) else 1)
    if ctx.setup.lora_rank:
        # Frozen base linears save no input; peft's adapters save their own fp32 cast of it.
        qkv_consumers = mlp_consumers = 0
    if spec.deltanet:  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (or qkvz and ba)
        qkv_consumers = 0 if ctx.setup.lora_rank else len(deltanet_projection_widths(spec))
    p_res = d.residual
    post_norms = spec.sandwich_norm or spec.post_norm
    if spec.post_norm:  # q, k and v read the residual stream itself
        linear_inputs_saved(ctx, out, LAYER_INPUT, spec.hidden_size, p_res, qkv_consumers)
    else:
        norm_saved(
            ctx,
            out,
            "norm.attn",
            spec.hidden_size,
            p_res,
            qkv_consumers,
            ctx.trainable_base,
            gemma_norm,
            input_requires_grad=ctx.needs_input_grad,
        )
    if spec.deltanet:
        deltanet_saved(ctx, out, ctx.cached)
    else:
        attention_saved(ctx, out)
    if spec.residual_dropout and ctx.output_needs_grad(1):
        out.add("attn.residual_dropout", dropout_saved_bytes(ctx, d.proj) * spec.hidden_size)
    after_attention = ctx.output_needs_grad(1)
    if post_norms:
        norm_saved(
            ctx,
            out,
            "norm.post_attn",
            spec.hidden_size,
            d.proj,
            0,
            ctx.trainable_base,
            gemma_norm,
            input_requires_grad=after_attention,
        )
    if spec.post_norm:  # the MLP reads the residual stream itself
        linear_inputs_saved(ctx, out, "mlp.in", spec.hidden_size, p_res, mlp_consumers)
    else:
        norm_saved(
            ctx,
            out,
            "norm.mlp",
            spec.hidden_size,
            p_res,
            mlp_consumers,
            ctx.trainable_base,
            gemma_norm,
            input_requires_grad=after_attention,
        )
    mlp_saved(ctx, out)
    if spec.residual_dropout and ctx.output_needs_grad(3):
        out.add("mlp.dropout", dropout_saved_bytes(ctx, d.proj) * spec.hidden_size)
    if post_norms:
        norm_saved(
            ctx,
            out,
            "norm.post_mlp",
            spec.hidden_size,
            d.proj,
            0,
            ctx.trainable_base,
            gemma_norm,
            input_requires_grad=ctx.output_needs_grad(3),
        )
    if spec.layer_scalar and ctx.output_needs_grad(3):
        # the in-place product keeps the buffer, the model's dtype (fp32 under autocast)
        out.add("layer_scalar", constant=d.param)
    rank = ctx.setup.lora_rank
    if rank:
        # peft keeps adapters in fp32 and casts their input to fp32 (autocast_adapter_dtype):
        # A saves that cast, B saves A's (rank-wide) output. Under autocast both matmuls save
        # their low-precision casts instead, and the copy autocast caches of B's weight; of A's
        # only where A's input needs a gradient (not before the first adapter of the first
        # layer: measured on an H200, probe_memory.py saved --lora).
        # In fp32 nothing is cast: adapters that read the same input save it once, and o_proj's
        # adapter saves attention's output, which attention_saved counts (attn.out).
        saved_dtype = d.proj if d.autocast else FP32
        shared_input = adapters_share_inputs(d)
        inputs_saved = {LORA_TARGET_STAGE["o_proj"]} if ctx.output_needs_grad(0) else set()
        for target in layer_lora_targets(spec, ctx.setup):
            fan_in, fan_out = LORA_TARGET_SHAPES[target](spec)
            stage = LORA_TARGET_STAGE[target]
            read = LATENT_READERS.get(target, stage)  # what the adapter reads
            input_bytes = 0 if shared_input and read in inputs_saved else fan_in
            inputs_saved.add(read)
            out.add_each(f"lora.{target}", saved_dtype * input_bytes, saved_dtype * rank)
            if d.autocast:
                a_kept = ctx.needs_input_grad or first_stage_after(ctx.lora_targets) <= stage
                a_kept = a_kept or latent_input_needs_grad(ctx, target)
                out.add(f"lora.weights.{target}", constant=d.proj * rank * fan_in * a_kept)
                out.add(f"lora.weights.{target}", constant=d.proj * rank * fan_out)
    if d.autocast:
        # A low-precision copy of every matmul weight, saved by the matmul: the one autocast
        # caches for a trainable weight, or a frozen weight's own cast on each call (autocast
        # caches none), saved where the matmul's input needs a gradient (measured on an H200,
        # llama-3.2-1b amp-bf16 with LoRA on q and v).
        first = 0 if ctx.needs_input_grad else first_stage_after(ctx.lora_targets)
        tensors = autocast_weight_tensors(spec, first, ctx.moe)
        names = autocast_weight_names(spec, ctx.moe)[-len(tensors) :] if tensors else []
        for name, params in zip(names, tensors, strict=True):
            out.add(name, constant=d.proj * params)
        if first > 0:  # a latent up-projection whose input needs a gradient before that stage
            for name, rows, cols in latent_weights(spec):
                if latent_input_needs_grad(ctx, name):
                    out.add("autocast.weights", constant=d.proj * rows * cols)
    return out


# What the input norm and k_proj / v_proj, k_norm and v_norm save (layer_saved's names): the
# ops on the path of a layer's k and v.
KV_PATH = ("norm.attn", "attn.k_norm", "attn.v_norm", "lora.k_proj", "lora.v_proj")
KV_PATH += ("lora.weights.k_proj", "lora.weights.v_proj")


def kv_path_saved(ctx: LayerContext, saved: Saved) -> list[tuple[float, int]]:
    """(per token, constant) bytes of each tensor a layer saves (`saved`, layer_saved's) on the
    path of its k and v: what their autograd graph holds as long as something holds them
    (Gemma 4's shared_kv_states, after a checkpointed layer's recomputation). Of the input
    norm's output, under autocast, the casts k_proj and v_proj save (not q_proj's, the first);
    of an input that fp32 adapters share, the first adapter's entry; the casts autocast makes
    of k_proj's and v_proj's weights where their input needs a gradient."""
    spec, d = ctx.spec, ctx.dtypes
    out_entries = [t for t in saved.tensors if t[0] == "norm.attn.out"]
    kept = [(n, c) for name, n, c in out_entries[1:] if d.autocast]
    kept += [(n, c) for name, n, c in out_entries[:1] if not d.autocast]
    kept += [(n, c) for name, n, c in saved.tensors if name in KV_PATH]
    lora = [t for t in saved.tensors if t[0].startswith("lora.") and "weights" not in t[0]]
    kv_adapted = any(name in ("lora.k_proj", "lora.v_proj") for name, _, _ in lora)
    stage0 = [t for t in lora if t[0] in ("lora.q_proj", "lora.k_proj", "lora.v_proj")]
    if adapters_share_inputs(d) and kv_adapted and stage0 and stage0[0][0] == "lora.q_proj":
        kept.append((stage0[0][1], stage0[0][2]))  # q's adapter saved the input k's and v's share
    first = 0 if ctx.needs_input_grad else first_stage_after(ctx.lora_targets)
    if d.autocast and first == 0:
        projections = 1 if spec.values_from_keys else 2
        kv_weight = spec.hidden_size * spec.num_key_value_heads * spec.head_dim
        kept += [(0.0, d.proj * kv_weight)] * projections
    return kept


# Llama 4's MoE weights as autocast copies them, in autocast_weight_tensors' order: named so
# that its backward frees each copy where the matmul that saved it is done.
EVERY_EXPERT_AUTOCAST_NAMES = (
    "mlp.autocast.router",
    "mlp.autocast.gate_up",
    SHARED_EXPERT + ".autocast.gate",
    SHARED_EXPERT + ".autocast.up",
    "mlp.autocast.down",
    SHARED_EXPERT + ".autocast.down",
)


def autocast_weight_names(spec: ModelSpec, moe: bool = False) -> list[str]:
    """The layer_saved names of autocast_weight_tensors(spec, 0, moe)'s copies."""
    count = len(autocast_weight_tensors(spec, 0, moe))
    qkv = count - len(autocast_weight_tensors(spec, 1, moe))
    names = ["autocast.weights"] * qkv + ["autocast.weights.o_proj"]
    if not (moe and spec.moe_router == "sigmoid_every_expert"):
        return names + [MLP_AUTOCAST_WEIGHTS] * (count - qkv - 1)
    experts = list(EVERY_EXPERT_AUTOCAST_NAMES)
    return names + [MLP_AUTOCAST_WEIGHTS] * (count - qkv - 1 - len(experts)) + experts


# autocast's copies of the MLP's (or MoE block's router and shared expert's) weights
MLP_AUTOCAST_WEIGHTS = "mlp.autocast.weights"


def gemma_norms(spec: ModelSpec) -> bool:
    """RMSNorms that multiply by the weight in fp32 and keep x * rstd for its gradient."""
    return FAMILIES[spec.model_type].gemma_norms


# The matmuls of a layer in forward order: q/k/v, o, gate/up (MoE: router and experts' gate
# and up), down. Under LoRA the first layer's input needs no gradient: only the matmuls after the
# first adapted one have inputs that do.
LORA_TARGET_STAGE = {
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "qkv_proj": 0,
    "q_a_proj": 0,
    "q_b_proj": 0,
    "kv_a_proj_with_mqa": 0,
    "kv_b_proj": 0,
    "o_proj": 1,
    "gate_proj": 2,
    "up_proj": 2,
    "gate_up_proj": 2,
    "down_proj": 3,
}


# Latent attention's up-projections read their latent's norm, not the layer's input norm.
LATENT_READERS = {"q_b_proj": "q_latent", "kv_b_proj": "kv_latent"}


def latent_input_needs_grad(ctx: LayerContext, target: str) -> bool:
    """Whether a latent up-projection's input (its latent's norm output) needs a gradient in a
    layer whose input needs none: where the latent's down-projection is adapted."""
    if not ctx.spec.mla or target not in LATENT_READERS:
        return False
    grads = latent_grads(ctx)
    return grads.q_latent if target == "q_b_proj" else grads.kv_latent


def first_stage_after(lora_targets: tuple[str, ...]) -> int:
    """The first matmul stage whose input needs a gradient when the layer's input does not."""
    stages = [LORA_TARGET_STAGE[t] for t in lora_targets if t in LORA_TARGET_STAGE]
    return min(stages) + 1 if stages else len(set(LORA_TARGET_STAGE.values()))


def autocast_weight_params(spec: ModelSpec, first_stage: int = 0, moe: bool = False) -> int:
    """Weights of one layer that autocast copies to low precision for its matmuls, from
    first_stage on (LORA_TARGET_STAGE): attention and MLP weights, not biases. Of a MoE block
    (`moe`) the router and the shared experts' MLP: the experts' grouped matmuls are not
    autocast ops (moe_saved); Llama 4's batched expert matmuls are."""
    return sum(autocast_weight_tensors(spec, first_stage, moe))


def autocast_weight_tensors(spec: ModelSpec, first_stage: int = 0, moe: bool = False) -> list[int]:
    """The elements of each weight autocast_weight_params counts, one copy each."""
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    gate = q_out if spec.attention_output_gate else 0
    qkv = [h * (q_out + 2 * kv_out)] if spec.fused_qkv else [h * (q_out + gate), h * kv_out]
    if not spec.fused_qkv:
        qkv += [h * kv_out]
    if spec.values_from_keys:
        qkv = qkv[:2]
    o_weight = [h * q_out]
    if spec.mla:  # the latent projections in forward order, o_proj v_head_dim wide per head
        latent = [rows * cols for name, rows, cols in latent_weights(spec)]
        qkv, o_weight = latent[:-1], latent[-1:]
    if spec.deltanet:  # the input projections, then out_proj (the conv's copy is its own)
        qkv = [h * width for width in deltanet_projection_widths(spec)]
        o_weight = [h * linear_value_dim(spec)]
    if moe and spec.moe_router == "sigmoid_every_expert":
        # Llama 4's experts run torch.bmm, an autocast op, beside a shared gated MLP
        e, width, shared = (
            spec.num_experts,
            spec.moe_intermediate_size,
            spec.shared_expert_intermediate_size,
        )
        gate_up = [h * e, e * h * 2 * width, shared * h, shared * h]
        down = [e * width * h, h * shared]
    elif moe:
        shared = spec.shared_expert_intermediate_size
        router = FAMILIES[spec.model_type].config.moe
        if shared_expert_gated(spec):  # the shared expert first, its output's gate last
            gate_up = [h * shared] * 2 + [h * spec.num_experts, h]
        elif router is not None and router.router == "sigmoid_fp32":
            gate_up = [h * spec.num_experts] + [h * shared] * 2 * bool(shared)
        else:
            gate_up = [h * spec.num_experts]
        down = [h * shared] if shared else []
    else:
        gate_up = [2 * h * inter] if spec.fused_gate_up else [h * inter, h * inter]
        down = [h * inter]
    stages = (qkv, o_weight, gate_up, down)
    return [n for stage in stages[first_stage:] for n in stage]


def latent_weights(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """Latent attention's matmul weights (no norms, no biases), in forward order."""
    tensors = latent_attention_tensors(spec)
    return [t for t in tensors if not t[0].endswith("layernorm") and t[2] != 1]
