"""Real ranks: a case of several GPUs runs as one torchrun process per GPU where the machine has
them (memplan.verify.runner.with_ranks, child_argv), and the child's process group, FSDP2 and
DDP preparation work over real ranks (two gloo processes on the CPU, launched with the
environment torchrun gives its processes)."""

from __future__ import annotations

import pytest
import torch

from memplan.errors import MemplanError, UsageError
from memplan.schema import TrainSetup, VerifyCase
from memplan.verify import distributed
from memplan.verify.runner import child_argv, with_ranks

from .fakes import TINY_LLAMA
from .gloo_ranks import become_rank, run_ranks


def case_of(**setup) -> VerifyCase:
    return VerifyCase(
        case="tiny_fsdp2x2",
        model="tiny",
        model_type="llama",
        hf_config=TINY_LLAMA,
        setup=TrainSetup(batch=2, seq=16, **setup),
    )


def test_auto_takes_torchrun_where_the_machine_has_a_gpu_per_rank() -> None:
    case = case_of(strategy="fsdp2", gpus=2)
    real = with_ranks(case, "auto", gpus_here=lambda: 2)
    assert real.ranks == "torchrun" and real.case == "tiny_fsdp2x2_torchrun"
    assert with_ranks(case, "auto", gpus_here=lambda: 1) == case
    assert with_ranks(case, "simulated", gpus_here=lambda: 8) == case
    assert with_ranks(case_of(), "torchrun", gpus_here=lambda: 0) == case_of()  # one GPU
    with pytest.raises(MemplanError, match="needs 2 GPUs"):
        with_ranks(case, "torchrun", gpus_here=lambda: 1)
    with pytest.raises(UsageError, match="--ranks"):
        with_ranks(case, "all")


def test_a_torchrun_case_launches_one_process_per_gpu() -> None:
    case = with_ranks(case_of(strategy="ddp", gpus=4), "torchrun", gpus_here=lambda: 4)
    argv = child_argv(case, "python", ["case.json", "out.json"])
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in argv
    assert argv[-4:] == ["-m", "memplan.verify.worker", "case.json", "out.json"]
    assert child_argv(case_of(), "python", ["c", "o"]) == [
        "python",
        "-m",
        "memplan.verify.worker",
        "c",
        "o",
    ]


def _rank(rank: int, world: int, port: int, strategy: str, results) -> None:
    become_rank(rank, world, port)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(rank)  # each rank's own weights, until preparation hands out rank 0's
    setup = TrainSetup(batch=2, seq=16, strategy=strategy, gpus=world)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **fields), attn_implementation="sdpa"
    ).train()
    distributed.init_process_group(setup, "cpu")
    try:
        model = distributed.prepare(model, setup, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16), generator=torch.Generator())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        weight = model.lm_head.weight if strategy == "fsdp2" else model.module.lm_head.weight
        rows = weight.to_local().shape[0] if strategy == "fsdp2" else weight.shape[0]
        results.put((rank, distributed.rank(), rows, float(loss)))
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_real_ranks_prepare_and_train(strategy: str) -> None:
    got = run_ranks(_rank, 2, strategy)
    assert [(r, seen) for r, seen, _, _ in got] == [(0, 0), (1, 1)]
    vocab = TINY_LLAMA["vocab_size"]
    expected_rows = vocab // 2 if strategy == "fsdp2" else vocab
    assert [rows for _, _, rows, _ in got] == [expected_rows] * 2
    assert got[0][3] == pytest.approx(got[1][3])  # rank 0's weights reached every rank


def _offload_rank(rank: int, world: int, port: int, results) -> None:
    become_rank(rank, world, port)
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(rank)
    setup = TrainSetup(batch=2, seq=16, strategy="fsdp2", gpus=world, cpu_offload=True)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **fields), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).train()
    distributed.init_process_group(setup, "cpu")
    try:
        model = distributed.prepare(model, setup, "cpu")
        offloaded = [
            (p.offload_to_cpu, p.pin_memory)
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups
            for p in g.fsdp_params
        ]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16), generator=torch.Generator())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

        def nbytes(tensor: torch.Tensor) -> int:
            local = tensor.to_local()
            return local.numel() * local.element_size()

        params = list(model.parameters())
        held = {
            "shards": sum(nbytes(p) for p in params),
            "gradients": sum(nbytes(p.grad) for p in params),
            "states": sum(
                nbytes(opt.state[p][name]) for p in params for name in ("exp_avg", "exp_avg_sq")
            ),
        }
        results.put((rank, offloaded, held, float(loss)))
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
def test_cpu_offload_over_real_ranks_holds_what_the_host_line_says() -> None:
    """FSDP2 with CPUOffloadPolicy over three gloo ranks (uneven shards): every parameter is
    offloaded, and rank 0's shards, their gradients and AdamW's states after a step are the
    host memory advise reports."""
    from memplan.catalog import spec_from_config
    from memplan.estimators.timeline import host_bytes

    got = run_ranks(_offload_rank, 3)
    rank0 = got[0]
    assert rank0[1] and all(flags == (True, False) for flags in rank0[1])
    setup = TrainSetup(batch=2, seq=16, strategy="fsdp2", gpus=3, cpu_offload=True)
    held = rank0[2]
    assert held["states"] == 2 * held["shards"] == 2 * held["gradients"]  # bf16 AdamW
    assert sum(held.values()) == host_bytes(spec_from_config(TINY_LLAMA), setup)
    assert got[1][3] == pytest.approx(got[0][3]) == pytest.approx(got[2][3])
