"""What the benchmarks that record first predictions share: the predict / measure / table
command line, and the measuring of a predictions file's cases, each in a fresh process, the
results written after every case (a run cut short keeps what it measured)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.schema import Measurement, Report, VerifyCase  # noqa: E402
from memplan.verify.runner import RANKS  # noqa: E402


def measure_predicted(
    predictions: Path,
    results: Path,
    *,
    label: str,
    only: str | None,
    timeout_s: float,
    say: Callable[[dict[str, Any], Measurement], str],
    ranks: str = "simulated",
) -> Report:
    """Run every predicted case (those whose name matches `only`) and write `results`; a case
    of several GPUs runs its ranks as `ranks` says (memplan.verify.runner.with_ranks)."""
    from memplan.verify.runner import run_case, with_ranks

    results.parent.mkdir(parents=True, exist_ok=True)
    report = Report(label=label)
    for item in json.loads(predictions.read_text())["cases"]:
        case = VerifyCase.model_validate(item["case"])
        if only and not re.search(only, case.case):
            continue
        case = with_ranks(case, ranks)
        m = run_case(case, timeout_s=timeout_s)
        report.measurements.append(m)
        print(f"{case.case}: {say(item, m)}", flush=True)
        results.write_text(report.model_dump_json(indent=1))
    return report


def main(
    doc: str,
    predict: Callable[[argparse.Namespace], int],
    measure: Callable[[argparse.Namespace], int],
    table: Callable[[argparse.Namespace], int],
    timeout_s: float,
) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--out", required=True)
    m = sub.add_parser("measure")
    m.add_argument("predictions")
    m.add_argument("--out-dir", required=True)
    m.add_argument("--only")
    m.add_argument("--timeout", type=float, default=timeout_s)
    m.add_argument("--ranks", choices=RANKS, default="simulated")
    t = sub.add_parser("table")
    t.add_argument("predictions")
    t.add_argument("results")
    args = parser.parse_args()
    return {"predict": predict, "measure": measure, "table": table}[args.command](args)
