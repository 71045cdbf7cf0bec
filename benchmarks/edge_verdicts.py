"""advise's fit verdict with the code as it is, on every measured case near the capacity: each
case of the committed results files (tests/data and benchmarks) that ran or ran out of memory,
judged on its GPU's measured capacity (less what that run found outside the allocator) where its
analytic peak lies in the edge zone (memplan.edge_verdict.at_edge), with the traced verdict where
advise takes it; against whether it ran. On the CPU: a few seconds a traced case.

    python benchmarks/edge_verdicts.py run [--out FILE]
    python benchmarks/edge_verdicts.py table [FILE]

FILE defaults to benchmarks/results_edge_verdicts_cpu.json. A case measured with a patch that
no longer matches memplan's (a module count of its `applied` record unlike the current patch's)
is listed as stale and not counted."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.advisor import judge  # noqa: E402
from memplan.catalog import resolve_gpu  # noqa: E402
from memplan.edge_verdict import at_edge, judged_at_edge  # noqa: E402
from memplan.schema import Measurement  # noqa: E402
from memplan.verify.predict import measured_gpu, ran_setup, spec_from_hf_config  # noqa: E402
from memplan.verify.report import load_reports  # noqa: E402

OUT = REPO / "benchmarks/results_edge_verdicts_cpu.json"
NOT_RESULTS = ("predictions", "prediction_", "e2e", "trace", "capacity", "contract_gaps")
NOT_RESULTS += ("fla_local_memory", "edge_verdicts")
# Measured before memplan's rms_norm took Qwen3.5's gated RMSNorm (61 modules, 79 since).
STALE_PATCH = {"qwen3_5_text": {"rms_norm": 61}}


def results_files() -> list[Path]:
    found = sorted((REPO / "benchmarks").glob("results_*.json"))
    kept = [f for f in found if not any(part in f.name for part in NOT_RESULTS)]
    return [REPO / "tests/data/measurements_h200.json", *kept]


def stale(m: Measurement) -> bool:
    modules = (m.applied or {}).get("modules") or {}
    old = STALE_PATCH.get(m.model_type or "", {})
    return any(modules.get(kernel) == count for kernel, count in old.items())


def judged(m: Measurement, gpu_name: str) -> dict[str, Any] | None:
    """The verdict row of one measurement, or None where it is not at the edge."""
    spec = spec_from_hf_config(m.hf_config, m.model)
    setup = ran_setup(m)
    gpu = measured_gpu(m, resolve_gpu(gpu_name))
    if gpu is None:
        return None
    analytic = judge(spec, setup, gpu)
    if analytic.reserved is None or not at_edge(analytic, gpu):
        return None
    now = judged_at_edge(spec, setup, gpu, analytic)
    assert now.reserved is not None
    return {
        "case": m.case,
        "gpu": gpu_name,
        "capacity_bytes": gpu.capacity,
        "measured_runs": m.status == "ok",
        "analytic_runs": analytic.reserved.runs,
        "runs": now.reserved.runs,
        "method": now.reserved.method,
        "reserved_bytes": now.reserved.reserved_bytes,
        "measured_reserved_bytes": m.reserved_bytes,
        "stale_patch": stale(m),
    }


def run(args: argparse.Namespace) -> int:
    rows = []
    for path in results_files():
        gpu_name = "h200" if "h200" in path.name else "h100"
        for m in load_reports([str(path)]).measurements:
            if m.status not in ("ok", "oom") or m.liger or not m.model_type:
                continue
            row = judged(m, gpu_name)
            if row is None:
                continue
            row["file"] = str(path.relative_to(REPO))
            rows.append(row)
            right = row["runs"] == row["measured_runs"]
            print(f"{row['case']}: {row['method']} {'right' if right else 'wrong'}", flush=True)
    Path(args.out).write_text(json.dumps({"cases": rows}, indent=1) + "\n")
    print(summary(rows))
    return 0


def summary(rows: list[dict[str, Any]]) -> str:
    counted = [r for r in rows if not r["stale_patch"]]
    right = sum(r["runs"] == r["measured_runs"] for r in counted)
    analytic = sum(r["analytic_runs"] == r["measured_runs"] for r in counted)
    return (
        f"{len(counted)} measured runs at the edge ({len(rows) - len(counted)} stale left out): "
        f"advise's verdict right on {right}, the analytic replay's alone on {analytic}"
    )


def table(args: argparse.Namespace) -> int:
    rows = json.loads(Path(args.file).read_text())["cases"]
    print("| case | GPU | measured | advise now | from | |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["runs"] != r["measured_runs"] or r["stale_patch"]:
            measured = "ran" if r["measured_runs"] else "out of memory"
            said = "runs" if r["runs"] else "out of memory"
            note = "stale patch" if r["stale_patch"] else "wrong"
            print(f"| {r['case']} | {r['gpu']} | {measured} | {said} | {r['method']} | {note} |")
    print()
    print(summary(rows))
    return 0


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(OUT))
    t = sub.add_parser("table")
    t.add_argument("file", nargs="?", default=str(OUT))
    args = parser.parse_args()
    return {"run": run, "table": table}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
