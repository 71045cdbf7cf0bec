"""The high point of transformers' grouped-matmul experts (integrations/moe.py,
grouped_mm_experts_forward: the default of mixtral, qwen3_moe, glm4_moe, deepseek_v3,
qwen3_5_moe_text and qwen3_next; gpt-oss's clamped gate has its own,
timeline.sink_layer_forward_peak; Llama 4 runs every expert) as a checkpointed layer's
recomputation reaches it: what the layer holds there beyond the tensors it saves for backward.
Read off the traced step (tests/traced/test_compare.py) on transformers 5.17; 5.24 runs the same
sequence without the sentinel mask's masked_fill copies, which none of these points holds.

Where the recomputation starts and stops follows torch's non-reentrant checkpoint: the first
backward node that reads a saved tensor starts it, and it stops once the last saved tensor is
made. A block that saves tensors after its experts (a shared expert's sigmoid gate, shared
experts run after them) starts it from that branch, beside the layer output's gradient alone,
and runs the experts to their end; a block that saves nothing after them starts it from the
experts' un-permuting index, once autograd has copied the output gradient expanded over the
routed rows, and stops at that index's inverse permutation.

Notation, per token: k routed rows of h (hidden) and i (moe_intermediate) wide, e experts, p the
experts' bytes (the weights': grouped_mm is no autocast op), p_w the weighted rows' (p promoted
with the routing weights' dtype)."""

from __future__ import annotations

from memplan.estimators.contracts import (
    FP32,
    INT64,
    SHARED_EXPERT,
    LayerContext,
    Saved,
    layer_saved,
    moe_router_saved,
    qkv_need_grad,
)
from memplan.estimators.events import ForwardStep
from memplan.estimators.params import moe_rules, shared_expert_gated
from memplan.estimators.releases import Release
from memplan.schema import ModelSpec

HISTC_INPUT = 4  # the sorted ids as float (CPU) or int32 (CUDA) for torch.histc


def runs_grouped_experts(ctx: LayerContext) -> bool:
    """The layer's MoE block runs grouped_mm_experts_forward with the default gate."""
    if not ctx.moe or not ctx.spec.num_experts:
        return False
    rules = moe_rules(ctx.spec)
    return rules.router != "sigmoid_every_expert" and not rules.clamped_glu


def saves_after_experts(spec: ModelSpec) -> bool:
    """Whether the MoE block saves tensors after its experts return: a shared expert's sigmoid
    gate (Qwen3-Next, Qwen3.5-MoE) or DeepSeek-style shared experts."""
    return bool(spec.shared_expert_intermediate_size) or shared_expert_gated(spec)


def recomputed_experts_peak(ctx: LayerContext, tokens: int) -> int | None:
    """Bytes a checkpointed layer's recomputation holds at its experts' high point beyond all it
    saves, for `tokens` tokens; None where the layer runs no grouped experts or its MoE block
    saves nothing.

    Held throughout the experts' forward and saved by nothing: the residual after attention (the
    decoder layer's local; an fp32 one is the MLP norm's saved input itself), the block's input
    (the norm's output, kept as it is only by trained linears outside autocast), eager
    attention's probabilities where unsaved (the layer's `_`), the router's logits (the block's
    `_`) and routing weights (k), and in the experts the sorted expert ids (8 k), the
    histogram's input (4 k), the gathered rows (k h p; grouped_mm saves them where the experts
    train) and the per-expert counts (4 e). Beside these the highest of:
      - the down projection's output allocated while its input, act(gate) * up, is alive
        (frozen experts save it not: k i p), the inverse permutation (8 k) not yet made;
      - where the block saves after its experts, weighted_out[inv_perm]: the weighted rows and
        their permuted copy (2 k h p_w), or the sum over the k rows (h p_w) beside the permuted
        copy and, where p_w is not the residual's dtype, its cast (the higher for k = 1);
      - else the weighted rows beside the inverse permutation's arange (k h p_w + 8 k) and the
        output gradient's copy (k h p_w).
    Under autocast the layer output's gradient is fp32 (the walk's running gradient has the
    projections' bytes), and a low-precision shared branch gets a cast of it. Less what the
    block saves after its experts (saved_after_experts)."""
    if not runs_grouped_experts(ctx) or not ctx.output_needs_grad(1):
        return None
    spec, d = ctx.spec, ctx.dtypes
    e, k, h = spec.num_experts, spec.num_experts_per_tok, spec.hidden_size
    inter, p, p_res = spec.moe_intermediate_size, d.param, d.residual
    saved = layer_saved(ctx)
    routing = moe_router_saved(ctx, Saved())  # each routed row's weight, in bytes
    logits = FP32 if moe_rules(spec).router == "sigmoid_fp32" and not d.autocast else d.proj
    # x.float() returns an fp32 residual, which the MLP norm saves; memplan's norm saves its input
    residual_saved = "rms_norm" in ctx.kernels or p_res == FP32
    input_saved = "norm.mlp.out" in saved.per_token and not d.autocast
    held = 0 if residual_saved else h * p_res
    held += 0 if input_saved else h * p_res
    if ctx.setup.attn == "eager" and not spec.deltanet and not any(qkv_need_grad(ctx)):
        held += d.proj * spec.num_attention_heads * ctx.seq
    held += e * logits + k * (routing + INT64 + HISTC_INPUT)
    held += 0 if ctx.trainable_base else k * h * p
    weighted = max(p, routing)
    down = (0 if ctx.trainable_base else k * inter * p) - k * INT64
    after = saves_after_experts(spec)
    if after:
        permuted = 2 * k * h * weighted
        summed = (k + 1) * h * weighted + (h * p_res if weighted != p_res else 0)
        held += max(down, permuted, summed)
    else:
        held += k * h * weighted + max(down, k * h * weighted + k * INT64)
    if d.autocast:
        held += h * (p_res - d.proj) + (h * d.proj if after else 0)
    total = held * tokens + FP32 * e - saved_after_experts(ctx, saved, tokens)
    return max(0, total)


def experts_backward_start(ctx: LayerContext, tokens: int) -> list[int] | None:
    """Bytes the experts' backward holds at its start beyond all the layer saved, for `tokens`
    tokens; None where the layer runs no grouped experts or no gradient reaches them. Each of
    k h p_w: the un-permuting index's gradient (new_zeros, then index_put_ in place: autograd
    adds out of place only for subclass-like tensors, a dispatch mode's included), then the
    weighting's two products, the output gradient times the routing weights and times the rows
    (the rows' cast to p comes once the node has released its saved rows). Autograd's copy of
    the output gradient over the k rows is freed by then. Less what the branch after the
    experts has freed, its backward running first (shared_backward_frees)."""
    if not runs_grouped_experts(ctx) or not ctx.output_needs_grad(1):
        return None
    spec, d = ctx.spec, ctx.dtypes
    weighted = max(d.param, moe_router_saved(ctx, Saved()))
    one = spec.num_experts_per_tok * tokens * spec.hidden_size * weighted
    # the branch's frees taken off the last of the three (their sum is the high point)
    return [one, one, max(0, one - shared_backward_frees(ctx, tokens))]


def shared_backward_frees(ctx: LayerContext, tokens: int) -> int:
    """What the branch run after the experts has freed when the experts' backward starts, its
    backward running first: DeepSeek-style shared experts free all they saved
    (saved_after_experts) but hold their input's gradient (tokens x h, in the residual's dtype)
    until the experts' is added to it; a sigmoid gate frees itself alone."""
    after = saved_after_experts(ctx, layer_saved(ctx), tokens)
    if not after or shared_expert_gated(ctx.spec):
        return after
    return max(0, after - tokens * ctx.spec.hidden_size * ctx.dtypes.residual)


def saved_after_experts(ctx: LayerContext, saved: Saved, tokens: int) -> int:
    """What the MoE block saves after its experts return: Qwen3-Next's sigmoid gate (one per
    token) or DeepSeek-style shared experts, and under autocast the copies of their weights
    and, where those train, of their input (one per linear)."""
    spec, d = ctx.spec, ctx.dtypes
    h = spec.hidden_size
    if not saves_after_experts(spec):
        return 0
    if shared_expert_gated(spec):
        after, linears, weights = tokens * d.proj, 1, h
    else:
        after = saved.bytes_of(tokens, (SHARED_EXPERT,))
        linears, weights = 2, 3 * h * spec.shared_expert_intermediate_size
    if d.autocast:
        after += d.proj * weights + (tokens * d.proj * h * linears if ctx.trainable_base else 0)
    return after


def experts_program(ctx: LayerContext, tokens: int, grad: bool) -> list[ForwardStep]:
    """grouped_mm_experts_forward's allocations for `tokens` tokens in its order, from the sort
    to the sum over each token's k rows. With `grad`, around the block's "moe.experts" entries
    (moe_saved's order: ("saved", n) makes the next n); without, where the block saves nothing
    (no graph past it), every tensor a temporary, freed as its last reader is done. Locals
    (sorted ids, gathered rows, histogram, the last weighted rows) live until it returns."""
    spec, p = ctx.spec, ctx.dtypes.param
    e, h, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    rows = spec.num_experts_per_tok * tokens
    routing = moe_router_saved(ctx, Saved())
    weighted = rows * h * max(p, routing)
    trained = ctx.trainable_base and grad
    mask = [1] if Release.of(ctx.setup.transformers).moe_sentinel_mask else []
    steps: list[ForwardStep] = [("alloc", "ids", rows * INT64)]

    def keep(key: str, nbytes: int, kept: bool = True) -> None:
        steps.append(("saved", 1) if grad and kept else ("alloc", key, nbytes))

    keep("perm", rows * INT64)
    keep("index", rows * INT64)
    keep("gathered", rows * h * p, trained)
    if not grad:  # the gather's index: no backward reads it
        steps.append(("free", "index"))
    keep("weights", rows * routing)
    steps += [("alloc", "histc", rows * HISTC_INPUT), ("alloc", "counts", FP32 * e)]
    keep("offsets", FP32 * e)
    for nbytes in mask:
        keep("mask", rows * nbytes)
    if moe_rules(spec).expert_biases and trained:  # the ids that gather the biases
        keep("bias_index", rows * INT64)
    steps.append(("alloc", "gate_up", rows * 2 * inter * p))
    keep("masked", rows * 2 * inter * p)
    steps.append(("free", "gate_up"))
    keep("act", rows * inter * p)
    keep("product", rows * inter * p, trained)
    if not grad:
        steps += [("free", "act"), ("free", "masked")]
    steps.append(("alloc", "down", rows * h * p))
    if not trained:
        steps.append(("free", "product"))
    keep("out", rows * h * p)
    steps += [("free", "down"), ("alloc", "weighted", weighted)]
    keep("inv_perm", rows * INT64)
    steps += [("alloc", "arange", rows * INT64), ("free", "arange")]
    steps += [("alloc", "permuted", weighted), ("free", "weighted")]
    steps.append(("alloc", "sum", tokens * h * max(p, routing)))
    # everything still held goes when the function returns (the saved entries stay)
    live: dict[str, None] = {}
    for step in steps:
        if step[0] == "alloc":
            live[step[1]] = None
        elif step[0] == "free":
            del live[step[1]]
    return steps + [("free", key) for key in live]


def experts_programs(ctx: LayerContext, saved: Saved, tokens: int) -> dict[str, list[ForwardStep]]:
    """The experts' program around the layer's "moe.experts" entries where it saves them."""
    names = {name for name, _, _ in saved.tensors}
    if not runs_grouped_experts(ctx) or "moe.experts" not in names:
        return {}
    return {"moe.experts": experts_program(ctx, tokens, grad=True)}


def unsaved_experts_program(ctx: LayerContext, saved: Saved, tokens: int) -> list[ForwardStep]:
    """The experts' program of a layer whose MoE block saves nothing (no graph reaches it)."""
    names = {name for name, _, _ in saved.tensors}
    if not runs_grouped_experts(ctx) or "moe.experts" in names:
        return []
    return experts_program(ctx, tokens, grad=False)
