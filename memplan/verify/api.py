"""`memplan.verify(...)`: plan the cases, run each in a fresh process, return the Report."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memplan import versions
from memplan.errors import MemplanError
from memplan.schema import Advice, Gpu, Measurement, Plan, Report
from memplan.verify.cases import PlannedCase, plan_cases
from memplan.verify.runner import run_case


class NoGpuError(MemplanError):
    """No usable GPU: the run stopped there. `report` holds the cases measured before it."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


def execute(
    planned: Sequence[PlannedCase],
    *,
    profile: bool = False,
    timeout_s: float | None = None,
    on_result: Callable[[int, Measurement], None] | None = None,
    on_start: Callable[[int, PlannedCase], None] | None = None,
) -> Report:
    """Run every case, one fresh process after the other. Stops at the first case that finds no
    usable GPU (every later case would too) with NoGpuError, which keeps the cases measured
    before it; out of memory and other failures are recorded."""
    versions.warn_if_unvalidated()
    measurements: list[Measurement] = []
    for i, item in enumerate(planned):
        if on_start:
            on_start(i, item)
        m = run_case(item.case, spec=item.spec, gpu=item.gpu, profile=profile, timeout_s=timeout_s)
        if on_result:
            on_result(i, m)
        if m.error_kind == "no_gpu":
            message = m.error or "no usable CUDA GPU"
            if measurements:
                message += f"; stopped at case {i + 1} of {len(planned)}"
            raise NoGpuError(message, Report(measurements=measurements))
        measurements.append(m)
    return Report(measurements=measurements)


def verify(
    model: Any,
    *,
    batch: int,
    seq: int,
    plan: Plan | Advice | None = None,
    kernels: str | Sequence[str] | None = "auto",
    sweeps: Mapping[str, Sequence[Any]] | None = None,
    gpu: str | Gpu | None = None,
    gpu_mem: str | int | None = None,
    steps: int = 3,
    profile: bool = False,
    timeline: bool = False,
    layers: int | None = None,
    trust_remote_code: bool = False,
    random_init: bool = False,
    timeout_s: float | None = None,
    **setup: Any,
) -> Report:
    """Measure the peak of `steps` training steps of `model` (a catalog name, a config or
    checkpoint path, a ModelSpec, or a transformers config/model, whose config is rebuilt with
    random weights) under the measurement protocol, each case in a fresh subprocess, with the
    estimator's prediction beside every measurement.

    `setup` takes the TrainSetup options (precision, optimizer, grad_checkpointing, attn,
    lora_rank, lora_targets, grad_accum, flce_chunk); `kernels` is "auto" (the advisor's choice),
    "all", "none" or names; a `plan` (Plan or Advice) overrides kernels, chunk, micro-batch and
    checkpointing. `sweeps` maps an option to its values ({"batch": [1, 2, 4]}).
    Raises MemplanError when a single case fails to run, NoGpuError (a MemplanError whose
    `report` keeps the cases measured before) when there is no usable GPU; out of memory is a
    result (status "oom"), not an exception."""
    planned = plan_cases(
        model,
        batch=batch,
        seq=seq,
        kernels=kernels,
        plan=plan,
        sweeps=sweeps,
        gpu=gpu,
        gpu_mem=gpu_mem,
        steps=steps,
        timeline=timeline,
        layers=layers,
        trust_remote_code=trust_remote_code,
        random_init=random_init,
        **setup,
    )
    report = execute(planned, profile=profile, timeout_s=timeout_s)
    if len(report.measurements) == 1 and report.measurements[0].status == "error":
        raise MemplanError(report.measurements[0].error or "the run failed")
    return report
