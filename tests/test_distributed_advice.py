"""Advice across GPUs: rank 0's estimate under each strategy, the fewest GPUs that run a step,
the accelerate config that launches it, and the inputs refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memplan.accelerate_config import accelerate_config
from memplan.advisor import advise, judge
from memplan.catalog import resolve_gpu, resolve_model
from memplan.errors import UsageError
from memplan.estimators import estimate
from memplan.estimators.parallel import model_groups
from memplan.estimators.param_tensors import param_tensors
from memplan.schema import STRATEGIES, TrainSetup


@pytest.mark.parametrize("ranks", [1, 3, 8, 64])
def test_fsdp2_shards_every_parameter_to_ceil_rows_over_ranks(ranks: int) -> None:
    spec = resolve_model("qwen2.5-0.5b")
    setup = TrainSetup(batch=1, seq=256, gpus=ranks, strategy="fsdp2")
    groups = model_groups(spec, setup)
    shards = [p.shard(ranks) for g in groups.values() for p in g.params]
    rows = [p.shape[0] for g in groups.values() for p in g.params]
    assert all(s % (-(-r // ranks)) == 0 for s, r in zip(shards, rows))
    layer = sum(p.numel for p in groups["layer"].params)
    assert layer == sum(param_tensors(spec).layer)


def test_ddp_is_one_gpu_plus_a_copy_of_the_gradients() -> None:
    spec = resolve_model("llama-3.2-1b")
    one = estimate(spec, TrainSetup(batch=2, seq=1024, kernels=("flce",)))
    ddp = estimate(spec, TrainSetup(batch=2, seq=1024, kernels=("flce",), gpus=8, strategy="ddp"))
    buckets = ddp.breakdown["gradient_buckets"]
    assert buckets >= spec.num_hidden_layers and ddp.peak_bytes == one.peak_bytes + buckets


@pytest.mark.parametrize("strategy", ["fsdp2", "zero2", "zero3"])
def test_rank_0_holds_less_on_more_gpus(strategy: str) -> None:
    spec = resolve_model("llama-3.1-8b")
    peaks = [
        estimate(
            spec,
            TrainSetup(batch=1, seq=2048, grad_checkpointing=True, gpus=n, strategy=strategy),
        ).peak_bytes
        for n in (2, 4, 8, 16)
    ]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_the_fewest_gpus_run_and_one_fewer_does_not() -> None:
    """gemma-7b, batch 8 x 4096 tokens a rank: no count runs it as it is (its activations
    alone exceed an H100); with checkpointing the advised FSDP2 count runs and one fewer
    does not."""
    advice = advise("gemma-7b", 8, 4096)
    assert not advice.fits
    gpu = resolve_gpu(None)
    by_strategy = {c.strategy: c for c in advice.gpu_counts}
    assert set(by_strategy) == set(STRATEGIES)
    assert by_strategy["ddp"].gpus is None
    fsdp2 = by_strategy["fsdp2"]
    assert fsdp2.gpus is not None and fsdp2.change == "with gradient checkpointing"
    spec = resolve_model("gemma-7b")
    setup = advice.setup.model_copy(update={"strategy": "fsdp2", "grad_checkpointing": True})
    from memplan.advisor import fits, lightest_flce

    def runs(n: int) -> bool:
        return fits(judge(spec, lightest_flce(spec, setup.model_copy(update={"gpus": n})), gpu))

    assert runs(fsdp2.gpus)
    assert fsdp2.gpus == 1 or not runs(fsdp2.gpus - 1)
    assert f"num_processes: {fsdp2.gpus}" in (fsdp2.accelerate_config or "")


def test_a_step_that_fits_lists_no_gpu_counts() -> None:
    assert advise("llama-3.2-1b", 1, 512).gpu_counts == []


@pytest.mark.parametrize(
    "setup",
    [
        {"strategy": "ddp", "gpus": 2, "precision": "amp-bf16"},
        {"strategy": "fsdp2", "gpus": 16, "reshard_after_forward": False, "cpu_offload": True},
        {"strategy": "zero2", "gpus": 8},
        {"strategy": "zero3", "gpus": 4, "cpu_offload": True, "precision": "fp32"},
    ],
)
def test_accelerate_takes_the_config(setup: dict, tmp_path) -> None:
    """accelerate's own config class loads what advise prints (unknown keys are errors)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "config.yaml"
    path.write_text(accelerate_config(TrainSetup(batch=1, seq=8, **setup)))
    config = ClusterConfig.from_yaml_file(path)
    assert config.num_processes == setup["gpus"]
    assert str(config.distributed_type).endswith(
        {"ddp": "MULTI_GPU", "fsdp2": "FSDP"}.get(setup["strategy"], "DEEPSPEED")
    )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"gpus": 4}, "gpus 4 needs strategy"),
        ({"gpus": 0, "strategy": "fsdp2"}, "gpus must be a positive integer"),
        ({"gpus": 2**19, "strategy": "fsdp2"}, "gpus may be at most"),
        ({"gpus": 2, "strategy": "tp"}, "strategy must be one of"),
        ({"gpus": 2, "strategy": "ddp", "reshard_after_forward": False}, "FSDP2 setting"),
        ({"gpus": 2, "strategy": "ddp", "cpu_offload": True}, "needs a sharding strategy"),
    ],
)
def test_bad_parallelism_is_a_usage_error(options: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        advise("llama-3.2-1b", 1, 512, **options)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "4"], "--gpus 4 needs --strategy"),
        # each a process of its own: the rest under the slow marker
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                (["--gpus", "-1", "--strategy", "fsdp2"], "--gpus must be a positive integer"),
                (["--strategy", "megatron"], "Invalid value for '--strategy'"),
                (
                    ["--no-reshard-after-forward", "--strategy", "ddp", "--gpus", "2"],
                    "FSDP2 setting",
                ),
            ]
        ),
    ],
)
def test_the_command_line_refuses_bad_parallelism_in_one_line(args, message) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "memplan", "advise", "--model", "llama-3.2-1b", "--batch", "1"]
        + ["--seq", "512", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0], lines


def test_advise_names_the_ranks_in_its_first_line() -> None:
    from memplan.render import advice_text

    text = advice_text(advise("llama-3.1-8b", 1, 2048, gpus=8, strategy="fsdp2"))
    assert " ".join(text.split()).startswith(
        "llama-3.1-8b, batch 1 x seq 2048 per rank on 8 x H100 80GB SXM (the default GPU) with "
        "FSDP2 (rank 0's peak): fits"
    )
