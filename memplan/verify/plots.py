"""Figures of `memplan report --plot`. matplotlib (Agg backend, no display) and numpy are imported
here only.

Accuracy: the error of every case against the estimator's goal (report.GOAL_MAX_PCT for every
case, GOAL_MEDIAN_PCT for the median; docs/accuracy.md), grouped by model family, marked by
precision and coloured by kernels, the cases outside the goal (else the worst three) labelled;
predicted against measured peak; and the memory the caching allocator reserved beyond the
allocated peak, which the estimate does not include.

Timeline: allocated bytes through one steady-state step on the measured trace's axis, the
index of each allocator event (alloc or free). The estimator's points are fewer and coarser
(one per layer), so each is drawn at the measured event it corresponds to: a monotone
alignment (dynamic programming) that keeps both series in order and each point in its phase,
and matches allocated bytes. The optimizer step, a few dozen events, is shown enlarged."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.schema import GIB, Measurement, MemoryEvent, TimelinePoint
from memplan.verify.report import GOAL_MAX_PCT, GOAL_MEDIAN_PCT, kernel_group

_COARSE_PHASES = ("forward", "backward", "optimizer", "zero_grad")
_KERNEL_COLORS = {"none": "tab:blue", "memplan kernels": "tab:orange"}
_PRECISION_MARKERS = {"bf16": "o", "amp-bf16": "s", "amp-fp16": "D", "fp32": "^"}
_LABELLED = 3  # the worst cases labelled when every case meets the goal


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MemplanError(
            "--plot needs matplotlib: pip install 'memplan[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def family(m: Measurement) -> str:
    """The model family (model_type) of a measurement."""
    return m.model_type or str(m.hf_config.get("model_type") or m.model)


def _log_axis(ax: Any, axis: str) -> None:
    """A log axis labelled at 1, 2, 5 x 10^k only, in plain numbers (no crowded minor labels)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    target.set_minor_formatter(NullFormatter())


# ---------------------------------------------------------------------------------- accuracy


def plot_accuracy(measurements: Sequence[Measurement], path: Path) -> Path | None:
    """Three panels (see the module's docstring). None when no case has a measured peak and a
    prediction."""
    cases = [m for m in measurements if m.status == "ok" and m.error_pct is not None]
    if not cases:
        return None
    plt = _pyplot()
    fig = plt.figure(figsize=(14, 10))
    grid = fig.add_gridspec(2, 2, height_ratios=(1.1, 1))
    # created first: fig.axes[0] is the predicted-against-measured panel
    scatter = fig.add_subplot(grid[1, 0])
    errors = fig.add_subplot(grid[0, :])
    reserved = fig.add_subplot(grid[1, 1])
    _errors_by_family(errors, cases)
    _predicted_against_measured(scatter, cases)
    _reserved_beyond_allocated(reserved, cases)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _style(m: Measurement) -> dict[str, Any]:
    return {
        "marker": _PRECISION_MARKERS.get(m.setup.precision, "x"),
        "color": _KERNEL_COLORS.get(kernel_group(m), "tab:gray"),
    }


def _errors_by_family(ax: Any, cases: Sequence[Measurement]) -> None:
    families = sorted({family(m) for m in cases})
    precisions = [p for p in _PRECISION_MARKERS if any(m.setup.precision == p for m in cases)]
    slot = 0.8 / max(len(precisions), 1)
    points: list[tuple[float, float, Measurement]] = []
    for i, name in enumerate(families):
        ms = [m for m in cases if family(m) == name]
        for j, precision in enumerate(precisions):
            group = sorted((m for m in ms if m.setup.precision == precision), key=_peak)
            for k, m in enumerate(group):
                # each precision in its own slot; cases spread across it by measured peak
                x = i - 0.4 + slot * (j + (k + 0.5) / len(group))
                points.append((x, m.error_pct, m))
        median = statistics.median(m.error_pct for m in ms)
        ax.hlines(median, i - 0.4, i + 0.4, color="black", linewidth=1.5, zorder=4)
    for x, y, m in points:
        ax.scatter(x, y, s=28, zorder=3, edgecolors="none", **_style(m))
    ax.axhspan(
        -GOAL_MAX_PCT,
        GOAL_MAX_PCT,
        color="tab:green",
        alpha=0.08,
        label=f"goal for every case: |error| <= {GOAL_MAX_PCT:g}%",
    )
    for sign in (-1, 1):
        ax.axhline(
            sign * GOAL_MEDIAN_PCT,
            color="tab:green",
            linestyle="--",
            linewidth=0.8,
            label=f"goal for the median: |error| <= {GOAL_MEDIAN_PCT:g}%" if sign > 0 else None,
        )
    ax.axhline(0, color="black", linewidth=0.6)
    for i in range(1, len(families)):
        ax.axvline(i - 0.5, color="gray", linewidth=0.4)
    _label_outliers(ax, points)
    values = [y for _, y, _ in points]
    span = max(GOAL_MAX_PCT * 1.25, *(abs(v) * 1.15 for v in values))
    ax.set_ylim(-span, span)
    ax.set_xlim(-0.5, len(families) - 0.5)
    ax.set_xticks(range(len(families)))
    ax.set_xticklabels(
        [f"{name}\n({sum(family(m) == name for m in cases)})" for name in families], fontsize=8
    )
    ax.set_ylabel("(predicted - measured) / measured (%)")
    ax.set_title(
        "error of the predicted steady-state peak, by model family (cases); black bar: the "
        "family's median"
    )
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles += _legend_markers(cases)
    labels += [h.get_label() for h in _legend_markers(cases)]
    ax.legend(handles, labels, loc="upper right", fontsize=7, ncol=2)


def _legend_markers(cases: Sequence[Measurement]) -> list[Any]:
    from matplotlib.lines import Line2D

    markers = [
        Line2D([], [], linestyle="", marker="o", color=color, label=f"kernels: {group}")
        for group, color in _KERNEL_COLORS.items()
        if any(kernel_group(m) == group for m in cases)
    ]
    markers += [
        Line2D([], [], linestyle="", marker=marker, color="gray", label=precision)
        for precision, marker in _PRECISION_MARKERS.items()
        if any(m.setup.precision == precision for m in cases)
    ]
    return markers


def _label_outliers(ax: Any, points: Sequence[tuple[float, float, Measurement]]) -> None:
    """The cases outside the goal, else the worst few, named in a column below (or above) the
    zero line, one line apart, aligned to stay inside the panel."""
    outside = [p for p in points if abs(p[1]) > GOAL_MAX_PCT]
    chosen = outside or sorted(points, key=lambda p: -abs(p[1]))[:_LABELLED]
    right = max(x for x, _, _ in points)
    rows = {True: 0, False: 0}  # labels placed so far below and above
    for x, y, m in sorted(chosen, key=lambda p: p[0]):
        below = y <= 0
        height = 0.3 - 0.045 * rows[below] if below else 0.7 + 0.045 * rows[below]
        rows[below] += 1
        align = "left" if x < right / 3 else ("right" if x > 2 * right / 3 else "center")
        ax.annotate(
            f"{m.case} ({y:+.2f}%)",
            (x, y),
            xytext=(x, height),
            textcoords=("data", "axes fraction"),
            ha=align,
            fontsize=7,
            arrowprops={"arrowstyle": "-", "color": "gray", "linewidth": 0.5},
        )


def _peak(m: Measurement) -> float:
    return (m.peak_bytes or 0) / GIB


def _predicted_against_measured(ax: Any, cases: Sequence[Measurement]) -> None:
    for m in cases:
        ax.scatter(_peak(m), m.predicted.peak_bytes / GIB, s=22, zorder=3, **_style(m))
    # both axes span measured and predicted, so a prediction far off stays on the panel
    values = [v / GIB for m in cases for v in (m.peak_bytes, m.predicted.peak_bytes)]
    lo, hi = min(values) * 0.8, max(values) * 1.25
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    band = GOAL_MAX_PCT / 100
    ax.plot(xs, xs, color="black", linewidth=0.8, label="predicted = measured")
    ax.fill_between(
        xs,
        [x * (1 - band) for x in xs],
        [x * (1 + band) for x in xs],
        color="tab:green",
        alpha=0.15,
        label=f"±{GOAL_MAX_PCT:g}% (the goal for every case)",
    )
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    _log_axis(ax, "x")
    _log_axis(ax, "y")
    ax.set(xlabel="measured peak allocated (GiB)", ylabel="predicted peak allocated (GiB)")
    ax.set_title("steady-state peak: predicted against measured")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def _reserved_beyond_allocated(ax: Any, cases: Sequence[Measurement]) -> None:
    shown = [m for m in cases if m.reserved_bytes and m.peak_bytes]
    for m in shown:
        extra = 100.0 * (m.reserved_bytes - m.peak_bytes) / m.peak_bytes
        ax.scatter(_peak(m), extra, s=22, zorder=3, **_style(m))
    ax.set_xscale("log")
    _log_axis(ax, "x")
    ax.set(xlabel="measured peak allocated (GiB)", ylabel="(reserved - allocated) / allocated (%)")
    ax.set_title(
        "memory the caching allocator reserved beyond the allocated peak\n"
        "(torch.cuda.max_memory_reserved; not part of the prediction)",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    if not shown:
        ax.text(0.5, 0.5, "no reserved memory recorded", ha="center", transform=ax.transAxes)


# ---------------------------------------------------------------------------------- timeline


def _coarse(phase: str) -> str:
    """forward / backward / optimizer / zero_grad of a phase name, ours or the estimator's
    ("backward 2" of the second micro-batch is backward; the loss is part of the forward)."""
    name = phase.lower()
    if "zero" in name:
        return "zero_grad"
    if "optim" in name or name.startswith("step") or "adam" in name:
        return "optimizer"
    if "backward" in name or "bwd" in name:
        return "backward"
    return "forward"


def align(
    predicted: Sequence[int],
    predicted_phases: Sequence[str],
    measured: Sequence[int],
    measured_phases: Sequence[str],
) -> list[int]:
    """For each predicted point, the position of the measured event it is drawn at: positions
    never decrease, a point goes to an event of its own phase where one exists, and among such
    alignments the total |predicted - measured| bytes is the smallest. O(len(predicted) x
    len(measured)) time; the back-pointers take 4 bytes per pair."""
    import numpy as np

    if not predicted or not measured:
        return [0] * len(predicted)
    values = np.asarray(measured, dtype=np.float64)
    phases = np.asarray(measured_phases)
    # a phase mismatch costs more than any byte difference can
    penalty = 2.0 * (max(values.max(), max(predicted)) - min(values.min(), min(predicted))) + 1.0
    positions = np.arange(len(values))
    back = np.empty((len(predicted), len(values)), dtype=np.int32)
    total = np.zeros(len(values))
    for i, (value, phase) in enumerate(zip(predicted, predicted_phases, strict=True)):
        cost = np.abs(values - value) + penalty * (phases != phase)
        if i == 0:
            total = cost
            continue
        best = np.minimum.accumulate(total)
        # the last position up to j that holds the running minimum: the predecessor of j
        back[i] = np.maximum.accumulate(np.where(total == best, positions, 0))
        total = cost + best
    chosen = [int(np.argmin(total))]
    for i in range(len(predicted) - 1, 0, -1):
        chosen.append(int(back[i][chosen[-1]]))
    return chosen[::-1]


def choose_timeline_case(
    measurements: Sequence[Measurement], case: str | None = None
) -> Measurement | None:
    candidates = [m for m in measurements if m.timeline_measured]
    if case is not None:
        candidates = [m for m in candidates if m.case == case]
    with_prediction = [m for m in candidates if m.predicted and m.predicted.timeline]
    return (with_prediction or candidates or [None])[0]


def timeline_positions(
    measured: Sequence[MemoryEvent], predicted: Sequence[TimelinePoint]
) -> list[int]:
    """The measured event index each predicted point is drawn at (align). The estimator's
    "start" point (weights and states before the step) goes to the first event."""
    m_phases = [_coarse(e.phase) for e in measured]
    body = [(i, p) for i, p in enumerate(predicted) if p.phase != "start"]
    at = align(
        [p.allocated_bytes for _, p in body],
        [_coarse(p.phase) for _, p in body],
        [e.allocated_bytes for e in measured],
        m_phases,
    )
    xs = [measured[0].index if measured else 0] * len(predicted)
    for (i, _), position in zip(body, at, strict=True):
        xs[i] = measured[position].index
    return xs


def plot_timeline(m: Measurement, path: Path) -> Path:
    """Allocated GiB through one steady-state step against the measured allocator event index,
    the optimizer step enlarged on the right."""
    plt = _pyplot()
    measured: list[MemoryEvent] = m.timeline_measured or []
    predicted: list[TimelinePoint] = m.predicted.timeline if m.predicted else []
    p_xs = timeline_positions(measured, predicted) if measured else list(range(len(predicted)))
    fig, (ax, zoom) = plt.subplots(
        1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": (4, 1)}, sharey=True
    )
    for panel in (ax, zoom):
        _draw_timeline(panel, m, measured, predicted, p_xs)
    _phase_marks(ax, measured)
    ax.set_xlabel("allocator event of the measured step (its index in the allocator's trace)")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(f"one steady-state training step: {m.case}")
    ax.legend(loc="best", fontsize=8)
    ax.text(
        0.0,
        -0.17,
        "Each predicted point is drawn at the measured event it aligns with: in order, in its "
        "own phase, matching allocated bytes (dynamic programming).",
        transform=ax.transAxes,
        fontsize=8,
        color="dimgray",
    )
    step = [e.index for e in measured if _coarse(e.phase) in ("optimizer", "zero_grad")]
    if step:
        margin = max(3, (step[-1] - step[0]) // 10)
        zoom.set_xlim(step[0] - margin, step[-1] + margin)
        zoom.set_title("optimizer step and zero_grad, enlarged", fontsize=10)
        _phase_marks(zoom, [e for e in measured if e.index >= step[0]])
    else:
        zoom.set_title("no optimizer step recorded", fontsize=10)
    zoom.set_xlabel("allocator event")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_timeline(
    ax: Any,
    m: Measurement,
    measured: Sequence[MemoryEvent],
    predicted: Sequence[TimelinePoint],
    p_xs: Sequence[int],
) -> None:
    if measured:
        ax.step(
            [e.index for e in measured],
            [e.allocated_bytes / GIB for e in measured],
            where="post",
            color="tab:blue",
            linewidth=1,
            label="measured (allocator history)",
        )
    if predicted:
        ys = [p.allocated_bytes / GIB for p in predicted]
        ax.step(p_xs, ys, where="post", color="tab:orange", linewidth=1.3, label="predicted")
        if len(predicted) <= 300:  # a point that shares its event with the next stays visible
            ax.plot(p_xs, ys, linestyle="", marker=".", markersize=5, color="tab:orange")
    if m.peak_bytes:
        peak = m.peak_bytes / GIB
        ax.axhline(
            peak, color="tab:blue", linewidth=5, alpha=0.25, label=f"measured peak {peak:.2f} GiB"
        )
        top = max(measured, key=lambda e: e.allocated_bytes, default=None)
        if top is not None:
            ax.plot(top.index, top.allocated_bytes / GIB, "o", color="tab:blue", markersize=7)
    if m.predicted and predicted:
        peak = m.predicted.peak_bytes / GIB
        ax.axhline(
            peak,
            color="tab:orange",
            linestyle="--",
            linewidth=1,
            label=f"predicted peak {peak:.2f} GiB",
        )
        i = max(range(len(predicted)), key=lambda k: predicted[k].allocated_bytes)
        ax.plot(p_xs[i], predicted[i].allocated_bytes / GIB, "^", color="tab:orange", markersize=7)
    if m.reserved_bytes:
        reserved = m.reserved_bytes / GIB
        ax.axhline(
            reserved,
            color="dimgray",
            linestyle=":",
            linewidth=1.2,
            label=f"measured reserved, most over the run {reserved:.2f} GiB",
        )
    ax.grid(True, alpha=0.3)


def _phase_marks(ax: Any, measured: Sequence[MemoryEvent]) -> None:
    """A line and a name where each measured phase starts."""
    previous = None
    for e in measured:
        if e.phase != previous:
            ax.axvline(e.index, color="gray", linewidth=0.5)
            ax.text(
                e.index,
                0.01,
                " " + e.phase.replace("_", " "),
                transform=ax.get_xaxis_transform(),
                fontsize=8,
                color="dimgray",
            )
            previous = e.phase


def write_figures(
    measurements: Sequence[Measurement], out_markdown: Path, *, timeline_case: str | None = None
) -> dict[str, str]:
    """PNG files next to the markdown file; caption -> file name relative to it. An unknown
    `timeline_case` is an error before any file is written."""
    chosen = choose_timeline_case(measurements, timeline_case)
    if timeline_case is not None and chosen is None:
        with_timeline = [m.case for m in measurements if m.timeline_measured]
        raise MemplanError(
            f"no case named {timeline_case!r} has a measured memory timeline; "
            + (f"these have one: {', '.join(with_timeline)}" if with_timeline else "none has")
        )
    stem = out_markdown.with_suffix("")
    figures: dict[str, str] = {}
    scatter = plot_accuracy(measurements, Path(f"{stem}_accuracy.png"))
    if scatter is not None:
        figures[
            f"error by family against the goal (±{GOAL_MAX_PCT:g}% per case), predicted against "
            "measured, reserved beyond allocated"
        ] = scatter.name
    if chosen is not None:
        timeline = plot_timeline(chosen, Path(f"{stem}_timeline.png"))
        figures[f"memory timeline of one step, {chosen.case}"] = timeline.name
    return figures
