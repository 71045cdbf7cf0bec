"""The figures of `memplan report --plot`, read back from matplotlib's objects: the timeline on
the measured allocator's event axis with the predicted points aligned to it, the optimizer step
enlarged, both peaks and the reserved memory visible; the accuracy figure grouped by family and
precision, banded at the stated goal, its outliers named."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.schema import GIB, MemoryEstimate, MemoryEvent, TimelinePoint, TrainSetup
from memplan.verify.report import GOAL_MAX_PCT, GOAL_MEDIAN_PCT, load_reports

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

from memplan.verify.plots import align, plot_accuracy, plot_timeline, timeline_positions  # noqa: E402

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture
def saved(monkeypatch):
    """The figure each plot function saves."""
    figures: list[Figure] = []
    savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def test_align_recovers_the_events_a_coarse_series_was_taken_from() -> None:
    measured = [0, 5, 3, 8, 9, 4, 2, 7, 1]
    phases = ["f", "f", "f", "f", "b", "b", "b", "o", "o"]
    picked = [1, 3, 4, 6, 7]
    at = align([measured[i] for i in picked], [phases[i] for i in picked], measured, phases)
    assert at == picked


def test_align_keeps_order_and_phase() -> None:
    measured = [1, 2, 3, 4, 5, 6]
    phases = ["f", "f", "f", "b", "b", "b"]
    # a forward point matching a backward value stays in the forward; order is kept
    at = align([6, 1, 6], ["f", "b", "b"], measured, phases)
    assert at == sorted(at) and phases[at[0]] == "f" and all(phases[i] == "b" for i in at[1:])


def _reference_case():
    report = load_reports([DATA / "measurements_h200.json"])
    return next(m for m in report.measurements if m.case == "qwen3-0.6b_b4_s1024_bf16_hf")


def test_the_predicted_peak_is_drawn_at_the_measured_peak_event() -> None:
    """Spread evenly over its phase, the predicted loss-backward peak sat about 80 events to the
    right of the measured one, where the measured line is 3-6 GiB lower."""
    m = _reference_case()
    xs = timeline_positions(m.timeline_measured, m.predicted.timeline)
    indices = {e.index for e in m.timeline_measured}
    assert set(xs) <= indices and xs == sorted(xs)
    top = max(range(len(xs)), key=lambda i: m.predicted.timeline[i].allocated_bytes)
    measured_top = max(m.timeline_measured, key=lambda e: e.allocated_bytes)
    assert xs[top] == measured_top.index
    # drawn where the measured bytes are closest: the mean gap is a fraction of the even
    # spreading's (each phase's points spaced evenly over its measured events)
    by_index = {e.index: e.allocated_bytes for e in m.timeline_measured}
    aligned = _mean_gap(xs, m.predicted.timeline, by_index)
    even = _mean_gap(_spread_evenly(m), m.predicted.timeline, by_index)
    print(f"mean gap: aligned {aligned / GIB:.3f} GiB, spread evenly {even / GIB:.3f} GiB")
    assert aligned < 0.5 * even


def _mean_gap(xs, points, by_index) -> float:
    return sum(abs(by_index[x] - p.allocated_bytes) for x, p in zip(xs, points)) / len(xs)


def _spread_evenly(m) -> list[int]:
    """The measured event index each predicted point had under the former layout."""
    from memplan.verify.plots import _coarse

    xs = []
    for point in m.predicted.timeline:
        phase = _coarse(point.phase) if point.phase != "start" else "forward"
        events = [e.index for e in m.timeline_measured if _coarse(e.phase) == phase]
        mine = [
            p
            for p in m.predicted.timeline
            if (_coarse(p.phase) if p.phase != "start" else "forward") == phase
        ]
        k = next(i for i, p in enumerate(mine) if p is point)
        xs.append(events[k * len(events) // len(mine)])
    return xs


def test_timeline_axes_units_peaks_reserved_and_the_optimizer_step(tmp_path, saved) -> None:
    m = _reference_case()
    plot_timeline(m, tmp_path / "t.png")
    (fig,) = saved
    main, zoom = fig.axes
    assert main.get_xlabel().startswith("allocator event of the measured step")
    labels = [line.get_label() for line in main.get_lines()]
    measured_peak = next(
        line for line in main.get_lines() if line.get_label().startswith("measured peak")
    )
    predicted_peak = next(
        line for line in main.get_lines() if line.get_label().startswith("predicted peak")
    )
    # the measured peak is a wide band under the thin dashed predicted one: both show
    assert measured_peak.get_linewidth() >= 3 * predicted_peak.get_linewidth()
    assert predicted_peak.get_linestyle() == "--"
    assert any(label.startswith("measured reserved") for label in labels)
    optimizer = [e.index for e in m.timeline_measured if e.phase in ("optimizer", "zero_grad")]
    low, high = zoom.get_xlim()
    assert low <= optimizer[0] and high >= optimizer[-1] and high - low < 0.2 * optimizer[-1]


def test_timeline_of_accumulated_micro_batches(tmp_path, saved) -> None:
    """Phases repeat (forward 1, backward 1, forward 2, ...): the predicted points still go, in
    order, to events of their phase."""
    events, level = [], 0
    for phase in ("forward 1", "backward 1", "forward 2", "backward 2", "optimizer", "zero_grad"):
        for _ in range(20):
            level += 1 if phase.startswith("forward") or phase == "optimizer" else -1
            events.append(MemoryEvent(index=len(events), phase=phase, allocated_bytes=level * GIB))
    predicted = [
        TimelinePoint(phase=p, label=p, allocated_bytes=v * GIB)
        for p, v in (("forward", 10), ("forward", 20), ("backward", 5), ("optimizer", 10))
    ]
    xs = timeline_positions(events, predicted)
    phases = [events[x].phase for x in xs]
    assert xs == sorted(xs) and phases[0].startswith("forward") and phases[-1] == "optimizer"
    from memplan.schema import Measurement

    m = Measurement(
        case="acc",
        model="x",
        setup=TrainSetup(batch=1, seq=8, grad_accum=2),
        peak_bytes=20 * GIB,
        timeline_measured=events,
        predicted=MemoryEstimate(
            peak_bytes=20 * GIB,
            peak_step1_bytes=20 * GIB,
            peak_phase="forward",
            peak_label="forward",
            breakdown={},
            params=1,
            trainable_params=1,
            timeline=predicted,
        ),
    )
    plot_timeline(m, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").stat().st_size > 10_000


def test_accuracy_figure_groups_bands_and_names_outliers(tmp_path, saved) -> None:
    report = load_reports([DATA / "measurements_h200.json"])
    plot_accuracy(report.measurements, tmp_path / "a.png")
    (fig,) = saved
    scatter, errors, reserved = fig.axes
    families = {m.model_type for m in report.measurements}
    ticks = [t.get_text().split("\n")[0] for t in errors.get_xticklabels()]
    assert set(ticks) == families and ticks == sorted(ticks)
    # the band is the goal for every case, the dashed lines the goal for the median
    (band,) = [p for p in errors.patches if p.get_label().startswith("goal for every case")]
    assert (band.get_y(), band.get_y() + band.get_height()) == (-GOAL_MAX_PCT, GOAL_MAX_PCT)
    dashed = {line.get_ydata()[0] for line in errors.get_lines() if line.get_linestyle() == "--"}
    assert dashed == {-GOAL_MEDIAN_PCT, GOAL_MEDIAN_PCT}
    # every case is within the goal: the three worst are named
    worst = sorted(
        (m for m in report.measurements if m.error_pct is not None),
        key=lambda m: -abs(m.error_pct),
    )[:3]
    named = [t.get_text() for t in errors.texts]
    assert all(any(text.startswith(m.case) for text in named) for m in worst)
    # precision by marker: one legend entry per precision present
    legend = [t.get_text() for t in errors.get_legend().get_texts()]
    assert {"bf16", "amp-bf16", "amp-fp16", "fp32"} <= set(legend)
    # log axes labelled at 1, 2, 5 x 10^k only: no crowded minor labels
    assert all(label.get_text() == "" for label in scatter.get_xminorticklabels())
    assert reserved.get_ylabel() == "(reserved - allocated) / allocated (%)"
    assert len(reserved.collections) == sum(1 for m in report.measurements if m.reserved_bytes)


def test_a_case_outside_the_goal_is_named(tmp_path, saved) -> None:
    from .test_verify_report import _case

    cases = [_case(f"c{i}", 10, 10.01) for i in range(5)] + [_case("far", 10, 11)]
    plot_accuracy(cases, tmp_path / "a.png")
    errors = saved[0].axes[1]
    assert [t.get_text() for t in errors.texts] == ["far (+10.00%)"]
