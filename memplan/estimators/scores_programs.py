"""Eager attention's forward temporaries around the probabilities it saves. Pure Python.

transformers' eager_attention_forward computes `w = matmul(q, k^T) * scaling`, `w = w + mask`,
`w = softmax(w, dim=-1, dtype=float32).to(q.dtype)`: the product, the scaled scores and the
masked ones are each a scores-sized temporary (the product freed once scaled, the scaled once
masked); softmax casts its low-precision input up to fp32 (freed once the fp32 output, which
backward keeps, is made); the masked scores live until the cast back (kept by matmul(probs, v))
is made. SDPA's math path (fp32 scores) adds the mask into the product in place, and
_safe_softmax holds a bool mask of the scores beside its output until it has run. The programs
here place them around contracts.attention_saved's "attn.probs" and "attn.probs.cast". Not
played: softcapping, sinks, dropout, Llama 4's low-precision softmax (other ops)."""

from __future__ import annotations

from memplan.estimators.contracts import FP32, LayerContext, Saved, attention_path, scores_bytes
from memplan.estimators.events import ForwardStep

PROBS, CAST = "attn.probs", "attn.probs.cast"


def scores_program(fp32_scores: int, p_scores: int) -> list[ForwardStep]:
    """The forward up to softmax's fp32 output (the "attn.probs" entry), for scores of
    fp32_scores bytes in fp32 and p_scores bytes an element."""
    scores = fp32_scores * p_scores // FP32
    steps: list[ForwardStep] = [("alloc", "attn.product", scores), ("alloc", "attn.scaled", scores)]
    steps += [("free", "attn.product"), ("alloc", "attn.masked", scores), ("free", "attn.scaled")]
    upcast = fp32_scores if p_scores < FP32 else 0
    return steps + [("alloc", "attn.upcast", upcast), ("saved",), ("free", "attn.upcast")]


def math_program(fp32_scores: int) -> list[ForwardStep]:
    """SDPA's math path up to its probabilities (the "attn.probs" entry), fp32_scores bytes."""
    steps: list[ForwardStep] = [("alloc", "attn.product", fp32_scores), ("saved",)]
    steps += [("alloc", "attn.bool", fp32_scores // FP32), ("free", "attn.bool")]
    return steps + [("free", "attn.product")]


def scores_programs(ctx: LayerContext, saved: Saved, tokens: int) -> dict[str, list[ForwardStep]]:
    """Eager attention's program, keyed by "attn.probs" (the masked scores freed by the cast's
    program where matmul(probs, v) keeps the cast, else at the end of its own)."""
    spec = ctx.spec
    if not spec.eager_softmax_fp32 or spec.attention_sinks or spec.attention_dropout > 0:
        return {}
    eager = ctx.setup.attn == "eager"
    if (eager and spec.attn_logit_softcapping) or attention_path(ctx) != "scores":
        return {}
    widths = {name: width for name, width, _ in saved.tensors if width > 0}
    if PROBS not in widths:
        return {}
    if not eager:
        return {PROBS: math_program(int(widths[PROBS] * tokens))}
    programs = {PROBS: scores_program(int(widths[PROBS] * tokens), scores_bytes(ctx))}
    if CAST in widths:
        programs[CAST] = [("saved",), ("free", "attn.masked")]
    else:
        programs[PROBS] += [("free", "attn.masked")]
    return programs
