"""Cases away from the edge of memory that none of the analytic walk's per-op temporaries were
found on, predicted before they ran: the analytic stream's reserved peak (what advise prints
there) and the allocated peak, out of sample (docs/fit_verdict.md).

    python benchmarks/measure_held_out.py predict --gpu h100 --out PREDICTIONS.json
    python benchmarks/measure_held_out.py measure PREDICTIONS.json --out-dir DIR [--only RE]
    python benchmarks/measure_held_out.py table PREDICTIONS.json RESULTS.json"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.first_predictions import (  # noqa: E402
    main,
    measure_into,
    table,
    write_predictions,
)
from memplan.advisor import advise  # noqa: E402
from memplan.catalog import resolve_gpu, resolve_model  # noqa: E402
from memplan.verify.predict import with_layers  # noqa: E402

SEQ = 2048
LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (catalog model, decoder layers kept (None: all), batch, kernels, setup options): LoRA, eager
# attention, autocast, checkpointing and fp32 on models and sizes none of the fixes used.
CASES: list[tuple[str, int | None, int, str, dict[str, Any]]] = [
    ("qwen2.5-3b", None, 4, "none", {"lora_rank": 16}),
    ("qwen3-4b", 12, 4, "auto", {"lora_rank": 16, "lora_targets": LORA_ALL}),
    ("llama-3.2-3b", None, 2, "none", {"attn": "eager", "grad_checkpointing": True}),
    ("gemma-2-9b", 6, 2, "auto", {"precision": "amp-bf16"}),
    ("mistral-7b-v0.3", 6, 2, "none", {"lora_rank": 16, "precision": "amp-bf16"}),
    ("smollm2-1.7b", None, 4, "auto", {"precision": "fp32"}),
]


def runs(gpu: Any) -> list[tuple[Any, Any]]:
    out = []
    for model, layers, batch, kernels, options in CASES:
        spec = resolve_model(model)
        spec = spec if layers is None else with_layers(spec, layers)
        out.append((spec, advise(spec, batch, SEQ, gpu=gpu, kernels=kernels, **options).setup))
    return out


def predict(args: argparse.Namespace) -> int:
    gpu = resolve_gpu(args.gpu)
    return write_predictions(runs(gpu), gpu, Path(args.out))


def measure(args: argparse.Namespace) -> int:
    return measure_into(args, "held_out_results.json", "held-out cases away from the edge")


if __name__ == "__main__":
    sys.exit(main(__doc__, predict, measure, table, timeout_s=300))
