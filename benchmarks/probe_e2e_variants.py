"""Probe: what each of memplan's session-13 changes gains end to end. bench_e2e.py's cases run
as Liger, as memplan without the decoder-layer patch (MEMPLAN_FUSED_RESIDUALS=0: residual adds
and projection-gradient sums by autograd), as memplan (its default kernels), and as memplan with
the opt-in embedding kernel added, interleaved over several rounds, each run in its own fresh
process; prints the median step time of each and Liger's time over it.

    python benchmarks/probe_e2e_variants.py [--only REGEX] [--rounds 3] [--steps 10]"""

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

# variant -> (liger, memplan kernels, layer patch)
VARIANTS = {
    "liger": (True, "none", "1"),
    "memplan, layers unpatched": (False, "all", "0"),
    "memplan": (False, "all", "1"),
    "memplan + embedding kernel": (False, "all embedding", "1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="llama", help="regex over model names")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cases = [c for c in CASES if re.search(args.only, c[0])]
    step_ms: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], float] = {}
    for round_index in range(args.rounds):
        for model, layers, batch, seq in cases:
            for variant, (liger, kernels, fused) in VARIANTS.items():
                os.environ[FUSED_RESIDUALS_ENV] = fused
                case, spec = plan(
                    model, batch, seq, {}, kernels=kernels.split()[0], layers=layers,
                    steps=args.steps, liger=liger,
                )  # fmt: skip
                if kernels == "all embedding":  # the same plan (FLCE budget) otherwise
                    added = (*case.setup.kernels, "embedding")
                    setup = case.setup.model_copy(update={"kernels": added})
                    case = case.model_copy(update={"setup": setup, "case": case.case + "+emb"})
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
        liger_ms = statistics.median(step_ms[(model, "liger")])
        for variant in VARIANTS:
            times = step_ms[(model, variant)]
            ms = statistics.median(times)
            each = ", ".join(f"{t:.2f}" for t in times)
            print(
                f"| {model} | {variant} | {ms:.2f} | {each} | {peaks[(model, variant)]:.2f} "
                f"| {liger_ms / ms:.3f} |"
            )


if __name__ == "__main__":
    main()
