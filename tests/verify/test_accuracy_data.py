"""The estimator against real measurements: tests/data/measurements_h200.json was written on an
H200 by benchmarks/measure_grid.py (the measurement protocol, one fresh process per case). Each
prediction is recomputed here with the current estimator from the exact config and setup that
were measured. Goal (issues 2 and 6): median |error| <= 1.5% and every case <= 4%, with kernels
none and with memplan's kernels alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.verify.predict import attach_prediction
from memplan.verify.report import GOAL_MAX_PCT, GOAL_MEDIAN_PCT, error_stats, kernel_group

DATA = Path(__file__).parents[1] / "data" / "measurements_h200.json"

GROUPS = ("none", "memplan kernels")


@pytest.fixture(scope="module")
def measured():
    if not DATA.exists():
        pytest.skip(f"{DATA.name} is absent: run benchmarks/measure_grid.py on a GPU first")
    from memplan.verify.report import load_reports

    report = load_reports([DATA])
    ok = [m for m in report.measurements if m.status == "ok" and not m.liger]
    return [attach_prediction(m) for m in ok]


def _table(ms, step1: bool) -> str:
    def err(m):
        return m.step1_error_pct if step1 else m.error_pct

    worst = sorted(ms, key=lambda m: -abs(err(m) or 0))[:8]
    return "\n".join(f"  {err(m):+6.2f}%  {m.case}" for m in worst if err(m) is not None)


def test_enough_cases_were_measured(measured):
    assert len(measured) >= 30, f"only {len(measured)} measured cases in {DATA.name}"
    for group in GROUPS:
        assert any(kernel_group(m) == group for m in measured), f"no case with kernels {group}"
    missing = [f"{m.case}: {m.prediction_error}" for m in measured if m.predicted is None]
    assert not missing, "the estimator failed on:\n" + "\n".join(missing)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("step1", [False, True], ids=["steady peak", "step-1 peak"])
def test_prediction_error_within_goal(measured, group, step1):
    ms = [m for m in measured if kernel_group(m) == group]
    stats = error_stats(ms, step1=step1)
    assert stats is not None, f"no case with kernels {group}"
    detail = (
        f"kernels {group}, {'step 1' if step1 else 'steady'}: median |error| "
        f"{stats.median_abs_pct:.2f}%, max {stats.max_abs_pct:.2f}% over {stats.cases} cases; "
        f"worst:\n{_table(ms, step1)}"
    )
    assert stats.median_abs_pct <= GOAL_MEDIAN_PCT, detail
    for m in ms:
        assert abs((m.step1_error_pct if step1 else m.error_pct) or 0.0) <= GOAL_MAX_PCT, detail


# What the estimator reaches on these measurements (`memplan report
# tests/data/measurements_h200.json --recompute`: steady median 0.02% and max 1.09%, step 1
# max 1.68%), with a margin: a change that loses accuracy on cases it got right fails here long
# before it leaves the goal.
REACHED = {False: (0.1, 1.5), True: (0.25, 2.5)}  # step1 -> (median, max) |error| in %


@pytest.mark.parametrize("step1", [False, True], ids=["steady peak", "step-1 peak"])
def test_prediction_error_stays_where_it_was(measured, step1):
    median_pct, max_pct = REACHED[step1]
    for group in GROUPS:
        ms = [m for m in measured if kernel_group(m) == group]
        stats = error_stats(ms, step1=step1)
        detail = f"kernels {group}: worst:\n{_table(ms, step1)}"
        assert stats.median_abs_pct <= median_pct, detail
        assert stats.max_abs_pct <= max_pct, detail
