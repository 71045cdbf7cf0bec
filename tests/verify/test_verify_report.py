"""`memplan report` from a recorded results file. tests/data/fixture_results.json holds synthetic
numbers (labelled so in the file and in every report made from it), chosen so the statistics
are known: kernels none errors +1.0, -0.5, +2.0 %; memplan kernels -1.0, +3.0 %."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.verify.plots import choose_timeline_case, write_figures
from memplan.verify.report import error_stats, kernel_group, load_reports, render_markdown

FIXTURE = Path(__file__).parents[1] / "data" / "fixture_results.json"


@pytest.fixture
def report():
    return load_reports([FIXTURE])


def test_error_statistics_per_kernel_group(report):
    none = [m for m in report.measurements if kernel_group(m) == "none"]
    on = [m for m in report.measurements if kernel_group(m) == "memplan kernels"]
    stats_none, stats_on = error_stats(none), error_stats(on)
    assert stats_none.cases == 3  # the OOM and the failed case have no measured peak
    assert stats_none.median_abs_pct == pytest.approx(1.0, abs=1e-6)
    assert stats_none.max_abs_pct == pytest.approx(2.0, abs=1e-6)
    assert stats_none.mean_pct == pytest.approx((1.0 - 0.5 + 2.0) / 3, abs=1e-6)
    assert stats_none.worst_case == "fixture-c_b4_s2048_bf16_hf"
    # median 1.0 <= 1.5, max 2.0 <= 4, the OOM case predicted above its bound; yet the failed
    # case could not be judged, so the goal is not known to be met
    assert stats_none.oom_cases == 1 and stats_none.oom_under == ()
    assert stats_none.not_judged == (("failed", 1),)
    assert stats_none.verdict == "no: 1 case failed" and not stats_none.meets_goal
    assert error_stats(m for m in none if m.status != "error").meets_goal
    assert stats_on.median_abs_pct == pytest.approx(2.0, abs=1e-6)
    assert stats_on.max_abs_pct == pytest.approx(3.0, abs=1e-6)
    assert not stats_on.meets_goal  # median 2.0 > 1.5
    assert error_stats(none, step1=True).max_abs_pct == pytest.approx(4.0, abs=1e-6)


def test_markdown_report(report):
    text = render_markdown(report, sources=["fixture_results.json"])
    # the label says these are no measurements
    assert "> **FIXTURE: synthetic numbers" in text
    assert (
        "| none | 3 | 1.00% | 2.00% | +0.83% | fixture-c_b4_s2048_bf16_hf | 0.50% | 4.00% "
        "| 1 | 1 failed | no: 1 case failed |" in text
    )
    assert "| memplan kernels | 2 | 2.00% | 3.00% | +1.00% |" in text
    assert "| all | 5 | 1.00% | 3.00% |" in text
    # every case is a row; OOM says above how much; liger has no prediction
    assert "| fixture-b_b8_s2048_bf16_hf | none | 56.71 | 57.00 | -0.50% |" in text
    assert "out of memory above 78.50 |" in text
    oom = "measured: out of memory above 78.50 GiB"
    assert f"- fixture-d_b16_s4096_bf16_hf: predicted 90.00 GiB; {oom}" in text
    assert "; predicted +14.65% against that bound" in text  # (90 - 78.5) / 78.5
    assert (
        "- fixture-e_b1_s128_bf16_hf: build: the model failed to build: ValueError: fixture" in text
    )
    assert "| fixture-b_b8_s2048_bf16_liger | liger | — | 26.30 | — |" in text
    # the profile of the patched case, before and after
    assert "without patch: 120.00 ms of GPU time per step" in text
    assert "| `memplan::rms_norm` | 2.000 | 57 | 2.0% |" in text


def test_figures_are_written_next_to_the_report(report, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.md"
    figures = write_figures(report.measurements, out)
    assert list(figures.values()) == ["report_accuracy.png", "report_timeline.png"]
    for name in figures.values():
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    text = render_markdown(report, figures=figures)
    assert "(report_accuracy.png)" in text and "against the goal (±4% per case)" in text


def test_timeline_case_is_the_one_with_both_timelines(report):
    assert choose_timeline_case(report.measurements).case == "fixture-a_b4_s1024_bf16_hf"
    assert choose_timeline_case(report.measurements, "fixture-b_b8_s2048_bf16_hf") is None


def test_unknown_timeline_case(report, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(MemplanError, match="no case named 'nope' has a measured memory timeline"):
        write_figures(report.measurements, tmp_path / "r.md", timeline_case="nope")


def test_several_files_are_merged(tmp_path):
    merged = load_reports([FIXTURE, FIXTURE])
    assert len(merged.measurements) == 16
    assert merged.label.startswith("FIXTURE")


def test_bad_files(tmp_path):
    with pytest.raises(MemplanError, match="cannot read"):
        load_reports([tmp_path / "missing.json"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"measurements": [{"case": 1}]}')
    with pytest.raises(MemplanError, match="is not a memplan results file"):
        load_reports([bad])
    with pytest.raises(MemplanError, match="at least one results file"):
        load_reports([])


def _case(name, measured_gib, predicted_gib, **fields):
    from memplan.schema import GIB, Measurement, TrainSetup

    from .fakes import estimate

    measured = None if measured_gib is None else int(measured_gib * GIB)
    return Measurement(
        case=name,
        model="x",
        setup=TrainSetup(batch=1, seq=8),
        peak_bytes=measured,
        peak_step1_bytes=measured,
        predicted=None if predicted_gib is None else estimate(predicted_gib, predicted_gib),
        **fields,
    )


def _summary_row(text: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith("| none |")]
    return row


def test_an_out_of_memory_case_is_judged_against_its_bound():
    from memplan.schema import GIB, Report

    fits = _case("fits", 20, 20.1)
    # predicted 40 GiB, ran out above 78 GiB: the peak is at least 78, so at most -48.7% off
    oom = _case("b8", None, 40, status="oom", oom_above_bytes=78 * GIB, error="out of memory")
    stats = error_stats([fits, oom])
    assert (stats.oom_cases, stats.oom_under) == (1, ("b8",))
    assert not stats.meets_goal
    row = _summary_row(render_markdown(Report(measurements=[fits, oom])))
    assert row.endswith(
        "| 1, 1 under its bound | — | no: 1 case predicted below the out-of-memory bound |"
    )
    # predicted above its bound (or within the goal below it): judged and passing
    close = _case("b8", None, 75, status="oom", oom_above_bytes=78 * GIB, error="out of memory")
    assert error_stats([fits, close]).verdict == "yes"


def test_cases_that_cannot_be_judged_are_counted():
    from memplan.schema import Report

    fits = _case("fits", 20, 20.1)
    no_prediction = _case("b4", 30, None, prediction_error="KeyError: 'x'")
    failed = _case("b2", None, 10, status="error", error_kind="run", error="RuntimeError: x")
    text = render_markdown(Report(measurements=[fits, no_prediction, failed]))
    assert _summary_row(text).endswith(
        "| 1 without a prediction, 1 failed | no: 1 case without a prediction, 1 case failed |"
    )


def test_only_out_of_memory_cases():
    from memplan.schema import GIB, Report

    oom = _case("b8", None, 90, status="oom", oom_above_bytes=78 * GIB, error="out of memory")
    text = render_markdown(Report(measurements=[oom]))
    assert _summary_row(text) == (
        "| none | 0 | — | — | — | — | — | — | 1 | — | not known: no case with a measured peak |"
    )
    assert "No case has both a prediction and a measured peak." in text


def test_accuracy_plot_shows_predictions_far_from_the_measurement(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from memplan.verify.plots import plot_accuracy

    limits = {}
    savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        limits["x"], limits["y"] = fig.axes[0].get_xlim(), fig.axes[0].get_ylim()
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    plot_accuracy([_case("a", 10, 20), _case("b", 12, 12.1)], tmp_path / "acc.png")
    for lo, hi in limits.values():
        assert lo <= 10 and hi >= 20  # the case predicted 20 GiB, measured 10, is on the panel
