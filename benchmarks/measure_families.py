"""Cases measured on one GPU, predicted before anything ran: the families added to the registry
(docs/accuracy.md, new families: three cases each, Hugging Face as it is, the advisor's plan,
and LoRA or checkpointing), and sets of one run a case (recomputed MoE, the gated norm, held-out
cases away from the edge: docs/fit_verdict.md).

    python benchmarks/measure_families.py predict --gpu h100 --out PREDICTIONS.json
        [--setups families|recomputed-moe|gated-norm|gated-norm-held-out|held-out|held-out-2|
         fla|causal-conv1d]
    python benchmarks/measure_families.py measure PREDICTIONS.json --out-dir DIR [--only RE]
    python benchmarks/measure_families.py table PREDICTIONS.json RESULTS.json

`predict` needs no GPU; `measure` runs each case in a fresh process (`memplan verify`'s child)
and writes DIR/families_results.json after every case; `table` prints the first predictions
and the current code's against the measurements."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.first_predictions import (  # noqa: E402
    main,
    measure_into,
    table,
    write_predictions,
)
from memplan.advisor import advise  # noqa: E402
from memplan.catalog import resolve_gpu, resolve_model  # noqa: E402
from memplan.verify.predict import with_layers  # noqa: E402

SEQ = 2048
LORA = {"lora_rank": 16}
CHECKPOINTING = {"grad_checkpointing": True}
# transformers' torch fallback for the gated DeltaNet, wherever the predictions are written
TORCH_RULE = {"deltanet_kernels": "torch", "deltanet_conv": "torch"}
LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# One run a case: (catalog model, decoder layers kept (None: all), batch, kernels, options).
Case = tuple[str, int | None, int, str, dict[str, Any]]

# (catalog model, decoder layers kept (None: all), batch, third case's options): each model
# runs with kernels off, with the advisor's plan, and with kernels off plus the options.
FAMILY_CASES: list[tuple[str, int | None, int, dict[str, Any]]] = [
    ("ministral-3-8b", 6, 4, CHECKPOINTING),
    ("mistral-small-3.1-24b", 4, 2, LORA),
    ("olmo-2-0425-1b", None, 4, LORA),
    ("olmo-3-7b-instruct", 6, 4, CHECKPOINTING),
    ("seed-oss-36b-instruct", 4, 4, LORA),
    ("smollm3-3b", None, 2, CHECKPOINTING),
    ("granite-3.3-8b-instruct", 8, 4, LORA),
    ("exaone-4.0-32b", 4, 4, CHECKPOINTING),
    # one dense and one MoE layer: 128 experts of 1408, a shared expert, the fp32 router frozen
    # under LoRA
    ("glm-4.5-air", 2, 4, LORA),
    ("gemma-4-31b", 4, 2, CHECKPOINTING),
    # two MoE layers with sinks: 32 experts of 2880 with biases, frozen under LoRA
    ("gpt-oss-20b", 2, 4, LORA),
    # one layer (2.2B parameters, 16 experts): the plan's peak in its MoE backward
    ("llama-4-scout-17b-16e", 1, 4, LORA),
    # latent attention (16 heads of q/k 192 and v 128: cuDNN), one dense layer and five MoE
    # layers of 64 experts of 1408 beside two shared ones, the fp32 router
    ("moonlight-16b-a3b-instruct", 6, 4, CHECKPOINTING),
    # every layer: 18 gated DeltaNet layers (transformers' torch fallback) and 6 gated full
    # attention ones; under LoRA (q, v) the DeltaNet layers before the first adapter save nothing
    ("qwen3.5-0.8b", None, 4, LORA),
    # three gated DeltaNet layers and a gated full attention one, each with a MoE block of 256
    # experts of 512 beside a shared expert and its sigmoid gate; under LoRA (q, v) the
    # DeltaNet layers before the first adapter save nothing
    ("qwen3.5-35b-a3b", 4, 3, LORA),
    # three gated DeltaNet layers with fused projections and a gated full attention one, each
    # with a MoE block of 512 experts of 512 beside a gated shared expert (three DeltaNet layers
    # alone fail in transformers 5.17: a cache of linear-attention layers only has no length)
    ("qwen3-next-80b-a3b-instruct", 4, 3, LORA),
]


# Checkpointed LoRA on q and v over grouped-matmul experts, whose recomputed forward keeps the
# frozen experts' gathered rows and weighted outputs alive (estimators/grouped_experts.py): one
# case each, kernels off.
RECOMPUTED_MOE_CASES: list[Case] = [
    ("qwen3.5-35b-a3b", 4, 3, "none", {**LORA, **CHECKPOINTING}),
    ("qwen3-next-80b-a3b-instruct", 4, 3, "none", {**LORA, **CHECKPOINTING}),
    ("qwen3-30b-a3b", 8, 4, "none", {**LORA, **CHECKPOINTING}),
    ("glm-4.5-air", 2, 4, "none", {**LORA, **CHECKPOINTING}),
]


# The gated DeltaNet families with the advisor's plan, whose rms_norm kernel patches the gated
# RMSNorm too (memplan.kernels.gated_rms_norm): plain, under LoRA (q, v) and checkpointed.
GATED_NORM_CASES: list[Case] = [
    ("qwen3.5-0.8b", None, 4, "auto", {}),
    ("qwen3.5-0.8b", None, 4, "auto", LORA),
    ("qwen3.5-0.8b", None, 8, "auto", CHECKPOINTING),
    ("qwen3.5-35b-a3b", 4, 3, "auto", {}),
    ("qwen3-next-80b-a3b-instruct", 4, 3, "auto", {}),
]


# Written after the DeltaNet's forward high point was modelled tensor by tensor, to test it out
# of sample: the gated RMSNorm's fp32 weight under autocast, Qwen3.5-MoE at another batch,
# Qwen3-Next under LoRA with the plan.
GATED_NORM_HELD_OUT: list[Case] = [
    ("qwen3.5-0.8b", None, 2, "auto", {"precision": "amp-bf16"}),
    ("qwen3.5-35b-a3b", 4, 2, "auto", {}),
    ("qwen3-next-80b-a3b-instruct", 4, 2, "auto", LORA),
]


# The gated DeltaNet families where flash-linear-attention runs the chunked delta rule (the
# causal conv1d stays in torch): Hugging Face as it is, the plan, LoRA (q, v) with it,
# checkpointed with it, and under autocast; Qwen3.5-MoE and Qwen3-Next cut to four layers.
FLA = {"deltanet_kernels": "fla"}
FLA_CASES: list[Case] = [
    ("qwen3.5-0.8b", None, 4, "none", FLA),
    ("qwen3.5-0.8b", None, 4, "auto", FLA),
    ("qwen3.5-0.8b", None, 4, "auto", {**FLA, **LORA}),
    ("qwen3.5-0.8b", None, 8, "auto", {**FLA, **CHECKPOINTING}),
    ("qwen3.5-0.8b", None, 2, "auto", {**FLA, "precision": "amp-bf16"}),
    ("qwen3.5-35b-a3b", 4, 3, "auto", FLA),
    ("qwen3-next-80b-a3b-instruct", 4, 3, "auto", FLA),
]


# causal-conv1d's conv (written before its contract met a GPU): with the torch fallback's rule,
# Hugging Face as it is, the plan and LoRA with it; with fla's rule, the plan checkpointed and
# Qwen3-Next cut to four layers with the plan.
CAUSAL_CONV1D = {"deltanet_conv": "causal_conv1d"}
CAUSAL_CONV1D_CASES: list[Case] = [
    ("qwen3.5-0.8b", None, 4, "none", CAUSAL_CONV1D),
    ("qwen3.5-0.8b", None, 4, "auto", CAUSAL_CONV1D),
    ("qwen3.5-0.8b", None, 4, "auto", {**CAUSAL_CONV1D, **LORA}),
    ("qwen3.5-0.8b", None, 8, "auto", {**CAUSAL_CONV1D, **FLA, **CHECKPOINTING}),
    ("qwen3-next-80b-a3b-instruct", 4, 3, "auto", {**CAUSAL_CONV1D, **FLA}),
]


# Away from the edge, on cases none of the analytic walk's per-op temporaries were found on:
# LoRA, eager attention, autocast, checkpointing and fp32 on models and sizes none of the fixes
# used (the analytic stream's reserved peak, what advise prints there, out of sample).
HELD_OUT: list[Case] = [
    ("qwen2.5-3b", None, 4, "none", {"lora_rank": 16}),
    ("qwen3-4b", 12, 4, "auto", {"lora_rank": 16, "lora_targets": LORA_ALL}),
    ("llama-3.2-3b", None, 2, "none", {"attn": "eager", "grad_checkpointing": True}),
    ("gemma-2-9b", 6, 2, "auto", {"precision": "amp-bf16"}),
    ("mistral-7b-v0.3", 6, 2, "none", {"lora_rank": 16, "precision": "amp-bf16"}),
    ("smollm2-1.7b", None, 4, "auto", {"precision": "fp32"}),
]


# A second held-out set, written after the walk played a checkpointed layer's first forward,
# kept the experts' gradients where they are made, started the grouped experts' backward with
# three blocks, made Phi-3's one qkv output and took cuDNN's workspace by KV heads: MoE,
# fused qkv with grouped KV heads, checkpointing with and without the plan, post-norm layers,
# latent attention, on models none of those fixes was found on.
HELD_OUT_2: list[Case] = [
    ("qwen3-30b-a3b", 4, 4, "none", {}),
    ("mixtral-8x7b", 2, 2, "auto", {}),
    ("phi-3-medium", 4, 2, "auto", {}),
    ("gemma-7b", 6, 2, "none", CHECKPOINTING),
    ("granite-3.3-8b-instruct", 6, 4, "none", CHECKPOINTING),
    ("qwen2.5-7b", 6, 4, "auto", {"precision": "amp-bf16", **CHECKPOINTING}),
    ("olmo-2-1124-7b", 6, 4, "none", CHECKPOINTING),
    ("moonlight-16b-a3b-instruct", 4, 2, "none", CHECKPOINTING),
]


def _spec(model: str, layers: int | None) -> Any:
    spec = resolve_model(model)
    return spec if layers is None else with_layers(spec, layers)


def runs(gpu: Any) -> list[tuple[Any, Any]]:
    out = []
    for model, layers, batch, options in FAMILY_CASES:
        spec = _spec(model, layers)
        for kernels, extra in (("none", {}), ("auto", {}), ("none", options)):
            setup = advise(spec, batch, SEQ, gpu=gpu, kernels=kernels, **TORCH_RULE, **extra).setup
            out.append((spec, setup))
    return out


def advised_runs(cases: list[Case], gpu: Any) -> list[tuple[Any, Any]]:
    """Each case as advise sets it up."""
    out = []
    for model, layers, batch, kernels, options in cases:
        spec = _spec(model, layers)
        options = {**TORCH_RULE, **options}
        out.append((spec, advise(spec, batch, SEQ, gpu=gpu, kernels=kernels, **options).setup))
    return out


CASE_SETS = {
    "recomputed-moe": RECOMPUTED_MOE_CASES,
    "gated-norm": GATED_NORM_CASES,
    "gated-norm-held-out": GATED_NORM_HELD_OUT,
    "held-out": HELD_OUT,
    "held-out-2": HELD_OUT_2,
    "fla": FLA_CASES,
    "causal-conv1d": CAUSAL_CONV1D_CASES,
}
SETUP_SETS = {
    "families": runs,
    **{name: functools.partial(advised_runs, cases) for name, cases in CASE_SETS.items()},
}


def predict(args: argparse.Namespace) -> int:
    gpu = resolve_gpu(args.gpu)
    return write_predictions(SETUP_SETS[args.setups](gpu), gpu, Path(args.out))


def measure(args: argparse.Namespace) -> int:
    return measure_into(args, "families_results.json", "the registry's new families, one GPU")


if __name__ == "__main__":
    sys.exit(main(__doc__, predict, measure, table, timeout_s=300, setup_sets=tuple(SETUP_SETS)))
