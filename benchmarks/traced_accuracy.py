"""The traced estimate on the CPU against what is already measured, and how long a trace takes.

    python benchmarks/traced_accuracy.py [--only REGEX] [--skip-timing]

1. Every measured case of tests/data/measurements_h200.json that ran with a setup the trace
   follows (memplan.traced.verdict.decides: its kernels' traced path was checked, one GPU),
   predicted again by tracing (for the GPU the measurement recorded), its stream replayed
   through the allocator model for the reserved peak, and written as a memplan Report whose
   predictions are the traced ones: benchmarks/results_traced_h200_cases.json (`memplan report`
   renders it; the analytic prediction of each case stays in the source file).
2. Trace time of catalog models from 16 to 80 layers, batch 1 x 2048, twice each in one process
   (the first pays for transformers' imports and torch's meta kernels' first calls):
   benchmarks/results_trace_time_cpu.json.

Runs on the CPU; the measurements are the H200's."""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.schema import Report, TrainSetup  # noqa: E402
from memplan.verify.predict import measured_gpu  # noqa: E402

SOURCE = REPO / "tests" / "data" / "measurements_h200.json"
CASES_OUT = REPO / "benchmarks" / "results_traced_h200_cases.json"
TIME_OUT = REPO / "benchmarks" / "results_trace_time_cpu.json"
TIMED = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "llama-3.1-70b")


def traced_cases(only: str | None) -> Report:
    from memplan.traced import trace_config
    from memplan.traced.verdict import decides, replayed

    source = Report.model_validate_json(SOURCE.read_text())
    out = Report(
        label="Traced estimate (memplan.traced, on the CPU) of the H200 measurements, with "
        "the reserved peak of its stream replayed through the allocator model; the measured "
        "figures are those of tests/data/measurements_h200.json"
    )
    for m in source.measurements:
        if m.status != "ok" or not decides(m.setup) or (only and not re.search(only, m.case)):
            continue
        config = {**m.hf_config, "model_type": m.model_type}
        gpu = measured_gpu(m)
        run = trace_config(config, m.setup, gpu, name=m.model)
        reserved = replayed(run.events.events, m.setup, gpu) if gpu else None
        predicted = run.estimate.model_copy(update={"timeline": [], "reserved": reserved})
        update = {"predicted": predicted}
        out.measurements.append(m.model_copy(update=update))
        print(f"{m.case}: traced {out.measurements[-1].error_pct:+.2f}%", flush=True)
    return out


def trace_times() -> dict:
    import torch
    import transformers

    from memplan.catalog import resolve_model
    from memplan.traced import trace_config

    rows = []
    for name in TIMED:
        spec = resolve_model(name)
        setup = TrainSetup(batch=1, seq=2048)
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            traced = trace_config(spec.hf_config, setup)
            seconds.append(time.perf_counter() - start)
        rows.append(
            {
                "model": name,
                "layers": spec.num_hidden_layers,
                "events": len(traced.events.events),
                "first_s": round(seconds[0], 2),
                "again_s": round(seconds[1], 2),
            }
        )
        print(rows[-1], flush=True)
    return {
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
            "note": "two shared cores; other work ran beside it",
        },
        "setup": "batch 1 x seq 2048, bf16, AdamW: build on meta, step 1 and a steady step",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="regex over the measured cases' names")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args(argv)
    report = traced_cases(args.only)
    CASES_OUT.write_text(report.model_dump_json(indent=1))
    errors = [abs(m.error_pct) for m in report.measurements if m.error_pct is not None]
    print(
        f"{len(errors)} cases: traced |error| median {statistics.median(errors):.2f}%, "
        f"max {max(errors):.2f}%; wrote {CASES_OUT}"
    )
    if not args.skip_timing:
        TIME_OUT.write_text(json.dumps(trace_times(), indent=1))
        print(f"wrote {TIME_OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
