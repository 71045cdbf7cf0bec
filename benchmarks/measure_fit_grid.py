"""The fit verdict at the edge of a GPU's memory: for each setup, the largest batch (or, where a
batch step is too coarse, the largest sequence) that advise says fits, and one more, each run in
a fresh process under the measurement protocol; did it run or run out of memory as predicted,
and how close is the predicted reserved peak.

    python benchmarks/measure_fit_grid.py predict --gpu h100 --out PREDICTIONS.json
        [--setups grid|held-out|new-families|held-out-2|gated-norm|fla|checkpointed]
    python benchmarks/measure_fit_grid.py measure PREDICTIONS.json --out-dir DIR [--only RE]
    python benchmarks/measure_fit_grid.py table PREDICTIONS.json RESULTS.json

`predict` needs no GPU: it writes every case with the verdict and reserved peak predicted for
the catalog GPU, before anything is measured (the first predictions). `measure` runs them one
after another (each needs the whole GPU) and writes DIR/fit_grid_results.json (a memplan
Report, re-predicted for the GPU measured) and DIR/fit_grid_report.md after every case.
`table` prints the first predictions against what happened, as markdown (docs/fit_verdict.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.first_predictions import main, measure_predicted  # noqa: E402
from memplan.advisor import SEQ_STEP, advise, judge  # noqa: E402
from memplan.catalog import resolve_gpu, resolve_model  # noqa: E402
from memplan.schema import Report, VerifyCase  # noqa: E402
from memplan.verify.protocol import case_name  # noqa: E402

# (model, kernels "auto"|"none", setup options): families, loss paths, precisions,
# checkpointing, LoRA, eager attention, foreach and fused AdamW, expandable segments.
SETUPS: list[tuple[str, str, dict[str, Any]]] = [
    ("llama-3.2-1b", "none", {}),
    ("llama-3.2-1b", "auto", {}),
    ("llama-3.2-1b", "none", {"expandable_segments": True}),
    ("llama-3.2-1b", "none", {"grad_checkpointing": True}),
    ("llama-3.2-1b", "auto", {"precision": "amp-bf16"}),
    ("llama-3.2-1b", "none", {"lora_rank": 16}),
    ("llama-3.2-1b", "auto", {"lora_rank": 16, "grad_checkpointing": True}),
    ("qwen3-0.6b", "none", {}),
    ("qwen3-0.6b", "auto", {"optimizer": "adamw-fused"}),
    ("qwen3-0.6b", "none", {"precision": "amp-bf16"}),
    ("qwen2.5-1.5b", "none", {}),
    ("qwen2.5-1.5b", "auto", {"grad_checkpointing": True}),
    ("gemma-2b", "none", {}),
    ("gemma-2b", "auto", {}),
    ("gemma-2-2b", "none", {"attn": "eager"}),
    ("smollm2-360m", "auto", {"expandable_segments": True}),
    ("llama-3.2-3b", "auto", {}),
    ("qwen3-1.7b", "none", {"grad_checkpointing": True}),
    ("llama-3.1-8b", "none", {"grad_checkpointing": True}),
    ("llama-3.1-8b", "none", {"grad_checkpointing": True, "optimizer": "adamw-fused"}),
]
# Setups none of the memory model's fixes were found on, for the verdict out of sample: other
# families and sizes, kernels with fused AdamW, amp with checkpointing, LoRA with the plan.
HELD_OUT: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen2.5-0.5b", "auto", {"precision": "amp-bf16"}),
    ("llama-3.2-1b", "auto", {"optimizer": "adamw-fused"}),
    ("gemma-2-2b", "auto", {}),
    ("qwen3-1.7b", "auto", {}),
    ("smollm2-360m", "none", {}),
    ("qwen3-0.6b", "auto", {"lora_rank": 16}),
    ("llama-3.2-3b", "none", {"grad_checkpointing": True}),
    ("qwen2.5-1.5b", "auto", {"precision": "amp-bf16", "grad_checkpointing": True}),
]
# The families added to the registry after both grids, at the edge: Qwen3.5's gated DeltaNet
# (transformers' torch fallback), OLMo 2's post-norm layers, SmolLM3's NoPE layers.
NEW_FAMILIES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3.5-0.8b", "auto", {}),
    ("qwen3.5-0.8b", "none", {"grad_checkpointing": True}),
    ("olmo-2-0425-1b", "none", {}),
    ("olmo-2-0425-1b", "auto", {"lora_rank": 16}),
    ("smollm3-3b", "auto", {}),
]
# A second held-out set, written after every fix above: other kernels, precisions, optimizers
# and adapters on old and new families.
HELD_OUT_2: list[tuple[str, str, dict[str, Any]]] = [
    ("olmo-2-0425-1b", "auto", {}),
    ("smollm3-3b", "none", {"grad_checkpointing": True}),
    ("qwen3-1.7b", "auto", {"precision": "amp-bf16"}),
    ("gemma-2-2b", "none", {"lora_rank": 16}),
    ("llama-3.2-3b", "auto", {"optimizer": "adamw-fused"}),
]
# Qwen3.5 with memplan's gated RMSNorm in its DeltaNet layers (the plan's rms_norm kernel),
# written after it was patched: plain and under LoRA (checkpointed, its edge is batch 140: three
# steps of 287K tokens through the DeltaNet's torch fallback outlast a case's time).
GATED_NORM: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3.5-0.8b", "auto", {}),
    ("qwen3.5-0.8b", "auto", {"lora_rank": 16}),
]
# The same with flash-linear-attention running the DeltaNet's chunked delta rule: the analytic
# verdict decides (the traced step cannot run fla's kernels on meta tensors).
FLA: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3.5-0.8b", "auto", {"deltanet_kernels": "fla"}),
    ("qwen3.5-0.8b", "auto", {"deltanet_kernels": "fla", "lora_rank": 16}),
]
# Checkpointed full fine-tunes on families no checkpointed case was measured on, written after
# the walk played a checkpointed layer's first forward: separate and fused MLP projections,
# eager attention's scores, amp.
CHECKPOINTED: list[tuple[str, str, dict[str, Any]]] = [
    ("mistral-7b-v0.3", "none", {"grad_checkpointing": True}),
    ("phi-3-mini", "none", {"grad_checkpointing": True}),
    ("gemma-2-2b", "none", {"grad_checkpointing": True, "attn": "eager"}),
    ("llama-3.2-3b", "none", {"grad_checkpointing": True, "precision": "amp-bf16"}),
]
SETUP_SETS = {
    "grid": SETUPS,
    "held-out": HELD_OUT,
    "new-families": NEW_FAMILIES,
    "held-out-2": HELD_OUT_2,
    "gated-norm": GATED_NORM,
    "fla": FLA,
    "checkpointed": CHECKPOINTED,
}
SEQ = 2048
# Below this many sequences a batch step moves the peak too far: the edge is found in the
# sequence length instead.
MIN_BATCH_EDGE = 10


def edge_cases(model: str, kernels: str, options: dict[str, Any], gpu_name: str) -> list[dict]:
    """The largest batch advise gives (or, where a batch step is coarse, its largest sequence)
    and one more, each with the verdict advise prints for it: what a user would act on."""
    spec, gpu = resolve_model(model), resolve_gpu(gpu_name)
    # not whichever imports where it runs
    options = {"deltanet_kernels": "torch", "deltanet_conv": "torch", **options}

    def advised(batch: int, seq: int) -> Any:
        return advise(spec, batch, seq, gpu=gpu, kernels=kernels, **options)

    # asked at the analytic edge, advise searches the largest batch with the traced verdict
    # where that applies (memplan.edge_verdict)
    best = advised(1, SEQ).max_batch or 0
    best = advised(max(best, 1), SEQ).max_batch or 0
    if best >= MIN_BATCH_EDGE:
        points = [(best, SEQ), (best + 1, SEQ)]
    else:
        batch = max(best, 1)
        seq = advised(batch, SEQ).max_seq or SEQ_STEP
        seq = advised(batch, seq).max_seq or SEQ_STEP
        points = [(batch, seq), (batch, seq + SEQ_STEP)]
    cases = []
    for batch, seq in points:
        answer = advised(batch, seq)
        reserved = answer.estimate.reserved
        assert reserved is not None
        setup = answer.setup
        # the analytic replay's verdict too, where the traced step decides advise's
        analytic = judge(spec, setup, gpu).reserved
        assert analytic is not None
        cases.append(
            {
                "case": VerifyCase(
                    case=case_name(spec.name or model, setup),
                    model=spec.name or model,
                    model_type=spec.model_type,
                    hf_config=spec.hf_config,
                    setup=setup,
                ).model_dump(mode="json"),
                "gpu": gpu.name,
                "capacity_bytes": gpu.capacity,
                "allocated_bytes": answer.peak_bytes,
                "runs": answer.fits,
                "reserved_bytes": reserved.reserved_bytes,
                "reserved_method": reserved.method,
                "analytic_runs": analytic.runs,
                "analytic_reserved_bytes": analytic.reserved_bytes,
                "oom_at": reserved.oom_label,
                "advised_max_batch": answer.max_batch,
                "advised_max_seq": answer.max_seq,
            }
        )
    return cases


def predict(args: argparse.Namespace) -> int:
    cases = []
    for model, kernels, options in SETUP_SETS[args.setups]:
        for case in edge_cases(model, kernels, options, args.gpu):
            cases.append(case)
            share = case["allocated_bytes"] / case["capacity_bytes"]
            print(
                f"{case['case']['case']}: {'runs' if case['runs'] else 'out of memory'}, "
                f"allocated {share:.3f} of capacity, reserved {case['reserved_bytes'] / 2**30:.2f}"
                " GiB",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"gpu": args.gpu, "cases": cases}, indent=1) + "\n")
    return 0


def measure(args: argparse.Namespace) -> int:
    from memplan.verify.report import render_markdown

    out = Path(args.out_dir)
    report = measure_predicted(
        Path(args.predictions),
        out / "fit_grid_results.json",
        label="fit verdict at the edge of GPU memory",
        only=args.only,
        timeout_s=args.timeout,
        say=lambda item, m: (
            f"predicted {'runs' if item['runs'] else 'out of memory'}; measured {m.status} "
            f"{m.error or ''}"
        ),
    )
    (out / "fit_grid_report.md").write_text(
        render_markdown(report, title="Fit verdict at the edge of GPU memory")
    )
    return 0


def table(args: argparse.Namespace) -> int:
    predictions = {
        c["case"]["case"]: c for c in json.loads(Path(args.predictions).read_text())["cases"]
    }
    report = Report.model_validate_json(Path(args.results).read_text())
    print(
        "| case | allocated / capacity | predicted | predicted reserved GiB | measured "
        "| measured reserved GiB | verdict |"
    )
    print("|---|---:|---|---:|---|---:|---|")
    right = 0
    for m in report.measurements:
        p = predictions[m.case]
        ran = m.status == "ok"
        right += p["runs"] == ran
        measured = (
            "ran" if ran else f"out of memory above {(m.oom_above_bytes or 0) / 2**30:.2f} GiB"
        )
        print(
            f"| {m.case} | {p['allocated_bytes'] / p['capacity_bytes']:.3f} "
            f"| {'runs' if p['runs'] else 'out of memory'} | {p['reserved_bytes'] / 2**30:.2f} "
            f"| {measured} | {(m.reserved_bytes or 0) / 2**30 if ran else 0:.2f} "
            f"| {'right' if p['runs'] == ran else 'wrong'} |"
        )
    print(f"\nFirst predictions right on {right} of {len(report.measurements)} cases.")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, predict, measure, table, timeout_s=120, setup_sets=tuple(SETUP_SETS)))
