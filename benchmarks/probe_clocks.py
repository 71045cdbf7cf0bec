"""Probe: why a profiled training step is shorter than an unprofiled one. bench_e2e.py's cases
(Liger, memplan), each in a fresh process: after 3 warm-up steps, steps timed one by one with
CUDA events in three regimes (back to back as the protocol runs them; each followed by a
synchronize; under torch.profiler), while a thread samples the SM clock, power and temperature
(NVML) every 10 ms. Prints each regime's median step and mean clock and power.

    python benchmarks/probe_clocks.py [--only REGEX] [--variants liger,memplan]"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


class Sampler:
    """NVML samples (host time, SM MHz, watts, degrees C) on a thread, every `period_s`."""

    def __init__(self, period_s: float = 0.01) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        nvml, handle = self.nvml, self.handle
        while not self._stop.is_set():
            self.samples.append(
                (
                    time.perf_counter(),
                    nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                    nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                )
            )
            time.sleep(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, stop: float) -> dict[str, float]:
        inside = [s for s in self.samples if start <= s[0] <= stop] or [(0.0, 0.0, 0.0, 0.0)]
        return {
            "sm_mhz": statistics.mean(s[1] for s in inside),
            "watts": statistics.mean(s[2] for s in inside),
            "celsius": max(s[3] for s in inside),
        }


def child(case_json: Path, out_json: Path, steps: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memplan.schema import VerifyCase
    from memplan.verify import worker

    trainer = worker.build_trainer(VerifyCase.model_validate_json(case_json.read_text()))

    def timed(n: int, sync_each: bool) -> list[float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            trainer.step()
            events[i + 1].record()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return [events[i].elapsed_time(events[i + 1]) for i in range(n)]

    result: dict[str, Any] = {}
    with Sampler() as sampler:
        for regime in ("back to back", "synchronized", "profiled", "back to back again"):
            start = time.perf_counter()
            if regime == "profiled":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                    step_ms = timed(3, sync_each=False)
            else:
                step_ms = timed(steps, sync_each=regime == "synchronized")
            result[regime] = {"step_ms": step_ms, **sampler.between(start, time.perf_counter())}
    out_json.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="llama-3.2-1b", help="regex over model names")
    parser.add_argument("--variants", default="liger,memplan")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.steps)
        return

    from bench_e2e import CASES
    from measure_grid import plan

    print("| case | variant | regime | step ms, median | each | SM MHz | W | max C |")
    print("|---|---|---|---:|---|---:|---:|---:|")
    for model, layers, batch, seq in CASES:
        if not re.search(args.only, model):
            continue
        for variant in args.variants.split(","):
            case, _ = plan(
                model, batch, seq, {}, kernels="none" if variant == "liger" else "all",
                layers=layers, liger=variant == "liger",
            )  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                case_json, out_json = Path(tmp) / "case.json", Path(tmp) / "out.json"
                case_json.write_text(case.model_dump_json())
                cmd = [sys.executable, __file__, "--steps", str(args.steps), "--child"]
                done = subprocess.run(
                    [*cmd, str(case_json), str(out_json)], capture_output=True, text=True
                )
                if done.returncode:
                    sys.exit(f"{model} {variant}: {done.stderr.strip()[-2000:]}")
                result = json.loads(out_json.read_text())
            for regime, r in result.items():
                each = " ".join(f"{t:.1f}" for t in r["step_ms"])
                print(
                    f"| {model} | {variant} | {regime} | {statistics.median(r['step_ms']):.2f} "
                    f"| {each} | {r['sm_mhz']:.0f} | {r['watts']:.0f} | {r['celsius']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
