"""`memplan report`: measurements (one or many result files) -> a markdown report with the
predicted and measured peak of every case, and the median and worst error per kernel group."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from memplan.errors import MemplanError
from memplan.schema import GIB, Measurement, Report

# The estimator's goal (issues 2 and 6): median |error| <= 1.5%, every case <= 4%.
GOAL_MEDIAN_PCT = 1.5
GOAL_MAX_PCT = 4.0


def kernel_group(m: Measurement) -> str:
    if m.liger:
        return "liger"
    return "memplan kernels" if m.setup.kernels else "none"


@dataclass(frozen=True)
class ErrorStats:
    """The goal check of a group of cases. The error figures cover the cases with a measured peak
    and a prediction (None where there is none). An out-of-memory case with a prediction is
    judged against the bytes it ran out above, a lower bound of its peak; a failed case or one
    without a prediction cannot be judged, and the goal is then not known to be met."""

    cases: int
    median_abs_pct: float | None
    max_abs_pct: float | None
    mean_pct: float | None
    worst_case: str | None
    oom_cases: int = 0
    oom_under: tuple[str, ...] = ()  # predicted more than GOAL_MAX_PCT below their bound
    not_judged: tuple[tuple[str, int], ...] = ()  # (why, how many cases)

    @property
    def meets_goal(self) -> bool:
        return self.verdict == "yes"

    @property
    def verdict(self) -> str:
        """'yes', 'no', or 'no: ' with the reason the table's error columns do not show."""
        reasons = [f"{_cases(n)} {why}" for why, n in self.not_judged]
        if self.oom_under:
            reasons.insert(
                0, f"{_cases(len(self.oom_under))} predicted below the out-of-memory bound"
            )
        if reasons:
            return "no: " + ", ".join(reasons)
        if self.median_abs_pct is None or self.max_abs_pct is None:
            return "not known: no case with a measured peak"
        if self.median_abs_pct <= GOAL_MEDIAN_PCT and self.max_abs_pct <= GOAL_MAX_PCT:
            return "yes"
        return "no"


def _cases(n: int) -> str:
    return f"{n} case" if n == 1 else f"{n} cases"


def oom_bound_pct(m: Measurement) -> float | None:
    """(predicted - above) / above of an out-of-memory case, in %: the measured peak is at least
    `above`, so a value under -GOAL_MAX_PCT is an under-prediction beyond the goal."""
    if m.status != "oom" or m.predicted is None or not m.oom_above_bytes:
        return None
    return 100.0 * (m.predicted.peak_bytes - m.oom_above_bytes) / m.oom_above_bytes


def _why_not_judged(m: Measurement, step1: bool) -> str | None:
    if m.status == "error":
        return "failed"
    if m.predicted is None:
        return "without a prediction"
    if m.status == "oom":
        return None if step1 or oom_bound_pct(m) is not None else "without a measured bound"
    if (m.step1_error_pct if step1 else m.error_pct) is None:
        return "without a measured peak"
    return None


def goal_check(measurements: Iterable[Measurement], *, step1: bool = False) -> ErrorStats:
    """The statistics of (predicted - measured) / measured over the cases that have both, the
    out-of-memory cases judged against their bound (steady peak only: the bound is the peak of
    whichever step ran out), and the count of cases that could not be judged."""
    pairs: list[tuple[str, float]] = []
    oom: list[tuple[str, float]] = []
    not_judged: dict[str, int] = {}
    for m in measurements:
        why = _why_not_judged(m, step1)
        bound = oom_bound_pct(m)
        error = m.step1_error_pct if step1 else m.error_pct
        if why is not None:
            not_judged[why] = not_judged.get(why, 0) + 1
        elif bound is not None:
            if not step1:
                oom.append((m.case, bound))
        elif error is not None:
            pairs.append((m.case, error))
    errors = [err for _, err in pairs]
    worst = max(pairs, key=lambda p: abs(p[1])) if pairs else None
    return ErrorStats(
        cases=len(errors),
        median_abs_pct=statistics.median(abs(e) for e in errors) if errors else None,
        max_abs_pct=abs(worst[1]) if worst else None,
        mean_pct=statistics.fmean(errors) if errors else None,
        worst_case=worst[0] if worst else None,
        oom_cases=len(oom),
        oom_under=tuple(case for case, err in oom if err < -GOAL_MAX_PCT),
        not_judged=tuple(not_judged.items()),
    )


def error_stats(measurements: Iterable[Measurement], *, step1: bool = False) -> ErrorStats | None:
    """goal_check, or None when no case has both a prediction and a measured peak."""
    stats = goal_check(measurements, step1=step1)
    return stats if stats.cases else None


def load_reports(paths: Sequence[str | Path]) -> Report:
    """One Report holding the measurements of every file, in order. A file that cannot be read,
    is not UTF-8 JSON, is not a results file or holds a negative size is one MemplanError."""
    if not paths:
        raise MemplanError("give at least one results file (written by memplan verify --out)")
    measurements: list[Measurement] = []
    labels: list[str] = []
    for path in paths:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise MemplanError(
                f"{path} is not a memplan results file (not UTF-8 text: byte {exc.start})"
            ) from None
        except OSError as exc:
            raise MemplanError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            report = Report.model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise MemplanError(
                f"{path} is not a memplan results file "
                f"({f'{where}: ' if where else ''}{first['msg']})"
            ) from None
        if not report.measurements:  # {} or another JSON object validates to an empty Report
            raise MemplanError(f"{path} is not a memplan results file (no measurements)")
        for i, m in enumerate(report.measurements):
            _check_sizes(path, i, m)
        measurements.extend(report.measurements)
        if report.label and report.label not in labels:
            labels.append(report.label)
    return Report(label=" / ".join(labels) or None, measurements=measurements)


_MEASURED_SIZES = (
    "after_model_bytes",
    "peak_step1_bytes",
    "peak_bytes",
    "reserved_bytes",
    "end_allocated_bytes",
    "oom_above_bytes",
)
_PREDICTED_SIZES = ("peak_bytes", "peak_step1_bytes")


def _check_sizes(path: Path, index: int, m: Measurement) -> None:
    """Bytes are never negative: a negative one is a damaged or hand-edited file, whose error
    percentages would be meaningless (-387712911460%)."""
    sizes = [(f"measurements.{index}.{f}", getattr(m, f)) for f in _MEASURED_SIZES]
    if m.predicted is not None:
        sizes += [
            (f"measurements.{index}.predicted.{f}", getattr(m.predicted, f))
            for f in _PREDICTED_SIZES
        ]
    for where, value in sizes:
        if value is not None and value < 0:
            raise MemplanError(
                f"{path} is not a valid memplan results file ({where} is {value:,} bytes; "
                "a memory size cannot be negative)"
            )


def gib(value: int | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def _environments(measurements: Sequence[Measurement]) -> list[str]:
    seen: dict[str, None] = {}
    for m in measurements:
        if m.env:
            env = m.env
            seen[
                f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
                f"transformers {env.get('transformers', '?')}, triton {env.get('triton', '?')}"
            ] = None
    return list(seen)


def _summary(measurements: Sequence[Measurement]) -> list[str]:
    groups: dict[str, list[Measurement]] = {}
    for m in measurements:
        if not m.liger:  # the estimator does not model Liger's kernels
            groups.setdefault(kernel_group(m), []).append(m)
    if not groups:
        return ["No case has both a prediction and a measured peak."]
    lines = [
        "| kernels | cases | median \\|error\\| | max \\|error\\| | mean error | worst case "
        "| step 1: median \\|error\\| | step 1: max \\|error\\| | out of memory | not judged "
        "| meets goal |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|",
    ]
    rows = [(name, groups[name]) for name in ("none", "memplan kernels") if name in groups]
    if len(rows) > 1:
        rows.append(("all", [m for _, ms in rows for m in ms]))
    for name, ms in rows:
        steady, first = goal_check(ms), goal_check(ms, step1=True)
        oom = str(steady.oom_cases or "—")
        if steady.oom_under:
            oom += f", {len(steady.oom_under)} under its bound"
        not_judged = ", ".join(f"{n} {why}" for why, n in steady.not_judged) or "—"
        lines.append(
            f"| {name} | {steady.cases} | {_abs_pct(steady.median_abs_pct)} "
            f"| {_abs_pct(steady.max_abs_pct)} | {pct(steady.mean_pct)} "
            f"| {steady.worst_case or '—'} | {_abs_pct(first.median_abs_pct)} "
            f"| {_abs_pct(first.max_abs_pct)} | {oom} | {not_judged} | {steady.verdict} |"
        )
    lines.append("")
    if not any(goal_check(ms).cases for _, ms in rows):
        lines += ["No case has both a prediction and a measured peak.", ""]
    lines.append(
        f"error = (predicted - measured) / measured of the steady peak; goal: median "
        f"<= {GOAL_MEDIAN_PCT}%, every case <= {GOAL_MAX_PCT}%. An out-of-memory case is judged "
        f"against the bytes it ran out above, a lower bound of its peak: it fails when predicted "
        f"more than {GOAL_MAX_PCT}% below it."
    )
    return lines


def _abs_pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}%"


def _verdicts(measurements: Sequence[Measurement]) -> list[str]:
    """The fit verdict and the reserved peak, predicted by the allocator model, against what
    happened."""
    judged = [m for m in measurements if m.verdict_right is not None]
    errors = sorted(abs(e) for m in measurements if (e := m.reserved_error_pct) is not None)
    if not judged:
        return []
    wrong = [m.case for m in judged if not m.verdict_right]
    lines = [
        "| cases with a verdict | right | ran | ran out of memory | reserved: cases | median "
        "\\|error\\| | max \\|error\\| |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(judged)} | {len(judged) - len(wrong)} "
        f"| {sum(m.status == 'ok' for m in judged)} | {sum(m.status == 'oom' for m in judged)} "
        f"| {len(errors)} | {_abs_pct(statistics.median(errors) if errors else None)} "
        f"| {_abs_pct(errors[-1] if errors else None)} |",
        "",
    ]
    if wrong:
        lines += [f"Verdict wrong: {', '.join(wrong)}.", ""]
    return lines


def _cases_table(measurements: Sequence[Measurement]) -> list[str]:
    lines = [
        "| case | kernels | predicted peak GiB | measured peak GiB | error "
        "| predicted step 1 GiB | measured step 1 GiB | error step 1 | predicted reserved GiB "
        "| reserved GiB | error reserved | verdict | predicted peak phase | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for m in measurements:
        p = m.predicted
        kernels = "liger" if m.liger else ("+".join(m.setup.kernels) or "none")
        if m.status == "oom":
            measured = f"out of memory above {gib(m.oom_above_bytes)}"
        elif m.status == "error":
            measured = "error"
        else:
            measured = gib(m.peak_bytes)
        phase = f"{p.peak_phase}: {p.peak_label}" if p and p.peak_label else (p and p.peak_phase)
        lines.append(
            f"| {m.case} | {kernels} | {gib(p.peak_bytes if p else None)} | {measured} "
            f"| {pct(m.error_pct)} | {gib(p.peak_step1_bytes if p else None)} "
            f"| {gib(m.peak_step1_bytes)} | {pct(m.step1_error_pct)} "
            f"| {_predicted_reserved(m)} | {gib(m.reserved_bytes)} "
            f"| {pct(m.reserved_error_pct)} | {_verdict(m)} | {phase or '—'} "
            f"| {f'{m.tokens_per_s:,.0f}' if m.tokens_per_s else '—'} |"
        )
    return lines


def _predicted_reserved(m: Measurement) -> str:
    reserved = m.predicted.reserved if m.predicted else None
    if reserved is None:
        return "—"
    return gib(reserved.reserved_bytes) if reserved.runs else "out of memory"


def _verdict(m: Measurement) -> str:
    return {True: "right", False: "wrong", None: "—"}[m.verdict_right]


def _failures(measurements: Sequence[Measurement]) -> list[str]:
    lines: list[str] = []
    for m in measurements:
        predicted = f"predicted {gib(m.predicted.peak_bytes)} GiB; " if m.predicted else ""
        if m.status == "oom":
            bound = oom_bound_pct(m)
            lines.append(
                f"- {m.case}: {predicted}measured: out of memory above "
                f"{gib(m.oom_above_bytes)} GiB ({m.error})"
                + ("" if bound is None else f"; predicted {pct(bound)} against that bound")
            )
        elif m.status == "error":
            lines.append(f"- {m.case}: {m.error_kind or 'error'}: {m.error}")
        elif m.prediction_error:
            lines.append(f"- {m.case}: no prediction: {m.prediction_error}")
        lines += [f"- {m.case}: warning: {w}" for w in measurement_warnings(m)]
    return lines


def measurement_warnings(m: Measurement) -> list[str]:
    """What the child noticed without failing the case (env["warnings"], one per line)."""
    return [w for w in m.env.get("warnings", "").splitlines() if w]


def _profiles(measurements: Sequence[Measurement], top: int = 10) -> list[str]:
    lines: list[str] = []
    for m in measurements:
        if not m.profile:
            continue
        lines += [f"### {m.case}", ""]
        for key, table in m.profile.items():
            lines += [
                f"{key.replace('_', ' ')}: {table.total_device_ms:.2f} ms of GPU time per step",
                "",
                "| operator | ms / step | calls / step | share |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| `{op.name}` | {op.device_ms:.3f} | {op.calls:g} | {100 * op.share:.1f}% |"
                for op in table.ops[:top]
            ]
            lines.append("")
    if not lines and any(m.profile_error for m in measurements):
        lines = [f"- {m.case}: {m.profile_error}" for m in measurements if m.profile_error]
    return lines


def render_markdown(
    report: Report,
    *,
    sources: Sequence[str] = (),
    figures: Mapping[str, str] | None = None,
    title: str = "memplan: predicted against measured peak memory",
) -> str:
    ms = report.measurements
    out = [f"# {title}", ""]
    if report.label:
        out += [f"> **{report.label}**", ""]
    if sources:
        out += [f"Results: {', '.join(f'`{s}`' for s in sources)}.", ""]
    envs = _environments(ms)
    if envs:
        out += ["Measured on: " + "; ".join(envs) + ".", ""]
    out += [
        "Measured: `torch.cuda.max_memory_allocated()` over the first N steps of a fresh process "
        "(shared/reference/measurement_protocol.md); step 1 is the peak before optimizer states "
        "exist. Predicted: memplan's estimator for the same config and setup.",
        "",
        "## Summary",
        "",
        *_summary(ms),
        "",
        *(
            [
                "## Fit verdict and reserved memory",
                "",
                "Predicted by replaying the step through memplan's model of PyTorch's caching "
                "allocator with the capacity of the GPU measured; measured: "
                "`torch.cuda.max_memory_reserved()`, and whether the case ran or ran out of "
                "memory. Reserved goal: median <= 1.5%, every case <= 4%.",
                "",
                *verdicts,
            ]
            if (verdicts := _verdicts(ms))
            else []
        ),
        "## Cases",
        "",
        *_cases_table(ms),
        "",
    ]
    failures = _failures(ms)
    if failures:
        out += ["## Out of memory, errors, warnings and missing predictions", "", *failures, ""]
    profiles = _profiles(ms)
    if profiles:
        out += ["## Profile: top GPU operators by self time", "", *profiles]
    if figures:
        out += ["## Figures", ""]
        out += [f"![{caption}]({path})" for caption, path in figures.items()]
        out.append("")
    return "\n".join(out)
