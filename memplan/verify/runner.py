"""The parent side of the protocol: one fresh `python -m memplan.verify.worker` process per case,
run one after another, so no case ever sees another's allocations (a measurement taken after
other GPU work was seen 4 GiB higher). Nothing here imports torch."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from memplan.errors import MemplanError, UsageError
from memplan.schema import Gpu, Measurement, ModelSpec, ProfileTable, VerifyCase
from memplan.verify import protocol
from memplan.verify.distributed import TORCHRUN_STRATEGIES
from memplan.verify.predict import attach_prediction

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
WORKER = "memplan.verify.worker"
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def launch(
    argv: Sequence[str], *, env: dict[str, str], timeout_s: float | None
) -> subprocess.CompletedProcess[str]:
    """Run the child; tests replace this function with a fake."""
    debug = os.environ.get("MEMPLAN_DEBUG") == "1"
    return subprocess.run(
        list(argv),
        env=env,
        timeout=timeout_s,
        text=True,
        stdout=None if debug else subprocess.PIPE,
        stderr=None if debug else subprocess.PIPE,
        check=False,
    )


def _child_env(case: VerifyCase) -> dict[str, str]:
    env = dict(os.environ)
    # The allocator setting is part of the case: the prediction models exactly this one.
    env.pop(ALLOC_CONF_ENV, None)
    if case.setup.expandable_segments:
        env[ALLOC_CONF_ENV] = "expandable_segments:True"
    # The child imports the same memplan as the parent, installed or not.
    paths = [_PACKAGE_ROOT, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _crashed(case: VerifyCase, message: str) -> Measurement:
    return Measurement(
        case=case.case,
        model=case.model,
        setup=case.setup,
        steps=case.steps,
        liger=case.liger,
        model_type=case.model_type,
        hf_config=case.hf_config,
        status="error",
        error_kind="crash",
        error=message,
    )


RANKS = ("auto", "torchrun", "simulated")


def child_argv(case: VerifyCase, python: str, args: list[str]) -> list[str]:
    """The worker's command line: one process, or torchrun's one per GPU."""
    if case.ranks == "torchrun":
        world = f"--nproc-per-node={case.setup.gpus}"
        return [python, "-m", "torch.distributed.run", "--standalone", world, "-m", WORKER, *args]
    return [python, "-m", WORKER, *args]


@functools.cache
def visible_gpus(python: str = sys.executable) -> int:
    """The CUDA devices a child process sees, counted in a process of its own (torch in this
    one would take GPU memory the children measure)."""
    probe = "import torch; print(torch.cuda.device_count())"
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else 0


def with_ranks(
    case: VerifyCase, ranks: str, gpus_here: Callable[[], int] = visible_gpus
) -> VerifyCase:
    """The case with its ranks run as `ranks` says ("auto": torchrun where this machine has a
    GPU per rank; DeepSpeed ZeRO always, even on one GPU); a torchrun case's name ends in
    _torchrun."""
    if ranks not in RANKS:
        raise UsageError(f"--ranks must be one of {', '.join(RANKS)}, not {ranks!r}")
    zero = case.setup.strategy in TORCHRUN_STRATEGIES
    if zero and ranks == "simulated":
        strategy = case.setup.strategy
        raise UsageError(f"{strategy} is measured over real ranks only: --ranks torchrun")
    if not zero and (case.setup.strategy is None or case.setup.gpus == 1 or ranks == "simulated"):
        return case
    here = gpus_here()
    if ranks == "auto" and here < case.setup.gpus and not zero:
        return case
    if here < case.setup.gpus:
        raise MemplanError(
            f"--ranks torchrun needs {case.setup.gpus} GPUs for {case.case}; "
            f"this machine has {here}"
        )
    return case.model_copy(update={"ranks": "torchrun", "case": f"{case.case}_torchrun"})


def _run_child(
    case: VerifyCase, *, timeout_s: float | None, python: str | None
) -> tuple[Measurement, str]:
    """The child's Measurement (or a crash record) and the tail of its stderr."""
    with tempfile.TemporaryDirectory(prefix="memplan-verify-") as tmp:
        case_path = Path(tmp) / "case.json"
        out_path = Path(tmp) / "result.json"
        case_path.write_text(case.model_dump_json())
        argv = child_argv(case, python or sys.executable, [str(case_path), str(out_path)])
        try:
            proc = launch(argv, env=_child_env(case), timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            return _crashed(case, f"the worker did not finish within {timeout_s:g} s"), ""
        stderr = proc.stderr or ""
        if not out_path.exists():
            detail = _last_line(stderr)
            message = f"the worker exited with code {proc.returncode} without a result"
            return _crashed(case, message + (f": {detail}" if detail else "")), stderr
        measurement = Measurement.model_validate_json(out_path.read_text())
    expected = {
        "ok": protocol.EXIT_OK,
        "oom": protocol.EXIT_OOM,
    }.get(measurement.status)
    if case.ranks == "torchrun" and expected == protocol.EXIT_OOM:
        expected = proc.returncode  # torchrun exits 1 when a rank failed, whatever its code
    if expected is not None and proc.returncode != expected:
        message = f"the worker wrote status {measurement.status} but exited {proc.returncode}"
        return _crashed(case, message), stderr
    return measurement, stderr


def run_case(
    case: VerifyCase,
    *,
    spec: ModelSpec | None = None,
    gpu: Gpu | None = None,
    predict: bool = True,
    profile: bool = False,
    timeout_s: float | None = None,
    python: str | None = None,
) -> Measurement:
    """Measure one case in a fresh process and put the estimator's prediction next to it.

    With `profile`, two more fresh processes profile the steady-state step without the patch and
    with it (profiling in the measured process would change what it measures)."""
    measurement, _ = _run_child(case, timeout_s=timeout_s, python=python)
    if predict and case.mode == "measure":
        measurement = attach_prediction(measurement, spec, gpu)
    if profile and measurement.status == "ok":
        measurement = _with_profiles(measurement, case, timeout_s=timeout_s, python=python)
    return measurement


def _with_profiles(
    measurement: Measurement, case: VerifyCase, *, timeout_s: float | None, python: str | None
) -> Measurement:
    variants = {
        "without_patch": case.model_copy(
            update={
                "mode": "profile",
                "liger": False,
                "record_timeline": False,
                "setup": case.setup.model_copy(
                    update={"kernels": (), "flce_chunk": None, "flce_memory_budget": None}
                ),
            }
        )
    }
    if case.setup.kernels or case.liger:
        variants["with_patch"] = case.model_copy(
            update={"mode": "profile", "record_timeline": False}
        )
    tables: dict[str, ProfileTable] = {}
    errors: list[str] = []
    for key, variant in variants.items():
        result, _ = _run_child(variant, timeout_s=timeout_s, python=python)
        if result.status == "ok" and result.profile and "self" in result.profile:
            tables[key] = result.profile["self"]
        else:
            errors.append(f"{key.replace('_', ' ')}: {result.error or result.status}")
    return measurement.model_copy(
        update={"profile": tables or None, "profile_error": "; ".join(errors) or None}
    )
