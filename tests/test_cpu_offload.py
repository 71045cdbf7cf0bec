"""CPU offload per rank (estimators/parallel.py, zero.py): what leaves the GPU under FSDP2's
CPUOffloadPolicy and DeepSpeed's offload_optimizer / offload_param, what stays, and the host
memory advise reports beside it. FSDP2's device side is checked against FSDP2 itself in
test_fsdp2_memory.py, its host side over real ranks in verify/test_verify_ranks.py."""

from __future__ import annotations

import pytest

from memplan.advisor import advise
from memplan.catalog import resolve_model
from memplan.estimators import estimate
from memplan.estimators.param_tensors import param_shapes
from memplan.estimators.timeline import host_bytes, step_sizes, walk_run
from memplan.schema import GIB, TrainSetup

SPEC = resolve_model("llama-3.2-1b")


def held(setup: TrainSetup) -> dict[str, int]:
    """The most bytes of each category at any point of the steady step."""
    _, steady = walk_run(SPEC, setup, step_sizes(SPEC, setup, None, "cuda"), record=False)[0]
    return {
        category: max(s.get(category, 0) for s in steady.snapshots)
        for category in ("weights", "optimizer_states", "gradients", "transient")
    }


def setup_of(strategy: str, offload: bool, **options) -> TrainSetup:
    return TrainSetup(
        batch=2,
        seq=1024,
        kernels=("flce",),
        gpus=4,
        strategy=strategy,
        cpu_offload=offload,
        **options,
    )


@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "zero2", "zero3"])
def test_offload_leaves_the_optimizer_states_and_the_partitioned_weights_to_the_host(
    strategy: str,
) -> None:
    on, off = held(setup_of(strategy, False)), held(setup_of(strategy, True))
    assert on["optimizer_states"] > 0 and off["optimizer_states"] == 0
    if strategy in ("fsdp2", "zero3"):  # the shards (partitions) live on the host
        assert on["weights"] > 0 and off["weights"] == 0
    else:  # ZeRO 1-2 keep the whole bf16 model on every rank
        assert off["weights"] == on["weights"] == sum(param_shapes_bytes())


def param_shapes_bytes() -> list[int]:
    shapes = param_shapes(SPEC)
    layer = [r * c for r, c in (*shapes.attention, *shapes.mlp, *shapes.norms)]
    tail = [r * c for r, c in shapes.final_norm] + [r * c for r, c in [shapes.embedding]]
    # 512-byte blocks, as the walk counts them
    return [-(-2 * n // 512) * 512 for n in layer * SPEC.num_hidden_layers + tail]


def test_fsdp2_offload_keeps_no_sharded_gradient_on_the_gpu() -> None:
    """The reduced shard is copied to the host as it is made: at most one group's at a time."""
    on, off = held(setup_of("fsdp2", False)), held(setup_of("fsdp2", True))
    layer = sum(r * c for r, c in (*param_shapes(SPEC).attention, *param_shapes(SPEC).mlp))
    assert on["gradients"] >= 2 * SPEC.num_hidden_layers * layer // 4
    assert 0 < off["gradients"] < 2 * SPEC.vocab_size * SPEC.hidden_size  # the tail's, at most


@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "zero2", "zero3"])
def test_offload_lowers_rank_0s_peak(strategy: str) -> None:
    on = estimate(SPEC, setup_of(strategy, False)).peak_bytes
    off = estimate(SPEC, setup_of(strategy, True)).peak_bytes
    assert off < on


def test_fsdp2_host_memory_is_shards_gradients_and_adamw_states() -> None:
    setup = setup_of("fsdp2", True)
    shapes = param_shapes(SPEC)
    tensors = [*shapes.attention, *shapes.mlp, *shapes.norms] * SPEC.num_hidden_layers
    tensors += [*shapes.final_norm, shapes.embedding]  # tied: lm_head is the embedding
    shard = sum(-(-r // 4) * c * 2 for r, c in tensors)  # bf16, ceil(rows / 4) rows
    # the shards, their gradients, AdamW's two states
    assert host_bytes(SPEC, setup) == 4 * shard
    assert host_bytes(SPEC, setup_of("fsdp2", False)) == 0


def test_zero2_host_memory_is_the_fp32_partition_its_states_and_staging() -> None:
    setup = setup_of("zero2", True)
    total = (
        SPEC.vocab_size * SPEC.hidden_size
        + sum(
            r * c
            for r, c in (
                *param_shapes(SPEC).attention,
                *param_shapes(SPEC).mlp,
                *param_shapes(SPEC).norms,
            )
        )
        * SPEC.num_hidden_layers
        + SPEC.hidden_size
    )
    partition = -(-total // 8) * 2  # padded to 2N
    largest = SPEC.vocab_size * SPEC.hidden_size
    # fp32 master and gradient, AdamW's two fp32 states; a bf16 copy of the partition and the
    # staging buffer of the largest gradient
    expected = 4 * partition * 4 + (partition + largest) * 2
    assert host_bytes(SPEC, setup) == expected


def test_advise_names_the_offload_and_its_host_memory() -> None:
    advice = advise("llama-3.2-1b", 4, 2048, gpus=2, strategy="fsdp2", cpu_offload=True)
    text = " ".join(str(advice).split())  # unwrapped
    assert "with FSDP2 and CPU offload (rank 0's peak)" in text
    host = advice.estimate.host_bytes
    assert host > 0 and f"CPU offload: {host / GIB:.2f} GiB of host memory per rank" in text
    assert "CPU offload: 4 cases measured on an H100" in advice.warnings[-1]
    zero = advise("llama-3.2-1b", 4, 2048, gpus=2, strategy="zero2", cpu_offload=True)
    assert "CPU offload predicted from DeepSpeed's code; unmeasured" in zero.warnings[-1]
    plain = advise("llama-3.2-1b", 4, 2048, gpus=2, strategy="fsdp2")
    assert advice.peak_bytes < plain.peak_bytes and plain.estimate.host_bytes == 0
