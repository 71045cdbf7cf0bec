"""The fit verdict from the traced step's event stream against the first predictions and the
GPU: each case of a GPU's fit grid (benchmarks/results_fit_grid_predictions_GPU.json, measured
in results_fit_grid_GPU.json) and, on the H100, of the recorded allocator traces
(tests/data/allocator_traces), traced on the CPU (memplan/traced, the protocol's steps),
replayed through the allocator model at the GPU's measured capacity, and put beside the first
prediction and the measurement.

    python benchmarks/traced_verdict.py run [--gpu h100|h200] [--out FILE] [--only REGEX]
    python benchmarks/traced_verdict.py table [FILE]

`run` needs no GPU (a few seconds a case) and writes FILE
(default benchmarks/results_traced_verdict_GPU.json); `table` prints it as markdown
(docs/fit_verdict.md)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.catalog import resolve_gpu  # noqa: E402
from memplan.estimators.allocator import AllocatorSettings, replay  # noqa: E402
from memplan.schema import Measurement, Report, TrainSetup  # noqa: E402

TRACES = REPO / "tests/data/allocator_traces"  # recorded on an H100


def grid_files(gpu: str) -> tuple[Path, Path]:
    """The fit grid's first predictions and measurements on `gpu` (h100, h200)."""
    return (
        REPO / f"benchmarks/results_fit_grid_predictions_{gpu}.json",
        REPO / f"benchmarks/results_fit_grid_{gpu}.json",
    )


def traced_replay(
    model: str,
    model_type: str,
    hf_config: dict,
    setup: TrainSetup,
    steps: int,
    capacity: int,
    gpu_name: str = "h100",
) -> dict[str, Any]:
    """The traced run of the protocol's `steps` steps replayed at `capacity`: verdict, reserved
    and allocated peaks; or the one line that says why it could not be traced."""
    from memplan.errors import MemplanError
    from memplan.traced.estimate import event_log
    from memplan.traced.model import hf_config as to_hf
    from memplan.traced.step import trace_steps

    gpu = resolve_gpu(gpu_name)
    start = time.perf_counter()
    try:
        config = to_hf(dict(hf_config, model_type=model_type), name=model, trust_remote_code=False)
        run = trace_steps(config, setup, gpu, steps=steps)
    except MemplanError as exc:
        return {"error": str(exc).splitlines()[0]}
    events = event_log(run).events
    settings = AllocatorSettings(capacity=capacity, expandable_segments=setup.expandable_segments)
    result = replay(events, settings)
    oom = None if result.oom_index is None else events[result.oom_index]
    return {
        "runs": oom is None,
        "reserved_bytes": result.peak_reserved,
        "allocated_bytes": result.peak_allocated,
        "oom_at": None if oom is None else f"{oom.phase}: {oom.label}",
        "events": len(events),
        "trace_s": round(time.perf_counter() - start, 2),
    }


def fit_grid_rows(only: str | None, gpu: str) -> list[dict[str, Any]]:
    predicted, measured = grid_files(gpu)
    predictions = {c["case"]["case"]: c for c in json.loads(predicted.read_text())["cases"]}
    report = Report.model_validate_json(measured.read_text())
    rows = []
    for m in report.measurements:
        if only and not re.search(only, m.case):
            continue
        p = predictions[m.case]
        traced = traced_replay(
            m.model, m.model_type, m.hf_config, m.setup, m.steps, p["capacity_bytes"], gpu
        )
        rows.append(
            {
                "set": "fit grid",
                "case": m.case,
                "capacity_bytes": p["capacity_bytes"],
                "analytic": {
                    "runs": p["runs"],
                    "reserved_bytes": p["reserved_bytes"],
                    "allocated_bytes": p["allocated_bytes"],
                },
                "traced": traced,
                "measured": {
                    "runs": m.status == "ok",
                    "reserved_bytes": m.reserved_bytes,
                    "allocated_bytes": m.peak_bytes,
                    "oom_above_bytes": m.oom_above_bytes,
                    "error": m.error if m.status == "error" else None,
                },
            }
        )
        print(f"{m.case}: {_line(rows[-1])}", flush=True)
    return rows


def trace_rows(only: str | None) -> list[dict[str, Any]]:
    """The recorded runs: the traced stream's reserved peak with the GPU's whole memory (none of
    them ran near it) against max_memory_reserved()."""
    rows = []
    for path in sorted(TRACES.glob("*.json.gz")):
        m = Measurement.model_validate_json(gzip.open(path, "rt").read())
        if only and not re.search(only, m.case):
            continue
        if m.setup.strategy is not None:  # the traced step is one process: no DDP
            continue
        capacity = resolve_gpu("h100").capacity
        traced = traced_replay(m.model, m.model_type, m.hf_config, m.setup, m.steps, capacity)
        rows.append(
            {
                "set": "allocator traces",
                "case": m.case,
                "capacity_bytes": capacity,
                "traced": traced,
                "measured": {
                    "runs": m.status == "ok",
                    "reserved_bytes": m.reserved_bytes,
                    "allocated_bytes": m.peak_bytes,
                },
            }
        )
        print(f"{m.case}: {_line(rows[-1])}", flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    t = row["traced"]
    if "error" in t:
        return f"not traced: {t['error']}"
    return (
        f"traced {'runs' if t['runs'] else 'out of memory'}, reserved "
        f"{t['reserved_bytes'] / 2**30:.2f} GiB ({t['trace_s']} s); measured "
        f"{'ran' if row['measured']['runs'] else 'out of memory'}"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    rows = fit_grid_rows(args.only, args.gpu)
    if args.gpu == "h100":
        rows += trace_rows(args.only)
    out = {
        "note": "traced on the CPU; the fit grid's analytic verdicts are its first predictions",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
    }
    default = REPO / f"benchmarks/results_traced_verdict_{args.gpu}.json"
    Path(args.out or default).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _error(predicted: int, measured: int) -> float:
    return 100 * (predicted - measured) / measured


def table(args: argparse.Namespace) -> int:
    rows = json.loads(Path(args.file).read_text())["rows"]
    grid = [r for r in rows if r["set"] == "fit grid"]
    print("| case | measured | first prediction | traced | traced reserved error |")
    print("|---|---|---|---|---:|")
    for r in grid:
        m, a, t = r["measured"], r["analytic"], r["traced"]
        measured = "ran" if m["runs"] else f"OOM above {(m['oom_above_bytes'] or 0) / 2**30:.2f}"
        if m.get("error"):  # not torch's out-of-memory error: the step failed all the same
            measured = f"failed ({m['error'][:44]})"
        analytic = ("runs" if a["runs"] else "OOM") + (" ✓" if a["runs"] == m["runs"] else " ✗")
        if "error" in t:
            traced, err = "not traced", ""
        else:
            traced = ("runs" if t["runs"] else "OOM") + (" ✓" if t["runs"] == m["runs"] else " ✗")
            both = m["runs"] and t["runs"]
            err = f"{_error(t['reserved_bytes'], m['reserved_bytes']):+.2f}%" if both else ""
        print(f"| {r['case']} | {measured} | {analytic} | {traced} | {err} |")
    print()
    for label, part in _parts(grid):
        traced = [r for r in part if "error" not in r["traced"]]
        a_right = sum(r["analytic"]["runs"] == r["measured"]["runs"] for r in part)
        t_right = sum(r["traced"]["runs"] == r["measured"]["runs"] for r in traced)
        errors = [
            abs(_error(r["traced"]["reserved_bytes"], r["measured"]["reserved_bytes"]))
            for r in traced
            if r["traced"]["runs"] and r["measured"]["runs"]
        ]
        spread = (
            f"median {statistics.median(errors):.2f}%, max {max(errors):.2f}% on {len(errors)}"
            if errors
            else "none"
        )
        print(
            f"- {label}: first prediction right on {a_right}/{len(part)}; traced right on "
            f"{t_right}/{len(traced)} traced; traced reserved |error| {spread}"
        )
    recorded = [r for r in rows if r["set"] == "allocator traces" and "error" not in r["traced"]]
    errors = [
        abs(_error(r["traced"]["reserved_bytes"], r["measured"]["reserved_bytes"]))
        for r in recorded
    ]
    if errors:
        print(
            f"- allocator traces: traced reserved |error| median {statistics.median(errors):.2f}%,"
            f" max {max(errors):.2f}% on {len(errors)}"
        )
    print()
    print("| allocator trace | traced reserved error |")
    print("|---|---:|")
    for r in rows:
        if r["set"] != "allocator traces":
            continue
        t = r["traced"]
        err = (
            "not traced"
            if "error" in t
            else f"{_error(t['reserved_bytes'], r['measured']['reserved_bytes']):+.2f}%"
        )
        print(f"| {r['case']} | {err} |")
    return 0


def _parts(grid: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    plain = [r for r in grid if r["case"].endswith("_hf")]
    kernels = [r for r in grid if not r["case"].endswith("_hf")]
    return [("no memplan kernels", plain), ("memplan kernels", kernels), ("all", grid)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200"])
    p.add_argument("--out", help="default benchmarks/results_traced_verdict_GPU.json")
    p.add_argument("--only")
    p.set_defaults(func=run)
    t = sub.add_parser("table")
    t.add_argument(
        "file", nargs="?", default=str(REPO / "benchmarks/results_traced_verdict_h100.json")
    )
    t.set_defaults(func=table)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
