"""memplan.apply under FSDP2 as accelerate prepares it (fully_shard per decoder layer, the tail
[norm, lm_head] and the root; weights as DTensors): patched before or after sharding, training
matches the unpatched sharded model, and revert restores it. Run over a fake process group of
one rank on the CPU: every shard is the whole tensor, the FSDP2 code paths are all taken."""

from __future__ import annotations

import types

import pytest
import torch

import memplan

from .tiny_models import build

STEPS = 3


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=True
    )
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision="no",
        is_main_process=True,
        device=torch.device("cpu"),
    )
    return fsdp2_prepare_model(accelerator, model)


def train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "when", ["before sharding", pytest.param("after sharding", marks=pytest.mark.slow)]
)
def test_patched_sharded_model_trains_like_the_unpatched_one(fake_group, when: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    reference = train(shard(build("llama")))
    model = build("llama")
    if when == "before sharding":
        applied = memplan.apply(model, plan=None)
        model = shard(model)
    else:
        model = shard(model)
        applied = memplan.apply(model, plan=None)
    assert isinstance(model.model.layers[0], FSDPModule)
    assert set(applied.kernels) == {"rms_norm", "rope", "swiglu", "flce", "embedding"}
    assert train(model) == pytest.approx(reference, rel=1e-4)


def test_revert_restores_the_sharded_model(fake_group) -> None:
    model = shard(build("llama"))
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        before = model(input_ids=ids).logits
        memplan.apply(model, plan=None)
        memplan.revert(model)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert not any("forward" in vars(m) for m in model.modules())
