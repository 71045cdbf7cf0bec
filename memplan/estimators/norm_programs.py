"""The Hugging Face RMSNorm's forward temporaries, as the allocator sees them. Pure Python.

LlamaRMSNorm.forward (and Qwen's, Mistral's, their q/k head norms) computes `h = x.float()`,
`variance = h.pow(2).mean(-1)`, `h = h * rsqrt(variance + eps)`, `weight * h.to(dtype)`: beside
the tensors it saves (contracts.norm_saved: x.float(), rstd, the cast where the weight trains)
it makes pow's output and the fp32 product, each as wide as x in fp32, and the cast back where
nothing saves it; the product and the cast live until the output (weight * cast) is made. The
programs here place them around the saved entries, by the norm's name, and free them after the
output where the linears reading it save it (the entries named "<norm>.out"); where nothing
saves a layer norm's output, the decoder layer holds it through attention or the MLP. Under
no_grad x.float() goes once the product is made. Gemma's fp32 norms and memplan's kernel keep
no program."""

from __future__ import annotations

from memplan.estimators.contracts import FP32, INPUT_ITSELF, LayerContext, Saved, gemma_norms
from memplan.estimators.events import ForwardStep

NORMS = ("norm.attn", "norm.mlp", "attn.q_norm", "attn.k_norm")
TEMPORARIES = [("free", "norm.cast"), ("free", "norm.normed")]


def norm_program(fp32_width: int, p_in: int, input_kept: bool, trained: bool) -> list[ForwardStep]:
    """One norm's forward for fp32_width bytes of x.float(), up to its output: x.float() (saved),
    pow's output (freed by mean), rstd (saved), the normalized product, its cast to the input's
    dtype (saved where the weight trains). `input_kept`: an fp32 input is itself x.float(), saved
    before the norm's own entries, and the product is the cast."""
    if input_kept:
        steps: list[ForwardStep] = [("alloc", "norm.pow", fp32_width), ("free", "norm.pow")]
        steps += [("saved",), ("alloc", "norm.normed", 0 if trained else fp32_width)]
        return steps + [("alloc", "norm.cast", 0)]
    steps = [("saved", 1), ("alloc", "norm.pow", fp32_width), ("free", "norm.pow")]
    # under no_grad x.float() goes once the product replaces it
    steps += [("alloc", "norm.normed", fp32_width), ("unsaved",), ("saved",)]
    return steps + [("alloc", "norm.cast", 0 if trained else fp32_width * p_in // FP32)]


def norm_programs(ctx: LayerContext, saved: Saved, tokens: int) -> dict[str, list[ForwardStep]]:
    """The programs of the layer's HF RMSNorms, keyed by their saved entries' name (`saved`);
    the temporaries are freed by the output's program, or at the end of the norm's own."""
    if "rms_norm" in ctx.kernels or gemma_norms(ctx.spec):
        return {}
    per_token: dict[str, list[float]] = {}
    for name, width, _ in saved.tensors:
        if width > 0:
            per_token.setdefault(name, []).append(width)
    programs: dict[str, list[ForwardStep]] = {}
    for name in NORMS:
        own = per_token.get(name)
        if not own:
            continue
        kept = per_token.get(name + INPUT_ITSELF)
        fp32_width = int((kept[0] if kept else own[0]) * tokens)
        # the cast the weight's gradient keeps is the entry past rstd
        trained = len(own) > (1 if kept else 2)
        p_in = ctx.dtypes.residual if name.startswith("norm.") else ctx.dtypes.proj
        programs[name] = norm_program(fp32_width, p_in, bool(kept), trained)
        if name + ".out" in per_token:
            programs[name + ".out"] = [("saved",), *TEMPORARIES]
        elif name.startswith("norm."):
            # the output nothing saves: the layer holds it through its part (alloc_saved frees
            # it there)
            programs[name] += [("alloc", "norm.out." + name, fp32_width * p_in // FP32)]
            programs[name] += TEMPORARIES
        else:
            programs[name] += TEMPORARIES
    return programs
