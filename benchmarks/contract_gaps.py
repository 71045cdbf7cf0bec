"""The registry's hand-written contracts against the traced step (memplan.traced.compare) on the
small configs of tests/traced/test_compare.py, and the analytic estimate against the H200
measurements, as one labelled section of a results file.

    python benchmarks/contract_gaps.py --label after [--only REGEX] [--jobs 2]

1. Every registry family (hidden 512, 2 layers, batch 4 x 1024) in bf16, eager bf16, fp32 and
   fp32 eager, and every variant test_compare.py runs (its VARIANTS, EXTRA_VARIANTS and
   KNOWN_GAPS): the peak and each phase's peak of both estimates.
2. tests/data/measurements_h200.json predicted again by the analytic estimator: each case's
   steady-peak error.

Writes benchmarks/results_contract_gaps_cpu.json, keeping the file's other labels (a section
per state of the contracts: run it before and after a change). Runs on the CPU."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "benchmarks" / "results_contract_gaps_cpu.json"
MEASURED = REPO / "tests" / "data" / "measurements_h200.json"
# The setups every family runs beside test_compare.py's own variants.
SWEEP = {
    "bf16": {},
    "eager": {"attn": "eager"},
    "fp32": {"precision": "fp32"},
    "fp32-eager": {"precision": "fp32", "attn": "eager"},
}


def cases() -> list[tuple[str, str, dict, dict]]:
    """(case id, family, config overrides, setup options)."""
    from tests.patching import tiny_models
    from tests.traced.test_compare import EXTRA_VARIANTS, KNOWN_GAPS, VARIANTS

    out = []
    for family in tiny_models.FAMILIES:
        out += [(f"{family} {name}", family, {}, options) for name, options in SWEEP.items()]
    for family, options in VARIANTS.items():
        out.append((f"{family} variant", family, {}, options))
    for index, (family, overrides, options) in enumerate(EXTRA_VARIANTS):
        out.append((f"{family} extra{index}", family, overrides, options))
    for index, (family, overrides, options) in enumerate(KNOWN_GAPS):
        out.append((f"{family} gap{index}", family, overrides, options))
    return out


def compare_case(case: tuple[str, str, dict, dict]) -> dict:
    from memplan.schema import TrainSetup
    from memplan.traced.compare import compare
    from tests.traced.test_compare import small_spec

    name, family, overrides, options = case
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}
    try:
        result = compare(small_spec(family, **overrides), TrainSetup(batch=4, seq=1024, **options))
    except Exception as error:  # a setup the family refuses: recorded, not fatal
        return {"case": name, "overrides": overrides, "options": options, "error": str(error)}
    return {
        "case": name,
        "overrides": overrides,
        "options": options,
        "peak_pct": round(result.peak_difference_pct, 4),
        "analytic_peak": f"{result.analytic.peak_phase}: {result.analytic.peak_label}",
        "rows": {
            row.what: {
                "analytic": row.analytic,
                "traced": row.traced,
                "pct": round(row.difference_pct, 4),
            }
            for row in result.rows
        },
    }


def measured_errors() -> dict:
    from memplan.verify.predict import attach_prediction
    from memplan.verify.report import load_reports

    report = load_reports((str(MEASURED),))
    errors = {}
    for m in report.measurements:
        m = attach_prediction(m)
        if m.error_pct is not None:
            errors[m.case] = round(m.error_pct, 4)
    values = [abs(v) for v in errors.values()]
    return {
        "cases": len(values),
        "median_abs_pct": round(statistics.median(values), 4),
        "max_abs_pct": round(max(values), 4),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the section to write: before, after")
    parser.add_argument("--only", help="regex over case ids")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    chosen = [c for c in cases() if not args.only or re.search(args.only, c[0])]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = []
        for row in pool.map(compare_case, chosen):
            results.append(row)
            print(f"{row['case']}: {row.get('peak_pct', row.get('error'))}", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    section = data.get(args.label, {})
    # a partial run (--only) updates its cases; a full run replaces the section's, whose ids
    # are positions in test_compare's lists
    old = {row["case"]: row for row in section.get("compare", [])} if args.only else {}
    old.update({row["case"]: row for row in results})
    from memplan.versions import installed_versions

    data[args.label] = {
        "commit": commit,
        "versions": installed_versions(),
        "compare": sorted(old.values(), key=lambda row: row["case"]),
        "measurements_h200": measured_errors(),
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    m = data[args.label]["measurements_h200"]
    print(f"H200 cases {m['cases']}: median {m['median_abs_pct']}%, max {m['max_abs_pct']}%")


if __name__ == "__main__":
    main()
