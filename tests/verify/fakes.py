"""Fakes shared by the verify tests: a tiny config, a fake CUDA memory counter, and a fake
child-process launcher that writes the result file the real worker would."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memplan.schema import GIB, Measurement, MemoryEstimate, TimelinePoint, VerifyCase
from memplan.verify import protocol

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


class FakeCudaMemory:
    """torch.cuda's counters for a CPU run: the peak grows by 1 GiB at each reading, so step 1
    and the steady peak differ and the test can tell which reading went where."""

    def __init__(self, capability: tuple[int, int] = (9, 0)) -> None:
        self.peak = 10 * GIB
        self.capability = capability

    def max_memory_allocated(self, *args: Any) -> int:
        self.peak += GIB
        return self.peak

    def install(self, monkeypatch: Any, torch: Any) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "init", lambda: None)
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (79 * GIB, 80 * GIB))
        monkeypatch.setattr(cuda, "get_device_name", lambda *a: "Fake GPU")
        monkeypatch.setattr(cuda, "get_device_capability", lambda *a: self.capability)
        monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: 3 * GIB)
        monkeypatch.setattr(cuda, "max_memory_allocated", self.max_memory_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: 70 * GIB)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)


def estimate(peak_gib: float, step1_gib: float) -> MemoryEstimate:
    return MemoryEstimate(
        peak_bytes=int(peak_gib * GIB),
        peak_step1_bytes=int(step1_gib * GIB),
        peak_phase="backward",
        peak_label="loss backward",
        breakdown={"weights": GIB},
        params=1000,
        trainable_params=1000,
        timeline=[
            TimelinePoint(
                phase="forward", label="embed", allocated_bytes=int(0.3 * peak_gib * GIB)
            ),
            TimelinePoint(phase="backward", label="loss", allocated_bytes=int(peak_gib * GIB)),
            TimelinePoint(
                phase="optimizer", label="adamw", allocated_bytes=int(0.5 * peak_gib * GIB)
            ),
        ],
    )


Behaviour = Callable[[VerifyCase], tuple[dict[str, Any] | None, int]]


class FakeLauncher:
    """Stands in for runner.launch: `behaviour(case)` gives the fields the child would write
    (None: it writes nothing, as a crashed child) and its exit code."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.cases: list[VerifyCase] = []

    def __call__(self, argv: list[str], *, env: dict[str, str], timeout_s: float | None):
        at = argv.index("memplan.verify.worker")  # after torchrun's options, or first
        assert argv[at - 1] == "-m"
        case_path, out_path = argv[at + 1], argv[at + 2]
        case = VerifyCase.model_validate_json(Path(case_path).read_text())
        self.cases.append(case)
        fields, code = self.behaviour(case)
        if fields is not None:
            base = {
                "case": case.case,
                "model": case.model,
                "setup": case.setup.model_dump(),
                "model_type": case.model_type,
                "hf_config": case.hf_config,
                "steps": case.steps,
                "liger": case.liger,
            }
            Path(out_path).write_text(
                Measurement.model_validate({**base, **fields}).model_dump_json()
            )
        return subprocess.CompletedProcess(argv, code, stdout="", stderr="Traceback ...\nBoom\n")


def ok_result(peak_gib: float = 20.0, step1_gib: float = 15.0) -> tuple[dict[str, Any], int]:
    return (
        {
            "status": "ok",
            "peak_bytes": int(peak_gib * GIB),
            "peak_step1_bytes": int(step1_gib * GIB),
            "reserved_bytes": int((peak_gib + 2) * GIB),
            "step_s": 0.5,
            "tokens_per_s": 16384.0,
            "loss": 11.0,
            "env": {"gpu": "Fake GPU", "torch": "x", "transformers": "y", "triton": "z"},
        },
        protocol.EXIT_OK,
    )


def oom_result(above_gib: float = 78.5) -> tuple[dict[str, Any], int]:
    return (
        {
            "status": "oom",
            "oom_above_bytes": int(above_gib * GIB),
            "error": f"out of memory in step 1 above {above_gib:.2f} GiB allocated",
        },
        protocol.EXIT_OOM,
    )


def load_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
