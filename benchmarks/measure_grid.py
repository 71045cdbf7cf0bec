"""Measure a grid of training cases under the measurement protocol on one GPU, each in a fresh
process, with the estimator's prediction beside each: the data behind docs/accuracy.md
(tests/data/measurements_h200.json, benchmarks/results_grid_h200.json).

    python benchmarks/measure_grid.py [--out-dir DIR] [--budget-s 450] [--only REGEX] [--list]

The grid (GRID): llama, qwen2/qwen3, gemma 1-3, mistral, phi3 and the two MoE families, whole
or cut to a few layers; batch x seq up to 32K tokens; bf16 / amp-bf16 / amp-fp16 / fp32,
checkpointing, eager attention, LoRA, gradient accumulation, other optimizers; every setup with
kernels none and with the kernels the advisor picks, 3 steps per case.

Writes into --out-dir (default $OUT, else ./grid_out), after every case so a run cut short keeps
what it measured: grid_results.json (memplan Report: every raw measurement, the prediction where
the estimator could make one), and at the end grid_report.md with its figures."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.schema import GIB, Measurement, ModelSpec, Report, TrainSetup, VerifyCase  # noqa: E402
from memplan.verify.protocol import case_name  # noqa: E402
from memplan.verify.runner import run_case  # noqa: E402

RESULTS = "grid_results.json"
REPORT = "grid_report.md"


@dataclass(frozen=True)
class Config:
    """One setup of the grid; it is measured with kernels none and with the advised kernels."""

    model: str
    batch: int
    seq: int
    options: dict[str, Any] = field(default_factory=dict)
    layers: int | None = None
    timeline: bool = False


LORA_QV = {"lora_rank": 16, "lora_targets": ("q_proj", "v_proj")}
LORA_QKVO = {"lora_rank": 16, "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj")}
LORA_ALL = {
    "lora_rank": 16,
    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}

GRID: list[Config] = [
    Config("qwen3-0.6b", 4, 1024, timeline=True),
    Config("qwen3-0.6b", 8, 2048),
    Config("qwen3-0.6b", 2, 4096, {"grad_checkpointing": True}),
    Config("qwen3-0.6b", 4, 1024, {"precision": "amp-bf16"}),
    Config("qwen3-0.6b", 2, 1024, {"precision": "fp32"}),
    Config("qwen3-0.6b", 2, 1024, {"attn": "eager"}),
    Config("qwen3-0.6b", 4, 2048, LORA_QV),
    Config("llama-3.2-1b", 4, 2048, timeline=True),
    Config("llama-3.2-1b", 8, 2048, {"grad_checkpointing": True}),
    Config("llama-3.2-1b", 2, 2048, {"precision": "amp-bf16"}),
    Config("llama-3.2-1b", 2, 2048, {"attn": "eager"}),
    Config("llama-3.2-1b", 4, 1024, {**LORA_QKVO, "grad_checkpointing": True}),
    Config("qwen2.5-1.5b", 4, 2048),
    Config("qwen2.5-1.5b", 2, 4096, {"grad_checkpointing": True}),
    Config("qwen2.5-1.5b", 2, 1024, {"precision": "fp32"}),
    Config("gemma-2b", 2, 2048, timeline=True),
    Config("gemma-2b", 4, 1024, {"grad_checkpointing": True}),
    Config("gemma-2b", 2, 1024, {"attn": "eager"}),
    Config("llama-3-8b", 4, 2048, layers=4),
    # The optimizer step is the peak when activations are small.
    Config("qwen2.5-1.5b", 1, 256),
    Config("qwen2.5-1.5b", 1, 256, {"optimizer": "sgd-momentum"}),
    Config("qwen2.5-1.5b", 1, 256, {"optimizer": "adafactor"}),
    Config("qwen3-0.6b", 4, 1024, {"optimizer": "sgd"}),
    # Sliding-window layers (an explicit SDPA mask), softcapping, fused qkv / gate_up.
    Config("gemma-3-1b", 2, 2048),
    Config("gemma-2-2b", 2, 1024),
    Config("phi-3-mini", 2, 1024, layers=4),
    # Gradient accumulation: every micro-step after the first starts with all gradients alive.
    Config("llama-3.2-1b", 2, 1024, {"grad_accum": 4}),
    Config("qwen2.5-1.5b", 2, 1024, {"grad_accum": 2}),
    Config("gemma-2b", 1, 2048, {"grad_accum": 2}),
    Config("llama-3.2-1b", 4, 1024, {**LORA_QKVO, "grad_accum": 2}),
    # fp32 without grouped KV heads (SDPA's memory-efficient kernel, not its math path); amp
    # with LoRA (autocast copies frozen weights on every call, uncached).
    Config("smollm2-1.7b", 1, 2048, {"precision": "fp32"}),
    Config("phi-3-mini", 2, 1024, {"precision": "fp32"}, layers=4),
    Config("llama-3.2-1b", 2, 1024, {**LORA_QV, "precision": "amp-bf16"}),
    Config("qwen3-0.6b", 2, 1024, {**LORA_QV, "precision": "amp-bf16", "grad_checkpointing": True}),
    # Combinations beyond the first grid: adapters on the MLP (the GLU kernels keep
    # nn.Linear's call), LoRA in fp32 and under amp on other families, fp16 autocast,
    # checkpointing with eager attention and with accumulation.
    Config(
        "llama-3.2-1b",
        2,
        1024,
        {"lora_rank": 16, "lora_targets": ("gate_proj", "up_proj", "down_proj")},
    ),
    Config("qwen2.5-1.5b", 2, 1024, {**LORA_QV, "precision": "fp32"}),
    Config("gemma-3-1b", 2, 1024, {**LORA_QV, "precision": "amp-bf16"}),
    Config(
        "phi-3-mini",
        2,
        1024,
        {"lora_rank": 16, "lora_targets": ("qkv_proj",), "precision": "amp-bf16"},
        layers=4,
    ),
    Config("qwen3-0.6b", 2, 1024, {"precision": "amp-fp16"}),
    Config("llama-3.2-1b", 2, 2048, {"attn": "eager", "grad_checkpointing": True}),
    Config("qwen3-0.6b", 2, 1024, {**LORA_QV, "grad_checkpointing": True, "grad_accum": 2}),
    Config("qwen3-30b-a3b", 1, 1024, {**LORA_QV, "precision": "amp-bf16"}, layers=2),
    Config("qwen3-30b-a3b", 1, 1024, {"precision": "amp-bf16"}, layers=2),
    Config("mixtral-8x7b", 1, 512, {"precision": "amp-bf16"}, layers=2),
    # Autocast over the other families' special layers, and more adapter placements.
    Config("gemma-2-2b", 2, 1024, {"precision": "amp-bf16"}),
    Config("gemma-3-1b", 2, 2048, {"precision": "amp-bf16"}),
    Config("phi-3-mini", 2, 1024, {"precision": "amp-bf16"}, layers=4),
    Config("llama-3.2-1b", 2, 2048, {"precision": "amp-bf16", "grad_checkpointing": True}),
    Config("llama-3.2-1b", 2, 1024, {**LORA_ALL, "precision": "amp-bf16"}),
    Config("qwen3-0.6b", 2, 1024, {"precision": "amp-bf16", "attn": "eager"}),
    Config("qwen2.5-1.5b", 2, 1024, {"precision": "fp32", "grad_checkpointing": True}),
    Config("llama-3.2-1b", 2, 1024, {**LORA_ALL, "attn": "eager"}),
    Config("gemma-2-2b", 2, 1024, LORA_QV),
    Config("mixtral-8x7b", 1, 1024, LORA_QV, layers=2),
    # Session 10: regions no case had reached: the mistral family, sequences of 8K-32K tokens,
    # sliding-window masks past the window on mistral, gemma-2 and phi-3, fp32 with grouped KV
    # heads (SDPA's math path) with and without LoRA, tied embeddings at 3B, eager at 4B.
    Config("mistral-7b-v0.1", 1, 8192, layers=4),
    Config("mistral-7b-v0.3", 2, 2048, {**LORA_ALL, "precision": "amp-bf16"}, layers=4),
    Config("llama-3.2-1b", 1, 32768),
    Config("qwen3-1.7b", 1, 16384, {"grad_checkpointing": True}),
    Config("gemma-2-2b", 1, 8192),
    Config("phi-3-mini", 1, 4096, layers=4),
    Config("smollm2-135m", 8, 2048, {"precision": "fp32"}),
    Config("llama-3.2-1b", 2, 1024, {**LORA_QV, "precision": "fp32"}),
    Config(
        "qwen2.5-0.5b", 4, 2048, {**LORA_ALL, "precision": "amp-bf16", "grad_checkpointing": True}
    ),
    Config("gemma-3-4b", 1, 4096, LORA_QV, layers=6),
    Config("llama-3.2-3b", 2, 4096),
    Config("qwen3-4b", 1, 2048, {"attn": "eager"}, layers=8),
    # Mixture of experts, cut to 2 layers (router, top-k gather, expert matmuls).
    Config("qwen3-30b-a3b", 2, 1024, layers=2),
    Config("mixtral-8x7b", 1, 1024, layers=2),
]


def default_out_dir() -> Path:
    return Path(os.environ.get("OUT") or "grid_out")


def _catalog_config(model: str) -> dict[str, Any]:
    """The shipped config straight from the catalog's data file (used when the catalog code
    fails, so a bug there does not cost the measurements)."""
    entries = json.loads((REPO / "memplan" / "catalog" / "models.json").read_text())
    return dict(entries[model]["config"])


def _fallback_kernels(config: dict[str, Any]) -> tuple[str, ...]:
    from memplan.schema import GLU_KERNEL_BY_ACTIVATION

    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    glu = GLU_KERNEL_BY_ACTIVATION.get(act)
    return ("rms_norm", "rope") + ((glu,) if glu else ()) + ("flce",)


def plan(
    model: str,
    batch: int,
    seq: int,
    options: dict[str, Any],
    *,
    kernels: str,
    layers: int | None = None,
    steps: int = 3,
    timeline: bool = False,
    liger: bool = False,
) -> tuple[VerifyCase, ModelSpec | None]:
    """The case through memplan's planner (catalog, advisor); if that fails, built from the
    catalog's data file alone so that the measurement is still taken."""
    try:
        from memplan.verify.cases import plan_cases

        (item,) = plan_cases(
            model,
            batch=batch,
            seq=seq,
            kernels=kernels,
            layers=layers,
            steps=steps,
            timeline=timeline,
            **options,
        )
        case, spec = item.case, item.spec
    except Exception as exc:
        print(f"  planner failed ({type(exc).__name__}: {exc}); using the catalog data file")
        config = _catalog_config(model)
        name = model
        if layers is not None:
            config["num_hidden_layers"] = layers
            name = f"{model}-l{layers}"
        names = () if kernels == "none" else _fallback_kernels(config)
        setup = TrainSetup(batch=batch, seq=seq, kernels=names, **options)
        case = VerifyCase(
            case=case_name(name, setup),
            model=name,
            model_type=config["model_type"],
            hf_config=config,
            setup=setup,
            steps=steps,
            record_timeline=timeline,
        )
        spec = None
    if liger:
        setup = case.setup.model_copy(
            update={"kernels": (), "flce_chunk": None, "flce_memory_budget": None}
        )
        case = case.model_copy(
            update={"liger": True, "setup": setup, "case": case_name(case.model, setup, liger=True)}
        )
    return case, spec


def describe(m: Measurement) -> str:
    if m.status == "oom":
        measured = f"OOM above {m.oom_above_bytes / GIB:.2f} GiB"
    elif m.status == "error":
        measured = f"{m.error_kind}: {m.error}"
    else:
        measured = f"{m.peak_bytes / GIB:7.2f} GiB  {m.tokens_per_s or 0:9,.0f} tok/s"
    predicted = f"predicted {m.predicted.peak_bytes / GIB:7.2f} GiB" if m.predicted else ""
    error = f"{m.error_pct:+6.2f}%" if m.error_pct is not None else ""
    return f"{measured}  {predicted}  {error}".rstrip()


def run_all(
    cases: list[tuple[VerifyCase, ModelSpec | None]],
    out_file: Path,
    *,
    budget_s: float,
    timeout_s: float,
    label: str | None = None,
) -> Report:
    """Run the cases in order, one fresh process each, saving after every case; stop starting
    new ones once `budget_s` has passed (what was not run is listed)."""
    start = time.monotonic()
    measurements: list[Measurement] = []
    skipped: list[str] = []
    for i, (case, spec) in enumerate(cases, 1):
        elapsed = time.monotonic() - start
        if elapsed > budget_s:
            skipped.append(case.case)
            continue
        t0 = time.monotonic()
        m = run_case(case, spec=spec, timeout_s=timeout_s)
        measurements.append(m)
        out_file.write_text(
            Report(label=label, measurements=measurements).model_dump_json(indent=1)
        )
        took = time.monotonic() - t0
        print(f"[{i:2d}/{len(cases)}] {took:5.1f}s  {case.case:60s} {describe(m)}", flush=True)
        if m.error_kind == "no_gpu":
            sys.exit(f"Error: {m.error}")
    if skipped:
        print(
            f"time budget of {budget_s:.0f} s spent; not run ({len(skipped)}): "
            + ", ".join(skipped)
        )
        print("run them with: --only '" + "|".join(re.escape(s) for s in skipped) + "'")
    return Report(label=label, measurements=measurements)


def grid_cases(steps: int, only: str | None) -> list[tuple[VerifyCase, ModelSpec | None]]:
    cases = []
    for config in GRID:
        for kernels in ("none", "auto"):
            case, spec = plan(
                config.model,
                config.batch,
                config.seq,
                config.options,
                kernels=kernels,
                layers=config.layers,
                steps=steps,
                timeline=config.timeline,
            )
            if only is None or re.search(only, case.case):
                cases.append((case, spec))
    return cases


def summarize(report: Report) -> None:
    from memplan.verify.report import error_stats, kernel_group

    for group in ("none", "memplan kernels"):
        stats = error_stats(m for m in report.measurements if kernel_group(m) == group)
        if stats is None:
            print(f"kernels {group}: no case with both a prediction and a measurement")
            continue
        print(
            f"kernels {group}: {stats.cases} cases, median |error| {stats.median_abs_pct:.2f}%, "
            f"max {stats.max_abs_pct:.2f}% ({stats.worst_case}), mean {stats.mean_pct:+.2f}%"
        )
    times = [m.step_s for m in report.measurements if m.step_s]
    if times:
        print(f"median step time {statistics.median(times):.3f} s")


def write_report(report: Report, out_dir: Path, results: Path) -> None:
    from memplan.verify.report import render_markdown

    figures = None
    try:
        from memplan.verify.plots import write_figures

        figures = write_figures(report.measurements, out_dir / REPORT)
    except Exception as exc:  # the JSON is what matters; the figures can be redrawn
        print(f"figures not drawn: {type(exc).__name__}: {exc}")
    text = render_markdown(report, sources=[results.name], figures=figures)
    (out_dir / REPORT).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=default_out_dir())
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="start no new case after this many seconds"
    )
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per case")
    parser.add_argument("--only", help="regex: run only the cases whose name matches")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args()

    cases = grid_cases(args.steps, args.only)
    if args.list:
        for case, spec in cases:
            print(case.case, "(no planner)" if spec is None else "")
        print(f"{len(cases)} cases")
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = args.out_dir / RESULTS
    print(f"{len(cases)} cases; results in {results}", flush=True)
    report = run_all(cases, results, budget_s=args.budget_s, timeout_s=args.timeout_s)
    summarize(report)
    write_report(report, args.out_dir, results)
    print(f"wrote {results} and {args.out_dir / REPORT}")


if __name__ == "__main__":
    main()
