"""Data parallelism in the protocol's child process, prepared as accelerate prepares it
(docs/distributed.md).

Real ranks: the child runs under torchrun, one process per GPU (WORLD_SIZE = `gpus`), over
NCCL (gloo on the CPU); rank 0 reports. Simulated ranks, on one GPU: FSDP2 shards over a fake
process group of `gpus` ranks (torch's fake_pg): its collectives do nothing, and every buffer
FSDP2 asks for is really allocated, so rank 0's memory is that of a real rank 0; DDP runs over
a real one-rank group (under the fake group its reducer fails in backward), its buckets holding
every gradient on any number of ranks. FSDP2 models are sharded by accelerate's own
fsdp2_prepare_model with cpu_ram_efficient_loading: rank 0 holds the model on the CPU and
every rank takes its shards."""

from __future__ import annotations

import os
from types import MethodType, SimpleNamespace
from typing import Any

from memplan.accelerate_config import ACCELERATE_MIXED_PRECISION
from memplan.errors import MemplanError
from memplan.schema import TrainSetup

MEASURED_STRATEGIES = ("ddp", "fsdp2")


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


def init_process_group(setup: TrainSetup, device: str) -> None:
    import torch.distributed as dist

    if setup.strategy not in MEASURED_STRATEGIES:
        raise MemplanError(
            f"memplan verify measures {' and '.join(MEASURED_STRATEGIES)}; "
            f"{setup.strategy} is predicted only"
        )
    if dist.is_initialized():
        return
    world = launched_ranks()
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
            cpu_offload=setup.cpu_offload,
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
