"""Rank 0's memory under FSDP2 and DDP, measured on one GPU (docs/distributed.md): 30 cases of
world sizes 2 to 64, with and without resharding after forward, bf16 and amp, kernels off and
the advisor's plan, checkpointing, accumulation, a dense, a tied and an MoE family; and the
mission's gemma-7b batch 8 x 4096 at the FSDP2 count advise gives and one fewer.

    python benchmarks/measure_distributed.py predict --gpu h100 --out PREDICTIONS.json
    python benchmarks/measure_distributed.py measure PREDICTIONS.json --out-dir DIR [--only RE]
        [--ranks simulated|torchrun|auto]
    python benchmarks/measure_distributed.py table PREDICTIONS.json RESULTS.json

`predict` needs no GPU: it writes every case with rank 0's allocated peak, step-1 peak and
verdict predicted for the catalog GPU, before anything is measured (the first predictions).
`measure` runs each in a fresh process (`memplan verify`'s child: FSDP2 over a fake process
group of N ranks, DDP over one real rank; with --ranks torchrun, one process per GPU) and
writes DIR/distributed_results.json after every case. `table` prints the first predictions
against the measurements, as markdown."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.first_predictions import main, measure_predicted  # noqa: E402
from memplan.advisor import advise, judge  # noqa: E402
from memplan.catalog import resolve_gpu, resolve_model, spec_from_config  # noqa: E402
from memplan.schema import Report, VerifyCase  # noqa: E402
from memplan.verify.predict import with_layers  # noqa: E402
from memplan.verify.protocol import case_name  # noqa: E402

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
]
SEQ = 2048


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
    runs = [planned(*case, gpu) for case in CASES] + gemma_7b_cases(gpu)
    out = []
    for spec, setup in runs:
        judged = judge(spec, setup, gpu)
        assert judged.reserved is not None
        case = VerifyCase(
            case=case_name(spec.name or spec.model_type, setup),
            model=spec.name or spec.model_type,
            model_type=spec.model_type,
            hf_config=spec.hf_config,
            setup=setup,
        )
        out.append(
            {
                "case": case.model_dump(mode="json"),
                "gpu": gpu.name,
                "capacity_bytes": gpu.capacity,
                "allocated_bytes": judged.peak_bytes,
                "step1_bytes": judged.peak_step1_bytes,
                "peak_at": f"{judged.peak_phase}: {judged.peak_label}",
                "runs": judged.reserved.runs,
                "reserved_bytes": judged.reserved.reserved_bytes,
            }
        )
        print(
            f"{case.case}: {judged.peak_bytes / 2**30:.2f} GiB allocated, "
            f"{'runs' if judged.reserved.runs else 'out of memory'}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps({"gpu": args.gpu, "cases": out}, indent=1) + "\n")
    return 0


def measure(args: argparse.Namespace) -> int:
    measure_predicted(
        Path(args.predictions),
        Path(args.out_dir) / "distributed_results.json",
        label="rank 0 of FSDP2 (fake process group) and DDP (one rank), one GPU",
        only=args.only,
        timeout_s=args.timeout,
        say=lambda item, m: f"{m.status} {m.error or ''} {m.error_pct}",
        ranks=args.ranks,
    )
    return 0


def _pct(predicted: int, measured: int) -> float:
    return 100 * (predicted - measured) / measured


def table(args: argparse.Namespace) -> int:
    """The first predictions against the measurements, then what the code predicts now for the
    same cases (in-sample wherever a measurement led to a change)."""
    predictions = {
        c["case"]["case"]: c for c in json.loads(Path(args.predictions).read_text())["cases"]
    }
    report = Report.model_validate_json(Path(args.results).read_text())
    print(
        "| case | measured GiB | first prediction | error | now | error "
        "| reserved GiB | first | now |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    first_errors, now_errors, first_reserved, now_reserved = [], [], [], []
    for m in report.measurements:
        if m.status != "ok" or not m.peak_bytes or not m.reserved_bytes:
            print(f"| {m.case} | {m.status} | | | | | | | |")
            continue
        p = predictions[m.case.removesuffix("_torchrun")]  # real ranks: the same setup
        case = VerifyCase.model_validate(p["case"])
        spec = spec_from_config(dict(case.hf_config), case.model)
        now = judge(spec, case.setup, resolve_gpu(p["gpu"]))
        assert now.reserved is not None
        errors = (
            _pct(p["allocated_bytes"], m.peak_bytes),
            _pct(now.peak_bytes, m.peak_bytes),
            _pct(p["reserved_bytes"], m.reserved_bytes),
            _pct(now.reserved.reserved_bytes, m.reserved_bytes),
        )
        for bucket, error in zip(
            (first_errors, now_errors, first_reserved, now_reserved), errors, strict=True
        ):
            bucket.append(abs(error))
        print(
            f"| {m.case} | {m.peak_bytes / 2**30:.2f} | {p['allocated_bytes'] / 2**30:.2f} "
            f"| {errors[0]:+.2f}% | {now.peak_bytes / 2**30:.2f} | {errors[1]:+.2f}% "
            f"| {m.reserved_bytes / 2**30:.2f} | {errors[2]:+.2f}% | {errors[3]:+.2f}% |"
        )
    for name, errors in (
        ("Allocated, first predictions", first_errors),
        ("Allocated, the code now", now_errors),
        ("Reserved, first predictions", first_reserved),
        ("Reserved, the code now", now_reserved),
    ):
        if errors:
            print(
                f"\n{name}: median |error| {statistics.median(errors):.2f}%, "
                f"max {max(errors):.2f}% over {len(errors)} cases that ran."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, predict, measure, table, timeout_s=600))
