"""The registry's hand-written memory contracts (memplan.estimators) against the model's own code
traced on the installed torch and transformers: the same step's peak, step-1 peak and the peak
of each phase, side by side. A transformers upgrade that changes what a family allocates shows
up here on the CPU, before any GPU measures it."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimators import estimate
from memplan.estimators.releases import as_run_by
from memplan.schema import Gpu, MemoryEstimate, ModelSpec, TimelinePoint, TrainSetup
from memplan.traced import TracedEstimate, trace_config
from memplan.versions import installed_versions

# Phases compared, as the two timelines name them.
PHASES = ("forward", "loss", "backward", "optimizer")


@dataclass(frozen=True)
class Row:
    """One figure of both estimates, in bytes."""

    what: str
    analytic: int
    traced: int

    @property
    def difference_pct(self) -> float:
        return 100.0 * (self.traced - self.analytic) / self.analytic if self.analytic else 0.0


@dataclass(frozen=True)
class Comparison:
    model: str
    setup: TrainSetup
    analytic: MemoryEstimate
    traced: TracedEstimate
    rows: tuple[Row, ...]

    @property
    def peak_difference_pct(self) -> float:
        return self.rows[0].difference_pct

    def agrees(self, tolerance_pct: float) -> bool:
        """Whether the peaks differ by at most tolerance_pct of the analytic peak."""
        return abs(self.peak_difference_pct) <= tolerance_pct


def compare(spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None) -> Comparison:
    """Both estimates of the step as the installed transformers runs it (its release's
    behaviours for the contracts; eager attention where it refuses SDPA)."""
    setup = as_run_by(spec.model_type, setup, installed_versions()["transformers"])
    analytic = estimate(spec, setup, gpu)
    traced = trace_config(spec.hf_config, setup, gpu, name=spec.name)
    est = traced.estimate
    rows = [
        Row("peak", analytic.peak_bytes, est.peak_bytes),
        Row("step 1 peak", analytic.peak_step1_bytes, est.peak_step1_bytes),
    ]
    for phase in PHASES:
        a, t = phase_peak(analytic.timeline, phase), phase_peak(est.timeline, phase)
        if a is not None and t is not None:
            rows.append(Row(f"{phase} peak", a, t))
    return Comparison(spec.name or spec.model_type, setup, analytic, traced, tuple(rows))


def phase_peak(timeline: list[TimelinePoint], phase: str) -> int | None:
    values = [p.allocated_bytes for p in timeline if p.phase == phase]
    return max(values) if values else None
