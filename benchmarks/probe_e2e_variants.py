"""Probe: what memplan's layer-level changes gain end to end. bench_e2e.py's cases run as
Liger, as memplan with torch's embedding (its default kernels less the embedding kernel), as
memplan without the decoder-layer patch (MEMPLAN_FUSED_RESIDUALS=0: residual adds and
projection-gradient sums by autograd), and as memplan (its default kernels), interleaved over
several rounds, each run in its own fresh process; prints the median step time of each and
Liger's time over it.

    python benchmarks/probe_e2e_variants.py [--only REGEX] [--rounds 3] [--steps 10]
        [--variants NAME,...]"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_e2e import CASES  # noqa: E402
from measure_grid import plan  # noqa: E402

from memplan.patching.engine import FUSED_RESIDUALS_ENV  # noqa: E402
from memplan.schema import GIB  # noqa: E402
from memplan.verify.runner import run_case  # noqa: E402

# variant -> (liger, memplan kernels: "all" less the names after it, layer patch)
VARIANTS = {
    "liger": (True, "none", "1"),
    "memplan (torch embedding)": (False, "all -embedding", "1"),
    "memplan (layers unpatched)": (False, "all", "0"),
    "memplan": (False, "all", "1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="llama", help="regex over model names")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of names")
    args = parser.parse_args()
    cases = [c for c in CASES if re.search(args.only, c[0])]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    step_ms: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], float] = {}
    for round_index in range(args.rounds):
        for model, layers, batch, seq in cases:
            for variant in variants:
                liger, kernels, fused = VARIANTS[variant]
                os.environ[FUSED_RESIDUALS_ENV] = fused
                case, spec = plan(
                    model, batch, seq, {}, kernels=kernels.split()[0], layers=layers,
                    steps=args.steps, liger=liger,
                )  # fmt: skip
                dropped = [k[1:] for k in kernels.split()[1:]]
                if dropped:  # the same plan (FLCE budget) otherwise
                    kept = tuple(k for k in case.setup.kernels if k not in dropped)
                    setup = case.setup.model_copy(update={"kernels": kept})
                    name = case.case + "".join(f"-{k}" for k in dropped)
                    case = case.model_copy(update={"setup": setup, "case": name})
                m = run_case(case, spec=spec, timeout_s=300)
                if m.status != "ok":
                    sys.exit(f"{case.case} ({variant}): {m.error}")
                step_ms.setdefault((model, variant), []).append(1e3 * m.step_s)
                peaks[(model, variant)] = m.peak_bytes / GIB
                print(f"round {round_index}  {model:14s} {variant:28s} {1e3 * m.step_s:8.2f} ms")
    print()
    print("| case | variant | step ms, median | each round | peak GiB | Liger / this |")
    print("|---|---|---:|---|---:|---:|")
    for model, *_ in cases:
        liger_ms = statistics.median(step_ms.get((model, "liger"), [float("nan")]))
        for variant in variants:
            times = step_ms[(model, variant)]
            ms = statistics.median(times)
            each = ", ".join(f"{t:.2f}" for t in times)
            print(
                f"| {model} | {variant} | {ms:.2f} | {each} | {peaks[(model, variant)]:.2f} "
                f"| {liger_ms / ms:.3f} |"
            )


if __name__ == "__main__":
    main()
