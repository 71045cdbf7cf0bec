"""DeepSpeed ZeRO in `memplan verify`: the config the child gives accelerate is the one
memplan.estimators.zero models, ZeRO runs over real ranks only, a missing DeepSpeed is one
`Error:` line, and (slow) a ZeRO-2 case's trainer runs as two gloo processes on the CPU."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest
import torch
from click.testing import CliRunner

from memplan.errors import MemplanError, UsageError
from memplan.estimators.zero import (
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PERSISTENCE_PER_HIDDEN,
    Zero,
)
from memplan.schema import GIB, TrainSetup, VerifyCase
from memplan.verify import distributed, protocol, worker
from memplan.verify.cli import verify_command
from memplan.verify.predict import spec_from_hf_config
from memplan.verify.runner import with_ranks

from .fakes import TINY_LLAMA
from .gloo_ranks import become_rank, run_ranks

BASE = ["--model", "qwen3-0.6b", "--batch", "4", "--seq", "1024", "--kernels", "none"]


def setup_of(strategy: str, gpus: int = 2, **fields) -> TrainSetup:
    return TrainSetup(batch=2, seq=16, strategy=strategy, gpus=gpus, **fields)


def case_of(setup: TrainSetup) -> VerifyCase:
    return VerifyCase(
        case=f"tiny_{setup.strategy}x{setup.gpus}",
        model="tiny",
        model_type="llama",
        hf_config=TINY_LLAMA,
        setup=setup,
    )


def modelled(setup: TrainSetup) -> Zero:
    return Zero(spec_from_hf_config(TINY_LLAMA, "tiny"), setup)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("precision", ["bf16", "fp32", "amp-bf16"])
def test_the_config_is_the_one_zero_py_models(strategy: str, precision: str) -> None:
    setup = setup_of(strategy, gpus=4, precision=precision, grad_accum=2)
    zero = modelled(setup)
    hidden = TINY_LLAMA["hidden_size"]
    config = distributed.deepspeed_config(setup, hidden)
    section = config["zero_optimization"]
    assert section["stage"] == zero.stage
    assert section["reduce_bucket_size"] == zero.bucket == hidden**2
    assert section["stage3_prefetch_bucket_size"] == int(0.9 * hidden**2)
    assert section["stage3_param_persistence_threshold"] == zero.persistence
    assert zero.persistence == PERSISTENCE_PER_HIDDEN * hidden
    assert section["offload_optimizer"] == section["offload_param"] == {"device": "none"}
    # bf16 mode holds 2-byte weights and gradients; fp32 holds 4
    assert config["bf16"]["enabled"] == (zero.element == 2)
    assert not config["fp16"]["enabled"]
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 2 * 2 * 4
    deepspeed_zero = pytest.importorskip("deepspeed.runtime.zero.config")
    parsed = deepspeed_zero.DeepSpeedZeroConfig(**section)
    assert parsed.overlap_comm == zero.overlap  # DeepSpeed's default: on for stage 3 only
    assert parsed.max_reuse_distance == MAX_REUSE_DISTANCE
    assert parsed.max_live_parameters == MAX_LIVE_PARAMETERS
    assert parsed.reduce_bucket_size == zero.bucket


def test_amp_fp16_is_deepspeed_fp16_mode_as_accelerate_sets_it() -> None:
    config = distributed.deepspeed_config(setup_of("zero2", precision="amp-fp16"), 32)
    assert config["fp16"] == {"enabled": True, "auto_cast": True}
    assert not config["bf16"]["enabled"]


def test_cpu_offload_is_predicted_only() -> None:
    with pytest.raises(MemplanError, match="zero3 with CPU offload is predicted only"):
        distributed.deepspeed_config(setup_of("zero3", cpu_offload=True), 32)


def test_without_deepspeed_the_child_says_so_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(MemplanError, match="^zero2 needs DeepSpeed: "):
        distributed.prepare_zero(torch.nn.Linear(2, 2), None, setup_of("zero2"))


@pytest.mark.parametrize("gpus", [1, 2])
def test_zero_always_runs_torchrun_processes(gpus: int) -> None:
    case = case_of(setup_of("zero3", gpus=gpus))
    for ranks in ("auto", "torchrun"):
        real = with_ranks(case, ranks, gpus_here=lambda: 2)
        assert real.ranks == "torchrun" and real.case == f"{case.case}_torchrun"
    with pytest.raises(MemplanError, match=f"needs {gpus} GPUs"):
        with_ranks(case, "auto", gpus_here=lambda: gpus - 1)
    with pytest.raises(UsageError, match="^zero3 is measured over real ranks only"):
        with_ranks(case, "simulated", gpus_here=lambda: 8)


def test_the_child_refuses_zero_without_real_ranks() -> None:
    with pytest.raises(MemplanError, match="^zero1 is measured over real ranks only"):
        distributed.check_measured(setup_of("zero1"), real_ranks=False)
    distributed.check_measured(setup_of("zero1"), real_ranks=True)
    distributed.check_measured(setup_of("fsdp2"), real_ranks=False)


def _find_spec_without_deepspeed(real):
    return lambda name, *args: None if name == "deepspeed" else real(name, *args)


def test_the_command_line_needs_deepspeed_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(
        importlib.util, "find_spec", _find_spec_without_deepspeed(importlib.util.find_spec)
    )
    result = CliRunner().invoke(verify_command, BASE + ["--gpus", "2", "--strategy", "zero2"])
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: --strategy zero2 needs DeepSpeed, which this Python cannot import "
        "(pip install deepspeed)\n"
    )


def test_the_command_line_refuses_simulated_zero_in_one_line(monkeypatch) -> None:
    real = importlib.util.find_spec
    # DeepSpeed need not be installed for the refusal
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "deepspeed" else real(name, *a),
    )
    args = BASE + ["--gpus", "2", "--strategy", "zero3", "--ranks", "simulated"]
    result = CliRunner().invoke(verify_command, args)
    assert result.exit_code == 2
    assert result.stderr == ("Error: zero3 is measured over real ranks only: --ranks torchrun\n")


def _rank(rank: int, world: int, port: int, strategy: str, results) -> None:
    # DeepSpeed's CPU accelerator: tensors and gloo on the CPU
    become_rank(rank, world, port, DS_ACCELERATOR="cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

    worker.DEVICE = "cpu"
    setup = setup_of(strategy, gpus=world)
    torch.manual_seed(rank)  # each rank's own weights, until the engine hands out rank 0's
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **fields), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).train()
    distributed.init_process_group(setup, "cpu")
    try:
        trainer = worker._Trainer(case_of(setup), model, TINY_LLAMA["vocab_size"])
        for _ in range(3):
            trainer.step()
        engine, optimizer = trainer.engine, trainer.engine.optimizer
        fp32 = getattr(optimizer, "single_partition_of_fp32_groups", None)
        if fp32 is None:  # stage 3's name for its flat fp32 partitions
            fp32 = optimizer.fp32_partitioned_groups_flat
        results.put(
            (
                rank,
                engine.zero_optimization_stage(),
                engine.zero_reduce_bucket_size(),
                engine.zero_overlap_comm(),
                engine.zero_prefetch_bucket_size(),
                engine.zero_max_reuse_distance(),
                engine.bfloat16_enabled(),
                engine.global_steps,
                [p.numel() for p in fp32],
                float(trainer.loss),
            )
        )
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_trains_over_two_real_ranks(strategy: str) -> None:
    pytest.importorskip("deepspeed")
    got = run_ranks(_rank, 2, strategy)
    zero = modelled(setup_of(strategy))
    prefetch = int(0.9 * zero.bucket)
    for rank, (seen, *config, bf16, steps, partitions, _) in enumerate(got):
        assert seen == rank
        # the engine runs the config zero.py models
        assert config == [zero.stage, zero.bucket, zero.overlap, prefetch, MAX_REUSE_DISTANCE]
        assert bf16
        assert steps == 3  # the engine stepped the optimizer once a protocol step
        assert partitions == [zero.partition]  # each rank's fp32 master, as zero.py counts it
    assert got[0][-1] == pytest.approx(got[1][-1])  # rank 0's weights reached every rank


def _child(rank: int, world: int, port: int, results) -> None:
    """worker.run as a torchrun rank, torch.cuda's counters faked (the CPU has none)."""
    become_rank(rank, world, port, DS_ACCELERATOR="cpu")
    counters = {
        "synchronize": lambda *a: None,
        "memory_allocated": lambda *a: 3 * GIB,
        "max_memory_allocated": lambda *a: 5 * GIB,
        "max_memory_reserved": lambda *a: 7 * GIB,
        "memory_reserved": lambda *a: 7 * GIB,
        "mem_get_info": lambda *a: (79 * GIB, 80 * GIB),
    }
    for name, fake in counters.items():
        setattr(torch.cuda, name, fake)
    # torch.cuda.is_available stays False: accelerate and DeepSpeed pick the CPU from it
    worker._check_gpu = lambda rec: rec.setdefault("env", {})
    worker.DEVICE = "cpu"
    case = case_of(setup_of("zero3", gpus=world, grad_accum=2)).model_copy(
        update={"ranks": "torchrun"}
    )
    m, code = worker.run(case)
    results.put((rank, code, m.status, m.error, m.env, m.peak_bytes, m.loss))


@pytest.mark.slow
def test_the_child_measures_zero3_with_accumulation_over_two_real_ranks() -> None:
    pytest.importorskip("deepspeed")
    got = run_ranks(_child, 2)
    for rank, code, status, error, env, peak, _ in got:
        assert (code, status, error) == (protocol.EXIT_OK, "ok", None), rank
        assert env["ranks"] == "torchrun" and env["world_size"] == "2"
        assert env["deepspeed"] == importlib.metadata.version("deepspeed")
        assert peak == 5 * GIB
    assert got[0][-1] == pytest.approx(got[1][-1])


def _patched_rank(rank: int, world: int, port: int, patched: bool, results) -> None:
    """Three ZeRO-3 steps of the tiny llama, with memplan's kernels or without; the losses, how
    many residual adds a layer fused into the next layer's norm, and whether the GLU kernel may
    run down_proj itself (the estimator counts the product as down_proj's saved input)."""
    import memplan
    from memplan.kernels._glu import recompute_product
    from memplan.patching import forwards

    become_rank(rank, world, port, DS_ACCELERATOR="cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

    worker.DEVICE = "cpu"
    setup = setup_of("zero3", gpus=world)
    torch.manual_seed(0)  # the same weights patched and unpatched
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **fields), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).train()
    fused = []
    if patched:
        memplan.apply(model, plan=None)
        leave = forwards.PrenormedHandoff.leave
        forwards.PrenormedHandoff.leave = lambda self, *a: (fused.append(1), leave(self, *a))
    distributed.init_process_group(setup, "cpu")
    try:
        trainer = worker._Trainer(case_of(setup), model, TINY_LLAMA["vocab_size"])
        losses = []
        for _ in range(3):
            trainer.step()
            losses.append(float(trainer.loss))
        down = trainer.engine.module.model.layers[0].mlp.down_proj
        gate = torch.empty(1, dtype=down.weight.dtype)
        results.put((rank, losses, len(fused), recompute_product(down, gate)))
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
def test_patched_model_trains_under_zero3_like_the_unpatched_one() -> None:
    # ZeRO-3 gathers a module's weights for that module's calls only: no layer may fuse its last
    # residual add into the next layer's norm, nor the GLU kernel run down_proj's matmul itself
    pytest.importorskip("deepspeed")
    reference = run_ranks(_patched_rank, 2, False)
    patched = run_ranks(_patched_rank, 2, True)
    for (_, want, *_), (_, got, fused, recomputed) in zip(reference, patched, strict=True):
        assert fused == 0
        assert not recomputed  # DeepSpeed's hooks on down_proj: its own call keeps the product
        assert got == pytest.approx(want, rel=2e-2)
