"""Figures of `memplan report --plot`: predicted against measured peaks with the +-2% band, and the
memory timeline of one step, predicted (the estimator's walk) against measured (the allocator's
history). matplotlib is imported here only, with the Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.schema import GIB, Measurement, MemoryEvent, TimelinePoint
from memplan.verify.report import kernel_group

BAND_PCT = 2.0
_COARSE_PHASES = ("forward", "backward", "optimizer", "zero_grad")


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


def plot_accuracy(measurements: Sequence[Measurement], path: Path) -> Path | None:
    """Left: predicted against measured steady peak (log-log, y = x and the +-2% band). Right:
    the error in % against the measured peak. None when no case has both figures."""
    cases = [m for m in measurements if m.status == "ok" and m.error_pct is not None]
    if not cases:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    styles = {"none": ("o", "tab:blue"), "memplan kernels": ("^", "tab:orange")}
    for group, (marker, color) in styles.items():
        ms = [m for m in cases if kernel_group(m) == group]
        if not ms:
            continue
        measured = [m.peak_bytes / GIB for m in ms]
        predicted = [m.predicted.peak_bytes / GIB for m in ms]
        errors = [m.error_pct for m in ms]
        label = f"kernels {group} ({len(ms)})" if group == "none" else f"{group} ({len(ms)})"
        left.scatter(measured, predicted, marker=marker, color=color, label=label, zorder=3)
        right.scatter(measured, errors, marker=marker, color=color, label=label, zorder=3)
    # both axes span measured and predicted, so a prediction far off stays on the panel
    values = [v / GIB for m in cases for v in (m.peak_bytes, m.predicted.peak_bytes)]
    lo, hi = min(values) * 0.8, max(values) * 1.2
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    band = BAND_PCT / 100
    left.plot(xs, xs, color="black", linewidth=1, label="predicted = measured")
    left.fill_between(
        xs,
        [x * (1 - band) for x in xs],
        [x * (1 + band) for x in xs],
        color="gray",
        alpha=0.25,
        label=f"±{BAND_PCT:g}%",
    )
    left.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    left.set(xlabel="measured peak (GiB)", ylabel="predicted peak (GiB)")
    left.set_title("steady-state peak: predicted against measured")
    left.legend(loc="upper left")
    right.axhspan(-BAND_PCT, BAND_PCT, color="gray", alpha=0.25, label=f"±{BAND_PCT:g}%")
    right.axhline(0, color="black", linewidth=1)
    right.set_xscale("log")
    right.set(xlabel="measured peak (GiB)", ylabel="(predicted - measured) / measured (%)")
    right.set_title("error of the prediction")
    right.legend(loc="best")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain)
    left.yaxis.set_major_formatter(plain)
    left.yaxis.set_minor_formatter(plain)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _coarse(phase: str) -> str:
    """forward / backward / optimizer / zero_grad of a phase name, ours or the estimator's."""
    name = phase.lower()
    if "zero" in name:
        return "zero_grad"
    if "optim" in name or name.startswith("step") or "adam" in name:
        return "optimizer"
    if "backward" in name or "bwd" in name:
        return "backward"
    return "forward"


def _phase_positions(
    phases: Sequence[str], widths: dict[str, float], starts: dict[str, float]
) -> list[float]:
    """x of each event: phase k's events spread evenly over [starts[k], starts[k] + widths[k])."""
    counts: dict[str, int] = {}
    for p in phases:
        counts[p] = counts.get(p, 0) + 1
    seen: dict[str, int] = {}
    xs = []
    for p in phases:
        i = seen.get(p, 0)
        seen[p] = i + 1
        xs.append(starts[p] + widths[p] * i / counts[p])
    return xs


def choose_timeline_case(
    measurements: Sequence[Measurement], case: str | None = None
) -> Measurement | None:
    candidates = [m for m in measurements if m.timeline_measured]
    if case is not None:
        candidates = [m for m in candidates if m.case == case]
    with_prediction = [m for m in candidates if m.predicted and m.predicted.timeline]
    return (with_prediction or candidates or [None])[0]


def plot_timeline(m: Measurement, path: Path) -> Path:
    """Allocated GiB through one steady-state step. Both series are laid over the same phase
    axis: each of forward, backward, optimizer step, zero_grad gets the width of its share of
    the measured allocator events, and each series' events are spread evenly within it."""
    plt = _pyplot()
    measured: list[MemoryEvent] = m.timeline_measured or []
    predicted: list[TimelinePoint] = m.predicted.timeline if m.predicted else []
    m_phases = [_coarse(e.phase) for e in measured]
    p_phases = [_coarse(p.phase) for p in predicted]
    present = [p for p in _COARSE_PHASES if p in m_phases or p in p_phases]
    total = max(len(m_phases), 1)
    widths = {p: max(m_phases.count(p) / total, 0.05) for p in present}
    starts: dict[str, float] = {}
    x = 0.0
    for p in present:
        starts[p] = x
        x += widths[p]
    m_xs = _phase_positions(m_phases, widths, starts)
    p_xs = _phase_positions(p_phases, widths, starts)
    aligned = all(a <= b for xs in (m_xs, p_xs) for a, b in zip(xs, xs[1:]))
    if not aligned:  # phases repeat (gradient accumulation): each series over its own events
        present, x = [], 1.0
        m_xs = [i / len(measured) for i in range(len(measured))]
        p_xs = [i / len(predicted) for i in range(len(predicted))]
    fig, ax = plt.subplots(figsize=(11, 5))
    if measured:
        ax.step(
            m_xs,
            [e.allocated_bytes / GIB for e in measured],
            where="post",
            color="tab:blue",
            linewidth=1,
            label="measured (allocator history)",
        )
    if predicted:
        ax.step(
            p_xs,
            [p.allocated_bytes / GIB for p in predicted],
            where="post",
            color="tab:orange",
            linewidth=1.5,
            label="predicted (estimator)",
        )
    if m.peak_bytes:
        ax.axhline(
            m.peak_bytes / GIB,
            color="tab:blue",
            linestyle="--",
            linewidth=0.8,
            label=f"measured peak {m.peak_bytes / GIB:.2f} GiB",
        )
    if m.predicted:
        ax.axhline(
            m.predicted.peak_bytes / GIB,
            color="tab:orange",
            linestyle="--",
            linewidth=0.8,
            label=f"predicted peak {m.predicted.peak_bytes / GIB:.2f} GiB",
        )
    for p in present:
        ax.axvline(starts[p], color="gray", linewidth=0.5)
        ax.text(
            starts[p] + 0.005,
            0.02,
            p.replace("_", " "),
            transform=ax.get_xaxis_transform(),
            fontsize=8,
            color="gray",
        )
    xlabel = "position in the step" + (" (phases aligned)" if aligned else "")
    ax.set(xlim=(0, x), xlabel=xlabel, ylabel="allocated (GiB)")
    ax.set_title(f"one training step: {m.case}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_figures(
    measurements: Sequence[Measurement], out_markdown: Path, *, timeline_case: str | None = None
) -> dict[str, str]:
    """PNG files next to the markdown file; caption -> file name relative to it."""
    stem = out_markdown.with_suffix("")
    figures: dict[str, str] = {}
    scatter = plot_accuracy(measurements, Path(f"{stem}_accuracy.png"))
    if scatter is not None:
        figures["predicted against measured peak, ±2% band"] = scatter.name
    chosen = choose_timeline_case(measurements, timeline_case)
    if timeline_case is not None and chosen is None:
        raise MemplanError(f"no case named {timeline_case!r} has a measured memory timeline")
    if chosen is not None:
        timeline = plot_timeline(chosen, Path(f"{stem}_timeline.png"))
        figures[f"memory timeline of one step, {chosen.case}"] = timeline.name
    return figures
