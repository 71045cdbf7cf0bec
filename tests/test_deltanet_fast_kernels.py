"""The gated DeltaNet's fast kernels on a CUDA GPU, whichever import: flash-linear-attention's
chunked delta rule (deltanet_kernels="fla") and causal-conv1d's conv (deltanet_conv=
"causal_conv1d"). In one forward of the Hugging Face model the bytes autograd saves equal the
contract's for what transformers runs, and differ from the torch fallback's. Forwards only: on
Hopper with Triton 3.4 to 3.7.0 fla refuses one of its backward kernels."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memplan.advisor import installed_deltanet
from memplan.catalog import spec_from_config
from memplan.estimators.timeline import forward_saved
from memplan.schema import TrainSetup
from tests.test_estimator_contracts import PROBE, family_overrides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or not any(importlib.util.find_spec(m) for m in ("fla", "causal_conv1d")),
        reason="needs a CUDA GPU and flash-linear-attention or causal-conv1d",
    ),
]

# As many key as value heads of 128 (Qwen3.5-0.8B's shape): fla copies the q and k views
SQUARE_HEADS = {
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}


# Each new shape and dtype compiles and autotunes fla's kernels (a minute or more): four cases
# cover both head layouts, both fused and separate projections, a partial chunk, each precision.
@pytest.mark.parametrize(
    ("model_type", "extra", "seq", "precision"),
    [
        ("qwen3_5_text", SQUARE_HEADS, 200, "bf16"),
        ("qwen3_5_text", {}, 64, "fp32"),
        ("qwen3_next", {}, 200, "bf16"),
        ("qwen3_next", {}, 64, "amp-bf16"),
    ],
    ids=[
        "qwen3_5_text-square-s200-bf16",
        "qwen3_5_text-s64-fp32",
        "qwen3_next-s200-bf16",
        "qwen3_next-s64-amp",
    ],
)
def test_saved_bytes_match_the_contract(model_type, extra, seq, precision, saved_storage_bytes):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**family_overrides(model_type), **extra})
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().train()
    ids = torch.randint(0, config.vocab_size, (PROBE["batch"], seq), device="cuda")

    def forward() -> object:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision.startswith("amp")):
            return model(input_ids=ids, labels=ids)

    measured = saved_storage_bytes(forward, model)
    spec = spec_from_config(config.to_dict())

    def predicted(**deltanet: str) -> int:
        setup = TrainSetup(batch=PROBE["batch"], seq=seq, precision=precision, **deltanet)
        return forward_saved(spec, setup, backend="cuda", rounded=False).total

    torch_only = predicted(deltanet_kernels="torch", deltanet_conv="torch")
    assert torch_only != measured  # transformers took a fast kernel
    assert predicted(**installed_deltanet()) == measured
