"""Rank 0's memory under FSDP2 and DDP, measured on one GPU (docs/distributed.md): 30 cases of
world sizes 2 to 64, with and without resharding after forward, bf16 and amp, kernels off and
the advisor's plan, checkpointing, accumulation, a dense, a tied and an MoE family; the
mission's gemma-7b batch 8 x 4096 at the FSDP2 count advise gives and one fewer; 4 cases of
FSDP2 with CPU offload (two models, 2 and 8 ranks, with and without checkpointing); and 5 cases
of DeepSpeed ZeRO 1-3 on 2 GPUs, which run as torchrun processes only (--ranks torchrun).

    python benchmarks/measure_distributed.py predict --gpu h100 --out PREDICTIONS.json
        [--setups all|amp-checkpointed|amp-checkpointed-2]
    python benchmarks/measure_distributed.py measure PREDICTIONS.json --out-dir DIR [--only RE]
        [--ranks simulated|torchrun|auto]
    python benchmarks/measure_distributed.py table PREDICTIONS.json RESULTS.json

`predict` needs no GPU: it writes every case with rank 0's allocated peak, step-1 peak and
verdict predicted for the catalog GPU, before anything is measured (the first predictions).
`measure` runs each in a fresh process (`memplan verify`'s child: FSDP2 over a fake process
group of N ranks, DDP over one real rank; with --ranks torchrun, one process per GPU, which
ZeRO needs: with other ranks, --only must leave the zero cases out) and
writes DIR/distributed_results.json after every case. `table` prints the first predictions
against the measurements, as markdown."""

from __future__ import annotations

import argparse
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

# (model, decoder layers kept (None: all), kernels "auto"|"none", setup fields)
CASES: list[tuple[str, int | None, str, dict[str, Any]]] = [
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 2}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 4}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 8}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 64}),
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 4, "strategy": "fsdp2", "gpus": 8, "reshard_after_forward": False},
    ),
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 4, "strategy": "fsdp2", "gpus": 8, "precision": "amp-bf16"},
    ),
    ("llama-3.2-1b", None, "auto", {"batch": 4, "strategy": "fsdp2", "gpus": 8}),
    (
        "llama-3.2-1b",
        None,
        "auto",
        {"batch": 4, "strategy": "fsdp2", "gpus": 8, "precision": "amp-bf16"},
    ),
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 8, "strategy": "fsdp2", "gpus": 8, "grad_checkpointing": True},
    ),
    (
        "llama-3.2-1b",
        None,
        "none",
        {
            "batch": 8,
            "strategy": "fsdp2",
            "gpus": 64,
            "precision": "amp-bf16",
            "grad_checkpointing": True,
        },
    ),
    ("llama-3.2-1b", None, "none", {"batch": 2, "strategy": "fsdp2", "gpus": 4, "grad_accum": 2}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "ddp", "gpus": 8}),
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 4, "strategy": "ddp", "gpus": 8, "precision": "amp-bf16"},
    ),
    ("llama-3.2-1b", None, "auto", {"batch": 4, "strategy": "ddp", "gpus": 8}),
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 8, "strategy": "ddp", "gpus": 2, "grad_checkpointing": True},
    ),
    ("qwen3-0.6b", None, "none", {"batch": 8, "strategy": "fsdp2", "gpus": 2}),
    ("qwen3-0.6b", None, "auto", {"batch": 8, "strategy": "fsdp2", "gpus": 16}),
    (
        "qwen3-0.6b",
        None,
        "auto",
        {
            "batch": 8,
            "strategy": "fsdp2",
            "gpus": 8,
            "precision": "amp-bf16",
            "grad_checkpointing": True,
        },
    ),
    (
        "qwen3-0.6b",
        None,
        "none",
        {"batch": 4, "strategy": "fsdp2", "gpus": 64, "reshard_after_forward": False},
    ),
    ("qwen3-0.6b", None, "auto", {"batch": 8, "strategy": "ddp", "gpus": 4}),
    (
        "llama-3.1-8b",
        None,
        "none",
        {"batch": 1, "strategy": "fsdp2", "gpus": 8, "grad_checkpointing": True},
    ),
    (
        "llama-3.1-8b",
        None,
        "auto",
        {
            "batch": 1,
            "strategy": "fsdp2",
            "gpus": 4,
            "precision": "amp-bf16",
            "grad_checkpointing": True,
        },
    ),
    ("qwen3-30b-a3b", 4, "none", {"batch": 2, "strategy": "fsdp2", "gpus": 8}),
    (
        "qwen3-30b-a3b",
        4,
        "none",
        {"batch": 2, "strategy": "fsdp2", "gpus": 8, "reshard_after_forward": False},
    ),
    (
        "qwen3-30b-a3b",
        4,
        "none",
        {"batch": 2, "strategy": "fsdp2", "gpus": 64, "precision": "amp-bf16"},
    ),
    ("qwen3-30b-a3b", 4, "none", {"batch": 2, "strategy": "ddp", "gpus": 8}),
    ("gemma-2b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 4}),
    (
        "gemma-2b",
        None,
        "auto",
        {"batch": 4, "strategy": "fsdp2", "gpus": 4, "precision": "amp-bf16"},
    ),
    (
        "gemma-2b",
        None,
        "none",
        {"batch": 8, "strategy": "fsdp2", "gpus": 8, "grad_checkpointing": True},
    ),
    ("gemma-2b", None, "none", {"batch": 4, "strategy": "fsdp2", "gpus": 2, "grad_accum": 2}),
    # FSDP2 with CPUOffloadPolicy: shards, gradients and AdamW on the host
    (
        "llama-3.2-1b",
        None,
        "none",
        {"batch": 4, "strategy": "fsdp2", "gpus": 2, "cpu_offload": True},
    ),
    (
        "llama-3.2-1b",
        None,
        "none",
        {
            "batch": 8,
            "strategy": "fsdp2",
            "gpus": 8,
            "grad_checkpointing": True,
            "cpu_offload": True,
        },
    ),
    (
        "qwen3-0.6b",
        None,
        "auto",
        {
            "batch": 8,
            "strategy": "fsdp2",
            "gpus": 2,
            "grad_checkpointing": True,
            "cpu_offload": True,
        },
    ),
    (
        "qwen3-0.6b",
        None,
        "none",
        {
            "batch": 8,
            "strategy": "fsdp2",
            "gpus": 8,
            "precision": "amp-bf16",
            "cpu_offload": True,
        },
    ),
    # DeepSpeed ZeRO through accelerate: real ranks only (measure --ranks torchrun --only zero)
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "zero1", "gpus": 2}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "zero2", "gpus": 2}),
    ("llama-3.2-1b", None, "none", {"batch": 4, "strategy": "zero3", "gpus": 2}),
    ("llama-3.2-1b", None, "auto", {"batch": 4, "strategy": "zero2", "gpus": 2}),
    ("llama-3.2-1b", None, "auto", {"batch": 4, "strategy": "zero3", "gpus": 2}),
]
SEQ = 2048
# FSDP2 under autocast with checkpointing, on models and counts that CASES leaves out
AMP_GC = {"precision": "amp-bf16", "grad_checkpointing": True}
AMP_CHECKPOINTED: list[tuple[str, int | None, str, dict[str, Any]]] = [
    (model, None, kernels, {"batch": batch, "strategy": "fsdp2", "gpus": gpus, **AMP_GC})
    for model, kernels, batch, gpus in (
        ("qwen2.5-1.5b", "none", 8, 4),
        ("qwen2.5-1.5b", "auto", 8, 4),
        ("llama-3.2-3b", "none", 4, 8),
        ("llama-3.2-3b", "auto", 8, 16),
        ("gemma-2b", "auto", 8, 2),
        ("qwen3-1.7b", "auto", 8, 8),
    )
]


# The same on other models and counts, written after the walk played a checkpointed layer's
# first forward with memplan's GLU kernel
AMP_CHECKPOINTED_2: list[tuple[str, int | None, str, dict[str, Any]]] = [
    (model, None, "auto", {"batch": batch, "strategy": "fsdp2", "gpus": gpus, **AMP_GC})
    for model, batch, gpus in (("qwen3-4b", 4, 8), ("llama-3.2-1b", 8, 4), ("gemma-2-2b", 4, 4))
]


def planned(model: str, layers: int | None, kernels: str, fields: dict[str, Any], gpu: Any):
    spec = resolve_model(model)
    if layers is not None:
        spec = with_layers(spec, layers)
    options = {"seq": SEQ, **fields}
    batch, seq = options.pop("batch"), options.pop("seq")
    setup = advise(spec, batch, seq, gpu=gpu, kernels=kernels, **options).setup
    return spec, setup


def gemma_7b_cases(gpu: Any) -> list[tuple[Any, Any]]:
    """gemma-7b, batch 8 x 4096 a rank: FSDP2 at the count advise gives (with the change it
    names) and at one fewer."""
    advice = advise("gemma-7b", 8, 4096, gpu=gpu)
    option = next(c for c in advice.gpu_counts if c.strategy == "fsdp2")
    assert option.gpus is not None, option.why_none
    spec = resolve_model("gemma-7b")
    setup = advice.setup.model_copy(
        update={
            "strategy": "fsdp2",
            "grad_checkpointing": advice.setup.grad_checkpointing
            or "checkpointing" in option.change,
        }
    )
    counts = [option.gpus] + ([option.gpus - 1] if option.gpus > 1 else [])
    return [(spec, setup.model_copy(update={"gpus": n})) for n in counts]


def predict(args: argparse.Namespace) -> int:
    gpu = resolve_gpu(args.gpu)
    if args.setups == "amp-checkpointed":
        runs = [planned(*case, gpu) for case in AMP_CHECKPOINTED]
    elif args.setups == "amp-checkpointed-2":
        runs = [planned(*case, gpu) for case in AMP_CHECKPOINTED_2]
    else:
        runs = [planned(*case, gpu) for case in CASES] + gemma_7b_cases(gpu)
    return write_predictions(runs, gpu, Path(args.out))


def measure(args: argparse.Namespace) -> int:
    return measure_into(
        args,
        "distributed_results.json",
        "rank 0 of FSDP2 (fake process group) and DDP (one rank), one GPU",
    )


if __name__ == "__main__":
    sets = ("all", "amp-checkpointed", "amp-checkpointed-2")
    sys.exit(main(__doc__, predict, measure, table, timeout_s=600, setup_sets=sets))
