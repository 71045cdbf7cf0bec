"""Data parallelism in the protocol's child process, prepared as accelerate prepares it
(docs/distributed.md).

Real ranks: the child runs under torchrun, one process per GPU (WORLD_SIZE = `gpus`), over
NCCL (gloo on the CPU); rank 0 reports. Simulated ranks, on one GPU: FSDP2 shards over a fake
process group of `gpus` ranks (torch's fake_pg): its collectives do nothing, and every buffer
FSDP2 asks for is really allocated, so rank 0's memory is that of a real rank 0; DDP runs over
a real one-rank group (under the fake group its reducer fails in backward), its buckets holding
every gradient on any number of ranks. FSDP2 models are sharded by accelerate's own
fsdp2_prepare_model with cpu_ram_efficient_loading: rank 0 holds the model on the CPU and
every rank takes its shards. DeepSpeed ZeRO 1-3 runs over real ranks only (its engine does its
collectives itself), configured as memplan.estimators.zero models it."""

from __future__ import annotations

import os
from types import MethodType, SimpleNamespace
from typing import Any

from memplan.accelerate_config import ACCELERATE_MIXED_PRECISION, DEEPSPEED_MIXED_PRECISION
from memplan.errors import MemplanError
from memplan.schema import TrainSetup

MEASURED_STRATEGIES = ("ddp", "fsdp2")
# measured only as one torchrun process per GPU (a fake process group cannot run DeepSpeed)
TORCHRUN_STRATEGIES = ("zero1", "zero2", "zero3")


def prepares_from_cpu(setup: TrainSetup) -> bool:
    """FSDP2 loads the model CPU-RAM-efficiently: from the CPU, each rank takes its shards."""
    return setup.strategy == "fsdp2"


def init_device(setup: TrainSetup, device: str, model_bytes: int | None, free_bytes: int) -> str:
    """Where the child initializes the model's weights: on the GPU, unless FSDP2 needs a model
    of unknown size or one that takes more than half the GPU's free memory (a rank need never
    hold it whole); an FSDP2 model made on the GPU moves to the CPU before it is prepared
    (random initialization on the GPU machine's CPU took 100-330 s for 2.5-8.5B models)."""
    if prepares_from_cpu(setup) and (model_bytes is None or 2 * model_bytes > free_bytes):
        return "cpu"
    return device


def launched_ranks() -> int | None:
    """The number of ranks torchrun started this process among (its WORLD_SIZE), else None."""
    world = os.environ.get("WORLD_SIZE")
    return int(world) if world else None


def rank() -> int:
    """This process's rank: torchrun's RANK, 0 for a child that simulates its ranks."""
    return int(os.environ.get("RANK", "0"))


def select_device(device: str) -> None:
    """Under torchrun, each rank computes on the GPU of its local rank."""
    if device == "cuda" and launched_ranks() is not None:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def is_zero(setup: TrainSetup) -> bool:
    """Whether the setup's ranks run DeepSpeed ZeRO (prepared with its optimizer: prepare_zero)."""
    return setup.strategy in TORCHRUN_STRATEGIES


def init_process_group(setup: TrainSetup, device: str) -> None:
    import torch.distributed as dist

    world = launched_ranks()
    check_measured(setup, real_ranks=world is not None)
    if dist.is_initialized():
        return
    if world is not None:
        if world != setup.gpus:
            raise MemplanError(f"torchrun started {world} ranks for a case of {setup.gpus} GPUs")
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        return
    if setup.strategy == "fsdp2":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.gpus)
    else:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def check_measured(setup: TrainSetup, real_ranks: bool) -> None:
    """Refuses a strategy verify cannot measure with the ranks it has, in one line."""
    if setup.strategy in TORCHRUN_STRATEGIES and not real_ranks:
        raise MemplanError(
            f"{setup.strategy} is measured over real ranks only: --ranks torchrun on a machine "
            f"with {setup.gpus} GPUs"
        )
    if setup.strategy not in (*MEASURED_STRATEGIES, *TORCHRUN_STRATEGIES):
        measured = ", ".join(MEASURED_STRATEGIES + TORCHRUN_STRATEGIES)
        raise MemplanError(f"memplan verify measures {measured}; {setup.strategy} is not one")


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def prepare(model: Any, setup: TrainSetup, device: str) -> Any:
    """The model as accelerate's prepare leaves it for this strategy, on `device`."""
    import torch

    mixed = ACCELERATE_MIXED_PRECISION[setup.precision]
    if setup.strategy == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=setup.reshard_after_forward,
            auto_wrap_policy="transformer_based_wrap",
            cpu_ram_efficient_loading=True,
            cpu_offload=_offload_policy(setup, device),
        )
        if mixed != "no":
            plugin.set_mixed_precision(mixed)
        accelerator = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=plugin),
            mixed_precision=mixed,
            is_main_process=rank() == 0,
            device=torch.device(device),
        )
        model = fsdp2_prepare_model(accelerator, model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.cuda.current_device()] if device == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    if mixed != "no":
        model = _autocast_forward(model, mixed, device)
    return model


def _offload_policy(setup: TrainSetup, device: str) -> Any:
    """accelerate's CPUOffloadPolicy (pinned shards) for --cpu-offload; pinning needs a GPU, so
    CPU ranks (the tests) keep their shards in plain memory, which moves nothing on a GPU."""
    if not setup.cpu_offload:
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device != "cpu")


def sync_gradients(model: Any, sync: bool) -> None:
    """Whether the next backward reduces gradients across ranks, as accelerate's accumulate()
    decides it (FSDP2's set_requires_gradient_sync, DDP's require_backward_grad_sync, which its
    no_sync() context sets); a model of one GPU has neither."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    elif hasattr(model, "require_backward_grad_sync"):
        model.require_backward_grad_sync = sync


def _autocast_forward(model: Any, mixed: str, device: str) -> Any:
    """accelerate's native AMP: the forward under autocast, its floating outputs made fp32."""
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    dtype = torch.bfloat16 if mixed == "bf16" else torch.float16
    forward = torch.autocast(device_type=device, dtype=dtype)(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)
    return model


def deepspeed_config(setup: TrainSetup, hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed config accelerate gives ZeRO with the Hugging Face "auto" sizes filled from
    the model's hidden size (Accelerator._prepare_deepspeed), as memplan.estimators.zero models
    it: bf16 mode unless the setup is fp32, no offload (predicted only), DeepSpeed's defaults
    elsewhere
    (overlap_comm on for stage 3 only, stage3_max_reuse_distance 1e9)."""
    if setup.cpu_offload:
        raise MemplanError(
            f"{setup.strategy} with CPU offload is predicted only, not measured (DeepSpeed's CPU "
            "Adam needs its compiled ops)"
        )
    mixed = DEEPSPEED_MIXED_PRECISION[setup.precision]
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": setup.batch,
        "train_batch_size": setup.batch * setup.grad_accum * setup.gpus,
        "gradient_accumulation_steps": setup.grad_accum,
        "zero_optimization": {
            "stage": int(str(setup.strategy)[-1]),
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        },
        # accelerate sets it for an optimizer made in the code (the protocol's)
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": mixed == "bf16"},
        # accelerate's fp16 section (DeepSpeedPlugin.set_mixed_precision)
        "fp16": {"enabled": True, "auto_cast": True} if mixed == "fp16" else {"enabled": False},
    }
    return config


def prepare_zero(model: Any, optimizer: Any, setup: TrainSetup) -> Any:
    """DeepSpeed's engine for the model and its optimizer, made by accelerate's prepare; the
    engine steps its own optimizer (engine.step), as accelerate's backward does."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise MemplanError(f"{setup.strategy} needs DeepSpeed: {exc}") from exc
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        hf_ds_config=deepspeed_config(setup, model.config.hidden_size),
        gradient_accumulation_steps=setup.grad_accum,
        zero3_init_flag=False,  # the child builds the model whole; the engine partitions it
    )
    accelerator = Accelerator(
        mixed_precision=DEEPSPEED_MIXED_PRECISION[setup.precision], deepspeed_plugin=plugin
    )
    engine, _ = accelerator.prepare(model, optimizer)
    return engine
