"""End-to-end training steps: Hugging Face, Liger-Kernel and memplan (kernels all) side by side,
the training cases the project's end-to-end goals are set on (docs/methodology.md, and families
of the registry that Liger also patches) under the measurement protocol
(docs/measurement_protocol.md), each run in its own fresh process.

    python benchmarks/bench_e2e.py [--out-dir DIR] [--steps 10] [--docs FILE] [--only REGEX]
    python benchmarks/bench_e2e.py --from-json DIR/bench_e2e.json   # only redraw the table

Peak = torch.cuda.max_memory_allocated() over the steps; tokens/s over every step after the
first (synchronized). Liger is applied with `_apply_liger_kernel_to_instance(model=model)`
(its defaults: RoPE, RMSNorm, SwiGLU/GeGLU, fused linear cross entropy). Writes bench_e2e.json
(memplan Report) and bench_e2e.md into --out-dir (default $OUT, else ./bench_out), and the
markdown to --docs as well."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure_grid import describe, plan  # noqa: E402

from memplan.schema import GIB, Measurement, Report  # noqa: E402
from memplan.verify.runner import run_case  # noqa: E402

# (model, layers, batch, seq): the end-to-end goal cases (docs/methodology.md)
CASES = [
    ("llama-3.2-1b", None, 8, 2048),
    ("qwen2.5-1.5b", None, 4, 2048),
    ("gemma-2b", None, 4, 2048),
    ("llama-3-8b", 4, 8, 2048),
    ("olmo-2-0425-1b", None, 8, 2048),
    ("gemma-4-31b", 4, 2, 2048),
    ("gpt-oss-20b", 2, 4, 2048),
    # Liger patches qwen3_5_text (apply_liger_kernel_to_qwen3_5); both leave the DeltaNet as HF
    ("qwen3.5-0.8b", None, 4, 2048),
]
# memplan run again with FLCE's setting fixed, beside the plan's: (model, advise options)
MEMPLAN_ALSO = [
    # the plan's fp32-accumulator schedule holds a (vocab x hidden) fp32 sum, 0.95 GiB at
    # Qwen3.5's 248k vocabulary; the two-pass schedule at 1024 rows holds no such sum
    ("qwen3.5-0.8b", {"flce_chunk": 1024}),
]
VARIANTS = ("hf", "liger", "memplan")
# the goal for memplan against Liger, measured side by side in one run
GOAL_PEAK_RATIO = 1.0
GOAL_SPEED_RATIO = 1.05


def liger_version() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def variant_of(m: Measurement) -> str:
    return "liger" if m.liger else ("memplan" if m.setup.kernels else "hf")


def row_key(m: Measurement) -> str:
    return f"{m.model}, batch {m.setup.batch}, seq {m.setup.seq}"


def flce_setting(m: Measurement) -> str:
    if "flce" not in m.setup.kernels:
        return "—"
    if m.setup.flce_memory_budget:
        return f"budget {m.setup.flce_memory_budget / 2**20:.0f} MiB"
    return f"chunk {m.setup.flce_chunk}"


def render(report: Report, *, liger: str | None, steps: int) -> str:
    rows: dict[str, dict[str, list[Measurement]]] = {}
    for m in report.measurements:
        rows.setdefault(row_key(m), {}).setdefault(variant_of(m), []).append(m)
    env = next((m.env for m in report.measurements if m.env), {})
    # the version the child processes loaded, where a Liger run recorded it
    liger = next(
        (m.env["liger_kernel"] for m in report.measurements if "liger_kernel" in m.env), liger
    )

    def peak(m: Measurement | None) -> str:
        if m is None:
            return "not run"
        if m.status == "oom":
            return f"OOM above {m.oom_above_bytes / GIB:.2f}"
        if m.status == "error":
            return "error"
        return f"{m.peak_bytes / GIB:.2f}"

    def speed(m: Measurement | None) -> str:
        return f"{m.tokens_per_s:,.0f}" if m is not None and m.tokens_per_s else "—"

    def ratio(a: Measurement | None, b: Measurement | None, attr: str) -> float | None:
        x, y = (getattr(a, attr, None), getattr(b, attr, None))
        return x / y if x and y else None

    lines = [
        "# End-to-end training step: Hugging Face, Liger-Kernel, memplan",
        "",
        f"GPU: {env.get('gpu', '?')}; torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}, triton {env.get('triton', '?')}, liger-kernel "
        f"{liger or 'not installed'}. Measured by `benchmarks/bench_e2e.py`: the protocol of "
        f"docs/measurement_protocol.md, {steps} AdamW steps per fresh process; "
        "peak = max_memory_allocated (GiB), tokens/s over the steps after the first.",
        "",
        "| case | HF peak | HF tokens/s | Liger peak | Liger tokens/s | memplan FLCE "
        "| memplan peak | memplan tokens/s | memplan predicted peak | peak memplan / Liger "
        "| tokens/s memplan / Liger | goal met |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for key, by in rows.items():
        hf, lg = (by.get(v, [None])[0] for v in ("hf", "liger"))
        for mp in by.get("memplan", [None]):
            peak_ratio = ratio(mp, lg, "peak_bytes")
            speed_ratio = ratio(mp, lg, "tokens_per_s")
            goal = "—"
            if peak_ratio is not None and speed_ratio is not None:
                met = peak_ratio <= GOAL_PEAK_RATIO and speed_ratio >= GOAL_SPEED_RATIO
                goal = "yes" if met else "no"
            predicted = f"{mp.predicted.peak_bytes / GIB:.2f}" if mp and mp.predicted else "—"
            lines.append(
                f"| {key} | {peak(hf)} | {speed(hf)} | {peak(lg)} | {speed(lg)} "
                f"| {flce_setting(mp) if mp else '—'} | {peak(mp)} | {speed(mp)} | {predicted} "
                f"| {f'{peak_ratio:.3f}' if peak_ratio else '—'} "
                f"| {f'{speed_ratio:.3f}' if speed_ratio else '—'} | {goal} |"
            )
    lines += [
        "",
        f"Goal: memplan's peak <= Liger's and its tokens/s >= {GOAL_SPEED_RATIO} x "
        "Liger's in every case.",
    ]
    notes = [f"- {m.case}: {m.error}" for m in report.measurements if m.status != "ok" and m.error]
    if notes:
        lines += ["", "Failures:", "", *notes]
    kernels = {m.case: "+".join(m.setup.kernels) for m in report.measurements if m.setup.kernels}
    if kernels:
        lines += ["", "memplan kernels: " + "; ".join(f"{c}: {k}" for c, k in kernels.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "bench_e2e.md")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per case")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="start no new run after this many seconds"
    )
    parser.add_argument("--from-json", type=Path, help="redraw the table from a results file")
    parser.add_argument("--only", help="regex: run only the cases whose model name matches")
    args = parser.parse_args()
    out_dir = args.out_dir or Path(os.environ.get("OUT") or "bench_out")
    liger = liger_version()

    if args.from_json:
        report = Report.model_validate_json(args.from_json.read_text())
        steps = report.measurements[0].steps if report.measurements else args.steps
        text = render(report, liger=liger, steps=steps)
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(text)
        print(text)
        return

    if liger is None:
        print("liger-kernel is not installed: its column stays empty (liger-kernel==0.8.5)")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "bench_e2e.json"
    start = time.monotonic()
    measurements: list[Measurement] = []
    for model, layers, batch, seq in CASES:
        if args.only and not re.search(args.only, model):
            continue
        runs = [(variant, {}) for variant in VARIANTS]
        runs += [("memplan", options) for name, options in MEMPLAN_ALSO if name == model]
        for variant, options in runs:
            if variant == "liger" and liger is None:
                continue
            if time.monotonic() - start > args.budget_s:
                print(f"time budget spent: {model} {variant} not run")
                continue
            case, spec = plan(
                model,
                batch,
                seq,
                options,
                kernels="none" if variant != "memplan" else "all",
                layers=layers,
                steps=args.steps,
                liger=variant == "liger",
            )
            t0 = time.monotonic()
            m = run_case(case, spec=spec, timeout_s=args.timeout_s)
            measurements.append(m)
            results.write_text(Report(measurements=measurements).model_dump_json(indent=1))
            print(f"{time.monotonic() - t0:5.1f}s  {case.case:60s} {describe(m)}", flush=True)
            if m.error_kind == "no_gpu":
                sys.exit(f"Error: {m.error}")
    report = Report(measurements=measurements)
    text = render(report, liger=liger, steps=args.steps)
    (out_dir / "bench_e2e.md").write_text(text)
    try:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(text)
    except OSError as exc:
        print(f"could not write {args.docs}: {exc}")
    print(text)
    print(f"wrote {results}, {out_dir / 'bench_e2e.md'} and {args.docs}")


if __name__ == "__main__":
    main()
