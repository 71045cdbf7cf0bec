"""What the benchmarks that record first predictions share: the predict / measure / table
command line, the record of each case's prediction made before anything is measured, the
measuring of a predictions file's cases, each in a fresh process, the results written after
every case (a run cut short keeps what it measured), and the table of first predictions and
the current code's against the measurements."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.advisor import judge  # noqa: E402
from memplan.catalog import resolve_gpu, spec_from_config  # noqa: E402
from memplan.schema import Gpu, Measurement, ModelSpec, Report, TrainSetup, VerifyCase  # noqa: E402
from memplan.verify.protocol import case_name  # noqa: E402
from memplan.verify.runner import RANKS  # noqa: E402


def write_predictions(runs: list[tuple[ModelSpec, TrainSetup]], gpu: Gpu, out: Path) -> int:
    """Each run's case with its allocated peak, step-1 peak, reserved peak and verdict predicted
    for `gpu`, written to `out` before anything is measured (the first predictions). Cases that
    `out` already holds keep the prediction made first; the others are added."""
    cases = json.loads(out.read_text())["cases"] if out.exists() else []
    predicted = {c["case"]["case"] for c in cases}
    for spec, setup in runs:
        case = VerifyCase(
            case=case_name(spec.name or spec.model_type, setup),
            model=spec.name or spec.model_type,
            model_type=spec.model_type,
            hf_config=spec.hf_config,
            setup=setup,
        )
        if case.case in predicted:
            continue
        judged = judge(spec, setup, gpu)
        assert judged.reserved is not None
        cases.append(
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
    out.write_text(json.dumps({"gpu": gpu.name, "cases": cases}, indent=1) + "\n")
    return 0


def _pct(predicted: int, measured: int) -> float:
    return 100 * (predicted - measured) / measured


def print_table(predictions: Path, results: Path) -> int:
    """The first predictions against the measurements, then what the code predicts now for the
    same cases (in-sample wherever a measurement led to a change), as markdown."""
    predicted = {c["case"]["case"]: c for c in json.loads(predictions.read_text())["cases"]}
    report = Report.model_validate_json(results.read_text())
    print(
        "| case | measured GiB | first prediction | error | now | error "
        "| reserved GiB | first | now |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    first_errors, now_errors, first_reserved, now_reserved = [], [], [], []
    for m in report.measurements:
        p = predicted[m.case.removesuffix("_torchrun")]  # real ranks: the same setup
        if m.status != "ok" or not m.peak_bytes or not m.reserved_bytes:
            said = "runs" if p["runs"] else "out of memory"
            print(f"| {m.case} | {m.status} | predicted: {said} | | | | | | |")
            continue
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


def measure_into(args: argparse.Namespace, results_name: str, label: str) -> int:
    """`measure`: the predictions file's cases into DIR/`results_name`, ranks as asked."""
    measure_predicted(
        Path(args.predictions),
        Path(args.out_dir) / results_name,
        label=label,
        only=args.only,
        timeout_s=args.timeout,
        say=lambda item, m: f"{m.status} {m.error or ''} {m.error_pct}",
        ranks=args.ranks,
    )
    return 0


def table(args: argparse.Namespace) -> int:
    """`table`: print_table of the command line's predictions and results files."""
    return print_table(Path(args.predictions), Path(args.results))


def main(
    doc: str,
    predict: Callable[[argparse.Namespace], int],
    measure: Callable[[argparse.Namespace], int],
    table: Callable[[argparse.Namespace], int],
    timeout_s: float,
    setup_sets: Sequence[str] = (),
) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--out", required=True)
    if setup_sets:
        p.add_argument("--setups", choices=setup_sets, default=setup_sets[0])
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
