"""Record the caching allocator's every event over whole measured runs: the replay data that
tests/test_allocator_replay.py checks the allocator model against.

    python benchmarks/record_allocator_traces.py [--out-dir DIR] [--only REGEX]
        [--from-results FILE]

Each case runs the measurement protocol in a fresh process (memplan.verify) with the allocator's
history recorded from before the model is built to the end of the measured steps. Writes
DIR/<case>.json.gz: the measurement (peaks, reserved, non-allocator bytes, the prediction) and its
trace as (action, address, size) rows; DIR defaults to tests/data/allocator_traces. With
--from-results, the cases are those of a `memplan verify` results file that ran or ran out of
memory (selected by --only)."""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memplan.schema import Report, VerifyCase  # noqa: E402
from memplan.verify.cases import plan_cases  # noqa: E402
from memplan.verify.predict import spec_from_hf_config  # noqa: E402
from memplan.verify.runner import run_case  # noqa: E402

# (model, batch, seq, layers, kernels, setup options): sizes that run in seconds on an H100 and
# cover the loss paths, precisions, LoRA with checkpointing, eager attention, MoE, the fused
# optimizer and expandable segments.
CASES: list[tuple[str, int, int, int | None, str, dict[str, Any]]] = [
    ("llama-3.2-1b", 4, 2048, None, "none", {}),
    ("llama-3.2-1b", 4, 2048, None, "auto", {}),
    ("llama-3.2-1b", 4, 2048, None, "none", {"expandable_segments": True}),
    ("llama-3.2-1b", 4, 2048, None, "auto", {"optimizer": "adamw-fused"}),
    ("llama-3.2-1b", 4, 2048, None, "none", {"lora_rank": 16, "grad_checkpointing": True}),
    ("qwen2.5-0.5b", 4, 2048, None, "none", {"precision": "amp-bf16"}),
    ("qwen3-0.6b", 2, 1024, None, "none", {"precision": "fp32"}),
    ("gemma-2-2b", 2, 2048, 6, "none", {"attn": "eager"}),
    ("mixtral-8x7b", 2, 1024, 2, "none", {}),
]


def cases(results: str | None) -> list[tuple[VerifyCase, Any]]:
    """(case, spec) of the built-in list, or of every measured case of a results file."""
    if results is not None:
        report = Report.model_validate_json(Path(results).read_text())
        return [
            (
                VerifyCase(
                    case=m.case,
                    model=m.model,
                    model_type=m.model_type,
                    hf_config=m.hf_config,
                    setup=m.setup,
                    steps=m.steps,
                    record_allocator_trace=True,
                ),
                spec_from_hf_config(dict(m.hf_config, model_type=m.model_type)),
            )
            for m in report.measurements
            if m.status in ("ok", "oom") and not m.liger and m.model_type
        ]
    planned = [
        p
        for model, batch, seq, layers, kernels, options in CASES
        for p in plan_cases(model, batch=batch, seq=seq, kernels=kernels, layers=layers, **options)
    ]
    return [(p.case.model_copy(update={"record_allocator_trace": True}), p.spec) for p in planned]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(REPO / "tests/data/allocator_traces"))
    parser.add_argument("--only", help="regex over case names")
    parser.add_argument("--from-results", help="measure the cases of this results file")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for case, spec in cases(args.from_results):
        if args.only and not re.search(args.only, case.case):
            continue
        m = run_case(case, spec=spec)
        events = len(m.allocator_trace or ())
        print(
            f"{case.case}: {m.status} peak {m.peak_bytes} reserved {m.reserved_bytes} "
            f"non-allocator {m.non_allocator_bytes} events {events} {m.error or ''}",
            flush=True,
        )
        path = out / f"{case.case.replace('+', '-')}.json.gz"
        with gzip.open(path, "wt") as f:
            f.write(m.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
