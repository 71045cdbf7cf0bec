"""From the traced allocation records to the event stream (estimators/events.py) and to the same
MemoryEstimate the analytic walk gives: peaks of step 1 and of the steady step, the phase and
label of the peak, the breakdown by category at the peak, and a timeline."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimators.events import EventLog
from memplan.estimators.timeline import round_block
from memplan.schema import MemoryEstimate, TimelinePoint
from memplan.traced.step import TracedRun


@dataclass
class TracedEstimate:
    """The estimate, and the event stream it came from: the weights' allocation, then step 1,
    then the steady step (`step_starts` gives the index of each step's first event), for the
    allocator model to replay."""

    estimate: MemoryEstimate
    events: EventLog
    step_starts: list[int]
    lora_targets: tuple[str, ...] = ()
    attention_kernels: dict[str, int] | None = None
    attention_calls: dict | None = None  # sdpa.SdpaCall -> the kernel chosen for it


def categories(run: TracedRun) -> dict[int, str]:
    """Each storage's breakdown key: its tag when its allocation said what it is (weights,
    inputs, cublas_workspace, autocast_cache, transient scratch), else gradients, optimizer
    states, logits_and_loss (made in the loss phase), activations (made in forward and alive
    after it: saved for backward), or transient."""
    out: dict[int, str] = {}
    for key, storage in run.recorder.storages.items():
        if storage.tag:
            out[key] = storage.tag
        elif key in run.gradients:
            out[key] = "gradients"
        elif key in run.optimizer_states:
            out[key] = "optimizer_states"
        elif storage.phase == "loss":
            out[key] = "logits_and_loss"
        elif key in run.saved_by_forward:
            out[key] = "activations"
        else:
            out[key] = "transient"
    return out


def event_log(run: TracedRun) -> EventLog:
    """The whole traced run as allocation events with their final categories."""
    kinds = categories(run)
    log = EventLog()
    ids: dict[int, int] = {}
    for r in run.recorder.records:
        if r.action == "alloc":
            ids[r.key] = log.alloc(r.nbytes, kinds[r.key], r.phase, r.label)
        else:
            log.free(ids.pop(r.key), r.phase, r.label)
    return log


@dataclass
class _Peak:
    allocated: int = 0
    index: int = -1
    phase: str = "start"
    label: str = ""
    breakdown: dict[str, int] | None = None


def _walk(
    log: EventLog,
    start: int,
    end: int,
    allocated: int,
    by_category: dict[str, int],
    marks: list[tuple[int, str, str]],
) -> tuple[_Peak, list[TimelinePoint], int, dict[str, int]]:
    """Allocated bytes (allocator blocks) over events [start, end): the peak with its breakdown,
    one timeline point per run of events of one phase and label (the run's maximum), and one at
    each mark (the end of forward and of backward)."""
    peak = _Peak(allocated, start - 1, "start", "weights + optimizer states", dict(by_category))
    points = [TimelinePoint(phase="start", label=peak.label, allocated_bytes=allocated)]
    run_key: tuple[str, str] | None = None
    run_max = 0
    pending = sorted(m for m in marks if start <= m[0] <= end)
    for index in range(start, end + 1):
        while pending and pending[0][0] == index:
            if run_key is not None:
                points.append(
                    TimelinePoint(phase=run_key[0], label=run_key[1], allocated_bytes=run_max)
                )
                run_key = None
            _, phase, label = pending.pop(0)
            points.append(TimelinePoint(phase=phase, label=label, allocated_bytes=allocated))
        if index == end:
            break
        e = log.events[index]
        size = round_block(e.nbytes)
        sign = 1 if e.action == "alloc" else -1
        allocated += sign * size
        by_category[e.category] = by_category.get(e.category, 0) + sign * size
        key = (e.phase, e.label)
        if key != run_key:
            if run_key is not None:
                points.append(
                    TimelinePoint(phase=run_key[0], label=run_key[1], allocated_bytes=run_max)
                )
            run_key, run_max = key, allocated
        run_max = max(run_max, allocated)
        if allocated > peak.allocated:
            peak = _Peak(allocated, index, e.phase, e.label, None)
            peak.breakdown = {k: v for k, v in by_category.items() if v}
    if run_key is not None:
        points.append(TimelinePoint(phase=run_key[0], label=run_key[1], allocated_bytes=run_max))
    return peak, points, allocated, by_category


def memory_estimate(run: TracedRun) -> TracedEstimate:
    """The traced run as the analytic path's MemoryEstimate (method "traced"). peak_bytes is the
    highest allocation over step 1 and the steady step, as the protocol's
    torch.cuda.max_memory_allocated() over its steps; peak_step1_bytes that of step 1 alone."""
    log = event_log(run)
    starts = run.step_starts
    steady_start = starts[1] if len(starts) > 1 else starts[0]
    step1, _, allocated, by_category = _walk(log, 0, steady_start, 0, {}, run.marks)
    steady, points, _, _ = _walk(
        log, steady_start, len(log.events), allocated, by_category, run.marks
    )
    peak = steady if steady.allocated >= step1.allocated else step1
    estimate = MemoryEstimate(
        peak_bytes=peak.allocated,
        peak_step1_bytes=step1.allocated,
        peak_phase=peak.phase,
        peak_label=peak.label,
        breakdown=peak.breakdown or {},
        params=run.params,
        trainable_params=run.trainable_params,
        timeline=points,
        method="traced",
    )
    return TracedEstimate(
        estimate=estimate,
        events=log,
        step_starts=starts,
        lora_targets=run.lora_targets,
        attention_kernels=run.attention_kernels,
        attention_calls=run.attention_calls,
    )
