"""Memory contract of Qwen3.5's gated DeltaNet layer as transformers 5.17 runs it: the causal
conv either in torch or causal-conv1d's CUDA kernel (setup.deltanet_conv "causal_conv1d"; read
off causal-conv1d 1.6's source), the chunked delta rule either transformers' torch fallback
(torch_chunk_gated_delta_rule; read off the tensors autograd saves on the CPU, checked by
tests/test_estimator_contracts.py and tests/test_deltanet_contract.py) or
flash-linear-attention's (setup.deltanet_kernels "fla"; read off fla 0.6's source). The fast
kernels' saved bytes are checked on a GPU by tests/test_deltanet_fast_kernels.py.

Notation: T = batch x seq tokens, c = ceil(seq / 64) chunks, Tp = 64 x batch x c padded tokens,
nk / nv key / value heads, dk / dv their dims, C = 2 nk dk + nv dv the conv's channels, K its
taps, p the projections' bytes (2 in bf16 and under autocast, 4 in fp32)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimators.params import fused_deltanet

if TYPE_CHECKING:
    from memplan.estimators.contracts import LayerContext, Saved
    from memplan.schema import ModelSpec, TrainSetup

FP32 = 4
CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size, and fla's
# Triton's do_bench clears the L2 cache through a buffer of this size each time it benchmarks
# an autotuned kernel (its CUDA driver's get_empty_cache_for_benchmark)
TRITON_BENCHMARK_BUFFER = 256 * 2**20
# The entries of deltanet_saved that the chunked delta rule saves
RULE_ENTRIES = ("delta.qk", "delta.chunk")


def chunks(seq: int) -> int:
    return -(-seq // CHUNK)


def conv_channels(ctx: LayerContext) -> int:
    spec = ctx.spec
    return 2 * spec.linear_num_key_heads * spec.linear_key_head_dim + value_width(ctx)


def value_width(ctx: LayerContext) -> int:
    return ctx.spec.linear_num_value_heads * ctx.spec.linear_value_head_dim


def deltanet_saved(ctx: LayerContext, out: Saved, cached: bool) -> None:
    """One gated DeltaNet layer's saved tensors beyond its input (which the input projections
    keep: norm_saved's consumers). `cached`: the model's cache takes the final recurrent state
    (use_cache without checkpointing), so the last chunk's state update stays in the graph.

    - the conv's input (in_proj_qkv's output, transposed); in torch also, under autocast, its
      weight's bf16 cast, trained or frozen (convolution's backward saves both whichever needs a
      gradient), and SiLU's input, the conv output with its K - 1 padded positions (the
      causal-conv1d kernel fuses the SiLU and reads the weight as it is); sigmoid(b);
      the decay: softplus's fp32 input, and where A_log trains its output and exp(A_log),
      beside -exp(A_log);
    - the chunked rule (fla_rule_saved where flash-linear-attention runs it); in torch:
      q and k repeated to the value heads in fp32 and their L2 norms' rsqrt (fp32 with as
      many key as value heads: q and k are views of the conv output, which they keep instead);
      the chunked rule on padded fp32 tensors: beta and v padded; the normalized key, the scaled
      query and k * beta; three decay tensors and the chunk decay; the 64 x 64 bool mask; five
      64 x 64 fp32 tensors per chunk; the two triangular solves' results; the decayed key and
      query where a later chunk reads the state (the key also where the cache takes the final
      state); one recurrent state per chunk; each chunk's v_new. Unpadded in fp32, the chunk
      matmuls copy four strided operands of nv x dk per padded token;
    - the gated RMSNorm: its fp32 input, rsqrt, the normalized product in the input's dtype
      where its weight trains, weight x that product (fp32 under autocast, whose weight is
      fp32), the fp32 gate and its SiLU; with memplan's kernel (rms_norm) its input, the gate
      and rsqrt; out_proj's input where its weight trains."""
    if not ctx.needs_input_grad:
        return  # no adapter inside: nothing before the layer's output needs a gradient
    spec, p, d = ctx.spec, ctx.dtypes.proj, ctx.dtypes
    batch, seq = ctx.setup.batch, ctx.seq
    nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
    conv = conv_channels(ctx)
    trained = ctx.trainable_base
    fp32_views = p == FP32 and not d.autocast
    # the conv's input (torch's conv under autocast: a bf16 cast of an fp32 copy); torch's also
    # the padded output, and input and weight even where only the input needs a gradient
    out.add("delta.conv", p * conv)
    if ctx.setup.deltanet_conv == "torch":
        if d.autocast:  # conv1d is an autocast op: the cast of its fp32 weight
            out.add("delta.conv", constant=p * conv * spec.linear_conv_kernel_dim)
        taps = spec.linear_conv_kernel_dim
        out.add("delta.conv", constant=p * conv * batch * (seq + taps - 1))
    out.add("delta.beta", p * nv)
    out.add("delta.decay", constant=FP32 * nv * trained)
    out.add_each("delta.decay", FP32 * nv, FP32 * nv * trained)
    out.add("delta.decay", constant=FP32 * nv)
    if ctx.setup.deltanet_kernels == "fla":
        fla_rule_saved(ctx, out)
    else:
        torch_rule_saved(ctx, out, cached)
    v = value_width(ctx)
    # with as many key as value heads Qwen3-Next's z is a view of the whole in_proj_qkvz
    # output, which a saved z keeps
    z_keeps_qkvz = nk == nv and fused_deltanet(spec)
    if "rms_norm" in ctx.kernels:  # memplan's gated RMSNorm: x, the gate z and rstd per head
        out.add_each("delta.norm", p * v, p * (conv + v) if z_keeps_qkvz else p * v, FP32 * nv)
    else:
        product = FP32 if d.autocast else p
        out.add_each("delta.norm", FP32 * v, FP32 * nv, p * v * trained, product * v)
        # the fp32 gate z (a view where it is in fp32 already)
        gate = FP32 * (conv + v) if fp32_views and z_keeps_qkvz else FP32 * v
        out.add_each("delta.norm", gate, FP32 * v)
    out.add("delta.out", p * v * trained)


def torch_rule_saved(ctx: LayerContext, out: Saved, cached: bool) -> None:
    """What transformers' torch_chunk_gated_delta_rule saves: the L2-normalized q and k (fp32)
    and the chunked rule's padded fp32 tensors (deltanet_saved's docstring lists them)."""
    spec, p, d = ctx.spec, ctx.dtypes.proj, ctx.dtypes
    batch, seq = ctx.setup.batch, ctx.seq
    nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
    dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
    c = chunks(seq)
    padded = CHUNK * batch * c
    fp32_views = p == FP32 and not d.autocast
    if fp32_views and nk == nv:
        out.add("delta.qk", p * conv_channels(ctx))  # q and k are views of the conv's SiLU output
        out.add_each("delta.qk", FP32 * nv, FP32 * nv)
    else:
        out.add_each("delta.qk", FP32 * nv * dk, FP32 * nv, FP32 * nv * dk, FP32 * nv)
    fixed = [FP32 * nv * padded, FP32 * nv * dv * padded]  # beta, v
    fixed += [FP32 * nv * dk * padded] * 3  # key, scaled query, k * beta
    fixed += [FP32 * nv * padded] * 3 + [FP32 * nv * batch * c]  # decays, chunk decay
    fixed += [CHUNK * CHUNK]  # the bool mask
    if d.autocast:
        fixed += chunk_matmuls_under_autocast(ctx, cached)
    else:
        fixed += [FP32 * nv * CHUNK * padded] * 5  # 64 x 64 per chunk
        fixed += [FP32 * nv * dv * padded, FP32 * nv * dk * padded]  # the solves' results
        # the decayed key where a later chunk or the cached final state reads it, the decayed
        # query where a chunk reads a state that needs a gradient (from the second chunk on)
        fixed += [FP32 * nv * dk * padded] * ((c > 1 or cached) + (c > 1))
        # the loop over chunks: each chunk's v_new and the state it writes, one tensor each
        fixed += [FP32 * nv * dv * batch * CHUNK, FP32 * nv * dk * dv * batch] * c
    if fp32_views and seq % CHUNK == 0:
        fixed += [FP32 * nv * dk * padded] * 4  # strided operands the chunk matmuls copy
    for nbytes in fixed:
        out.add("delta.chunk", constant=nbytes)


def fla_rule_saved(ctx: LayerContext, out: Saved) -> None:
    """What flash-linear-attention's ChunkGatedDeltaRuleFunction saves (fla 0.6, called as
    transformers calls it, use_qk_l2norm_in_kernel): fla_saved_per_token's tensors."""
    for name, nbytes in fla_saved_per_token(ctx):
        out.add(name, nbytes)


def fla_saved_per_token(ctx: LayerContext) -> list[tuple[str, int]]:
    """fla's saved tensors in the order it makes them, bytes per token: v's contiguous copy (v
    is a view of the transposed conv output), q and k L2-normalized with their fp32 rstd, the
    decay's fp32 chunk-local cumsum, and the solved 64 x 64 triangular blocks A, in the inputs'
    dtype; beta is the sigmoid's output, which sigmoid saves already. Nothing is padded."""
    spec, p = ctx.spec, ctx.dtypes.proj
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    qk = [("delta.qk", p * nv * dk), ("delta.qk", FP32 * nv)] * 2
    return [
        ("delta.chunk", p * nv * dv),
        *qk,
        ("delta.chunk", FP32 * nv),
        ("delta.chunk", p * nv * CHUNK),
    ]


def chunk_matmuls_under_autocast(ctx: LayerContext, cached: bool) -> list[int]:
    """What the chunked rule keeps of its matmuls under autocast, which casts their fp32
    operands (a new cast each time) and returns bf16: the 64 x 64 decay and the triangular
    system in fp32; the two intra-chunk products in bf16 (their products with the decay keep
    them) and the casts of k * beta, q and k twice; the solves' fp32 results; the fp32 state per
    chunk. Then the chunks' casts: the intra-chunk attention and v_new for their product; the
    state twice (its products with k_cumdecay and q, from the zero state on); k_cumdecay and q
    from the second chunk on (where the state needs a gradient); k and v_new for the state's
    update where a later chunk or the cached final state reads it."""
    spec, p = ctx.spec, ctx.dtypes.proj
    batch, c = ctx.setup.batch, chunks(ctx.seq)
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    padded = CHUNK * batch * c
    keys, values, squares = nv * dk * padded, nv * dv * padded, nv * CHUNK * padded
    state = nv * dk * dv * batch
    out = [FP32 * squares] * 2 + [p * squares] * 2 + [p * keys] * 4
    out += [FP32 * values, FP32 * keys, FP32 * state * c]
    # the chunks' casts summed by kind: one allocation a chunk would make a long sequence's walk
    # as long as its chunks are many
    updates = c - 1 + cached
    out += [p * squares, p * values, p * state * c, p * state * c]
    out += [p * keys // c * (c - 1)] * 2 + [p * keys // c * updates, p * values // c * updates]
    return [n for n in out if n]


def fla_autotuned_layer(spec: ModelSpec, setup: TrainSetup) -> int | None:
    """The layer whose backward autotunes one of fla's kernels at the step's high point: its
    chunk-local cumsum is autotuned per batch size (the batch is in its key), so a process's
    first step at a batch benchmarks it in the first DeltaNet backward, the last DeltaNet
    layer's, beside the rule's backward transients; an autotuning that runs out of memory is
    not cached, so every first step does. None where fla does not run the rule."""
    if setup.deltanet_kernels != "fla" or not spec.linear_attention_layers:
        return None
    return max(spec.linear_attention_layers)


def deltanet_cache_bytes(ctx: LayerContext) -> list[int]:
    """What the model's cache holds of one gated DeltaNet layer until the forward returns: the
    last K conv inputs (the projections' dtype) and the final recurrent state (fp32)."""
    spec = ctx.spec
    batch = ctx.setup.batch
    conv = ctx.dtypes.proj * batch * conv_channels(ctx) * spec.linear_conv_kernel_dim
    state = FP32 * batch * spec.linear_num_value_heads
    return [conv, state * spec.linear_key_head_dim * spec.linear_value_head_dim]


def deltanet_forward_peak(
    ctx: LayerContext, layer_saved: list[int], rule_saved: list[int], tokens: int
) -> list[int]:
    """What one gated DeltaNet layer's forward holds at its high point beyond the layer's
    start, tensor by tensor (not read off autograd: an estimate). `layer_saved`: each tensor the
    layer saves, the MLP's included; `rule_saved`: those saved up to the chunked rule's.

    torch's rule: recording the graph, the high point comes after the chunked rule, with
    everything the layer saves (each tensor: as one block it would take a segment of its own in
    the allocator model, which no tensor of the step reuses) and the residual pair alive, as the
    traced step shows it; in a checkpointed layer's graph-free forward, the padded fp32 q, k, v
    and beta, two 64 x 64 fp32 tensors per chunk and the residual pair. fla's rule: its own
    high point (fla_rule_transient) where that is above the layer's end."""
    spec, d = ctx.spec, ctx.dtypes
    pair = [tokens * d.residual * spec.hidden_size] * 2
    if ctx.setup.deltanet_kernels == "fla":
        held = fla_rule_transient(ctx, tokens)
        if ctx.setup.grad_checkpointing:  # what the rule saves is its transient here
            return [tokens * n for _, n in fla_saved_per_token(ctx)] + held + pair
        at_rule = [*rule_saved, *held, *pair]
        at_end = [*layer_saved, *pair]
        return at_rule if sum(at_rule) > sum(at_end) else at_end
    if not ctx.setup.grad_checkpointing:
        return [*layer_saved, *pair]
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    padded = CHUNK * ctx.setup.batch * chunks(ctx.seq)
    rule = FP32 * nv * padded * (2 * dk + dv + 1 + 2 * CHUNK)
    return [rule, *pair]


def fla_states(ctx: LayerContext) -> int:
    """fla's recurrent state at each chunk's start (h), in the inputs' dtype."""
    spec = ctx.spec
    heads = spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim
    return ctx.dtypes.proj * ctx.setup.batch * chunks(ctx.seq) * heads


def fla_rule_transient(ctx: LayerContext, tokens: int) -> list[int]:
    """What the layer holds at fla's forward high point (chunk_fwd_o's output) beside what it
    saves: the SiLU output the q, k and v views keep, z, contiguous q and k (fla's copies of
    those views, or the heads transformers repeated), the fp32 decay g, then fla's w, u, the
    state per chunk, v_new and the output."""
    spec, p = ctx.spec, ctx.dtypes.proj
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    per_token = [p * conv_channels(ctx), p * value_width(ctx), p * nv * dk, p * nv * dk]
    per_token += [FP32 * nv, p * nv * dk, p * nv * dv]
    out = [tokens * n for n in per_token]
    return [*out, fla_states(ctx), tokens * p * nv * dv, tokens * p * nv * dv]


def deltanet_backward_transient(ctx: LayerContext, tokens: int) -> list[int]:
    """What one gated DeltaNet layer's backward holds beside its saved tensors and its weights'
    gradients at its high point, inside the chunked rule's backward, z's gradient (the gated
    norm's, consumed later by its projection) beside the rule's.

    torch's rule: the fp32 gradients of the five tensors its loop over chunks slices, each a
    padded tensor that autograd accumulates chunk by chunk: the intra-chunk attention (64 x 64
    per chunk), the decayed query, new_values, k_cumdecay and the decayed key. fla's, at
    prepare_wy_repr_bwd's outputs: the output's gradient; the recomputed w, u, states and v_new;
    dh (a state per chunk), dv; dq, dk, dw and the fp32 dg (one per 128-wide block of the key
    dim); dk2, dv, db and the fp32 dg2."""
    p = ctx.dtypes.proj
    spec = ctx.spec
    nv, dk = spec.linear_num_value_heads, spec.linear_key_head_dim
    z_grad = tokens * p * value_width(ctx)
    if ctx.setup.deltanet_kernels != "fla":
        padded = CHUNK * ctx.setup.batch * chunks(ctx.seq)
        keys, values = FP32 * nv * dk * padded, FP32 * value_width(ctx) * padded
        # in the order the last chunk's backward reaches them: the output's matmuls, then v_new's
        return [z_grad, FP32 * nv * CHUNK * padded, keys, values, keys, keys]
    keys, values = tokens * p * nv * dk, tokens * p * value_width(ctx)
    states = fla_states(ctx)
    dg = tokens * FP32 * nv * -(-dk // 128)
    out = [z_grad, values, keys, values, states, values, states, values]
    out += [keys, keys, keys, dg, keys, values, tokens * p * nv, tokens * FP32 * nv]
    return out
