"""Probe: where the GPU waits during a training step. bench_e2e.py's cases (Liger, memplan), each
in a fresh process: 3 warm-up steps, then torch.profiler over 2 steps with no synchronization
between them (as the protocol measures). Prints the step's span, the GPU's busy time (union of
kernel, memcpy and memset intervals) and its idle time by phase and by the CPU operator that
launched the work after each gap, and the host synchronizations. Writes each trace as gzipped
chrome-trace JSON (re-read with --from-trace).

    python benchmarks/probe_gaps.py [--only REGEX] [--variants liger,memplan] [--out-dir DIR]
    python benchmarks/probe_gaps.py --from-trace FILE.json.gz"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_PREFIX = "phase: "
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
MIN_GAP_US = 5.0


def child(case_json: Path, trace_out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from memplan.schema import VerifyCase
    from memplan.verify import worker

    trainer = worker.build_trainer(VerifyCase.model_validate_json(case_json.read_text()))
    start = time.perf_counter()
    for _ in range(3):
        trainer.step()
    torch.cuda.synchronize()
    print(f"step without profiler: {(time.perf_counter() - start) / 3 * 1e3:.2f} ms")

    open_range: list[Any] = []

    def mark(name: str) -> None:
        if open_range:
            open_range.pop().__exit__(None, None, None)
        if name != "end":
            phase = record_function(PHASE_PREFIX + name)
            phase.__enter__()
            open_range.append(phase)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            trainer.step(mark)
        torch.cuda.synchronize()
    raw = trace_out.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(trace_out, "wb") as dst:
        dst.write(src.read())
    raw.unlink()


def _enclosing(
    spans: list[tuple[float, float, str]], starts: list[float], ts: float, prefix: str = ""
) -> list[str]:
    """Names of the spans (sorted by start) that contain ts, outermost first."""
    names = []
    for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
        begin, end, name = spans[i]
        if begin <= ts <= end and name.startswith(prefix):
            names.append(name)
        if ts - begin > 5e6:
            break
    return names[::-1]


def analyse(trace: dict[str, Any], label: str) -> list[str]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: float(e["ts"])
    )
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    cpu_spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation")
    )
    cpu_starts = [s[0] for s in cpu_spans]
    busy = 0.0
    end = float(gpu[0]["ts"])
    gaps: list[tuple[float, dict[str, Any], float]] = []
    for e in gpu:
        begin, stop = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if begin > end:
            gaps.append((begin - end, e, end))
        busy += max(0.0, stop - max(begin, end))
        end = max(end, stop)
    span = end - float(gpu[0]["ts"])
    idle_by_phase: dict[str, float] = defaultdict(float)
    idle_by_op: dict[str, list[float]] = defaultdict(list)
    host_bound = 0.0
    for gap, kernel, gap_start in gaps:
        if gap < MIN_GAP_US:
            idle_by_phase["(gaps under 5 us)"] += gap
            continue
        launch = runtime.get(kernel.get("args", {}).get("correlation"))
        ts = float(launch["ts"]) if launch else float(kernel["ts"])
        if launch and ts + float(launch.get("dur", 0.0)) >= gap_start:
            host_bound += gap
        stack = _enclosing(cpu_spans, cpu_starts, ts)
        phases = [s for s in stack if s.startswith(PHASE_PREFIX)]
        idle_by_phase[phases[-1][len(PHASE_PREFIX) :] if phases else "(outside)"] += gap
        ops = [s for s in stack if not s.startswith(PHASE_PREFIX)]
        key = " > ".join(ops[:1] + ops[-1:]) if ops else "(no CPU op)"
        idle_by_op[key].append(gap)
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in SYNC_CALLS]
    lines = [
        f"### {label}",
        "",
        f"2 steps: span {span / 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms, idle "
        f"{(span - busy) / 1e3:.2f} ms ({(span - busy) / span:.1%}); idle after a launch that "
        f"came after the GPU ran dry: {host_bound / 1e3:.2f} ms",
        "",
        "| phase of the launching CPU code | idle ms (2 steps) |",
        "|---|---:|",
    ]
    for phase, gap in sorted(idle_by_phase.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {phase} | {gap / 1e3:.3f} |")
    lines += ["", "| launched from (outermost > innermost op) | gaps | idle ms | largest us |"]
    lines.append("|---|---:|---:|---:|")
    ranked = sorted(idle_by_op.items(), key=lambda kv: -sum(kv[1]))
    for key, gaps_us in ranked[:25]:
        lines.append(
            f"| `{key[:110]}` | {len(gaps_us)} | {sum(gaps_us) / 1e3:.3f} | {max(gaps_us):.0f} |"
        )
    lines += ["", "| host synchronization | calls | ms |", "|---|---:|---:|"]
    by_sync: dict[str, list[float]] = defaultdict(list)
    for e in syncs:
        stack = _enclosing(cpu_spans, cpu_starts, float(e["ts"]))
        ops = [s for s in stack if not s.startswith(PHASE_PREFIX)]
        by_sync[f"{e['name']} in {' > '.join(ops[:1] + ops[-1:]) or '-'}"].append(
            float(e.get("dur", 0.0))
        )
    for key, durs in sorted(by_sync.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| `{key[:120]}` | {len(durs)} | {sum(durs) / 1e3:.3f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="llama-3.2-1b", help="regex over model names")
    parser.add_argument("--variants", default="liger,memplan")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or "bench_out"))
    parser.add_argument("--from-trace", type=Path, nargs="*")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.from_trace:
        for path in args.from_trace:
            with gzip.open(path) as f:
                print("\n".join(analyse(json.load(f), path.name)))
        return

    from bench_e2e import CASES
    from measure_grid import plan

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    for model, layers, batch, seq in CASES:
        if not re.search(args.only, model):
            continue
        for variant in args.variants.split(","):
            kernels = "none" if variant == "liger" else variant.replace("memplan", "all")
            case, _ = plan(
                model, batch, seq, {}, kernels=kernels.split("+")[0], layers=layers,
                liger=variant == "liger",
            )  # fmt: skip
            extra = tuple(kernels.split("+")[1:])
            if extra:
                setup = case.setup.model_copy(update={"kernels": (*case.setup.kernels, *extra)})
                case = case.model_copy(update={"setup": setup})
            case_json = args.out_dir / "gap_case.json"
            case_json.write_text(case.model_dump_json())
            trace = args.out_dir / f"trace_{model}_{variant.replace('+', '_')}.json.gz"
            cmd = [sys.executable, __file__, "--child", str(case_json), str(trace)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            print(done.stdout.strip())
            if done.returncode:
                sys.exit(f"{model} {variant}: {done.stderr.strip()[-2000:]}")
            with gzip.open(trace) as f:
                lines = analyse(json.load(f), f"{model}, {variant}: {done.stdout.strip()}")
            print("\n".join(lines), flush=True)
            report += lines
    (args.out_dir / "probe_gaps.md").write_text("\n".join(report))


if __name__ == "__main__":
    main()
