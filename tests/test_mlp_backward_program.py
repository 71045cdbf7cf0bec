"""A dense gated MLP's backward program (contracts.gated_mlp_backward, with and without
memplan's GLU kernel inside FSDP2's mixed precision) against the layer's saved tensors: each name
it frees is one the layer saves after attention, it frees every one the MLP saves, and it keeps
the MLP's three weight gradients; where another rule applies it is empty."""

from __future__ import annotations

import pytest

from memplan.catalog import resolve_model
from memplan.estimators.contracts import runs_under_autocast
from memplan.estimators.parallel import computed_setup
from memplan.estimators.timeline import forward_saved
from memplan.schema import TrainSetup


@pytest.mark.parametrize(
    "model", ["llama-3.2-1b", "seed-oss-36b-instruct", "olmo-2-0425-1b", "qwen3-0.6b"]
)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_program_frees_what_the_mlp_saves_and_keeps_its_gradients(model, precision):
    spec = resolve_model(model)
    saved = forward_saved(spec, TrainSetup(batch=1, seq=128, precision=precision))
    weight = (4 if precision == "fp32" else 2) * spec.hidden_size * spec.intermediate_size
    for program, names in zip(saved.mlp_backward, saved.after_names, strict=True):
        freed = {step[1] for step in program if step[0].startswith("free_saved")}
        assert freed <= set(names)
        assert {n for n in names if n.startswith("mlp.")} <= freed
        assert [step[1] for step in program if step[0] == "grad_kept"] == [weight] * 3
        made = {step[1] for step in program if step[0] == "alloc"}
        assert made == {step[1] for step in program if step[0] == "free"}


@pytest.mark.parametrize(
    "options",
    [
        {"grad_checkpointing": True},
        {"lora_rank": 8},
        {"precision": "amp-bf16"},
        {"kernels": ("swiglu",)},
        {"kernels": ("swiglu",), "precision": "amp-bf16"},
        {"strategy": "ddp", "gpus": 2},
    ],
)
def test_the_program_is_empty_where_the_mlp_mark_stands(options):
    saved = forward_saved(resolve_model("llama-3.2-1b"), TrainSetup(batch=1, seq=128, **options))
    assert not any(saved.mlp_backward)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_glu_kernel_program_under_fsdp2_mixed_precision(checkpointing):
    """down_proj saves the product inside autocast; the high point holds it, gate, up,
    d(product) and down_proj's weight gradient only; the input gradients come after."""
    spec = resolve_model("llama-3.2-1b")
    setup = TrainSetup(
        batch=1,
        seq=128,
        precision="amp-bf16",
        kernels=("swiglu",),
        strategy="fsdp2",
        gpus=8,
        grad_checkpointing=checkpointing,
    )
    saved = forward_saved(spec, computed_setup(setup), under_autocast=runs_under_autocast(setup))
    weight = 2 * spec.hidden_size * spec.intermediate_size  # bf16, as FSDP2 gathers it
    for program, names in zip(saved.mlp_backward, saved.after_names, strict=True):
        assert {n for n in names if n.startswith("mlp.")} == {"mlp.gate_up", "mlp.down_in"}
        freed = [step[1] for step in program if step[0].startswith("free_saved")]
        assert freed == ["mlp.down_in", "mlp.gate_up", "mlp.gate_up", "norm.mlp.out"]
        assert [step[1] for step in program if step[0] == "grad_kept"] == [weight] * 3
        mark = program.index(("mark",))
        before = program[:mark]
        assert [s[0] for s in before] == ["grad_kept", "alloc"]  # dW_down, then d(product)
