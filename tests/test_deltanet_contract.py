"""The gated DeltaNet layer's contract (memplan/estimators/deltanet.py) against the tensors
autograd saves on the CPU, for one layer run alone (no cache): padded and unpadded sequences,
one and several chunks, batch 1-3, one and two value heads per key head, bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from memplan.catalog import spec_from_config
from memplan.estimators.contracts import DtypePlan, layer_saved
from memplan.estimators.deltanet import TRITON_BENCHMARK_BUFFER
from memplan.estimators.timeline import layer_contexts, step_sizes, walk_run
from memplan.schema import TrainSetup

# Qwen3-Next: the same layer with fused input projections (in_proj_qkvz, in_proj_ba), a small
# MoE block beside it
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


def deltanet_config(heads: tuple[int, int, int, int], fused: bool = False) -> dict:
    nk, nv, dk, dv = heads
    return {
        "model_type": "qwen3_5_text",
        **(QWEN3_NEXT if fused else {}),
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1000,
        "layer_types": ["linear_attention"],
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nv,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "use_cache": False,
    }


def predicted(config: dict, precision: str, batch: int, seq: int, frozen: bool = False) -> int:
    spec = spec_from_config(config)
    # frozen: LoRA on attention only, checkpointed (peft's leaf gives the layer's input a
    # gradient while none of its weights trains)
    lora = {"lora_rank": 16, "lora_targets": ("q_proj", "v_proj"), "grad_checkpointing": True}
    setup = TrainSetup(batch=batch, seq=seq, precision=precision, **(lora if frozen else {}))
    (ctx,) = layer_contexts(spec, setup, DtypePlan.of(precision), "cpu")
    assert ctx.needs_input_grad and ctx.trainable_base != frozen
    return layer_saved(ctx).bytes_of(batch * seq, ("delta.",))


@pytest.mark.parametrize(
    "precision, batch, seq, heads",
    [
        ("bf16", 2, 64, (2, 4, 32, 32)),  # one chunk, no padding
        ("bf16", 1, 200, (2, 4, 32, 32)),  # four chunks, padded
        ("bf16", 3, 100, (2, 2, 32, 32)),  # as many key as value heads
        ("bf16", 1, 1, (2, 4, 32, 32)),  # one token
        ("bf16", 2, 130, (4, 4, 64, 64)),
        ("bf16", 3, 256, (2, 6, 32, 64)),  # three value heads per key head, dv > dk
        ("fp32", 1, 200, (2, 4, 32, 32)),
        ("fp32", 2, 64, (2, 4, 32, 32)),  # unpadded: the chunk matmuls copy their operands
        ("fp32", 3, 100, (2, 2, 32, 32)),  # q and k views of the conv output
        ("fp32", 2, 256, (2, 2, 32, 32)),
    ],
)
def test_saved_bytes_match_autograd(saved_storage_bytes, precision, batch, seq, heads):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = deltanet_config(heads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf, dtype=dtype).train()
    # the layer's input out of the embedding: no leaf of the test's own (the fixture's graph,
    # whose outputs its nodes save, outlives the test)
    x = model.model.embed_tokens(torch.randint(0, hf.vocab_size, (batch, seq)))
    measured = saved_storage_bytes(lambda: model.model.layers[0].linear_attn(x), model)
    # the input projections keep the layer's input itself (the input norm's output, counted
    # with the norm)
    assert predicted(config, precision, batch, seq) == measured - x.numel() * x.element_size()


@pytest.mark.parametrize(
    "precision, batch, seq, heads",
    [
        ("bf16", 2, 130, (2, 4, 32, 64)),
        ("bf16", 1, 64, (2, 2, 32, 32)),
        ("fp32", 2, 64, (2, 4, 32, 64)),
        ("fp32", 3, 100, (2, 2, 32, 32)),
    ],
)
def test_saved_bytes_match_autograd_with_frozen_weights(
    saved_storage_bytes, precision, batch, seq, heads
):
    """The layer's weights frozen and its input needing a gradient: the conv still saves its
    input (conv channels differ from the hidden size here, so the two are told apart), and
    nothing keeps the layer's input itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = deltanet_config(heads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf, dtype=dtype).train()
    model.model.layers[0].requires_grad_(False)
    x = model.model.embed_tokens(torch.randint(0, hf.vocab_size, (batch, seq)))
    measured = saved_storage_bytes(lambda: model.model.layers[0].linear_attn(x), model)
    assert predicted(config, precision, batch, seq, frozen=True) == measured


@pytest.mark.parametrize(
    "precision, batch, seq, heads, frozen",
    [
        ("bf16", 2, 64, (2, 4, 32, 32), False),
        ("bf16", 3, 100, (2, 2, 32, 32), False),
        ("fp32", 1, 200, (2, 4, 32, 32), False),
        # z a view of the whole in_proj_qkvz output, which the gated norm's fp32 gate keeps
        ("fp32", 3, 100, (2, 2, 32, 32), False),
        ("fp32", 2, 256, (2, 2, 32, 64), False),
        ("fp32", 3, 100, (2, 2, 32, 32), True),
        ("bf16", 2, 130, (2, 4, 32, 64), True),
    ],
)
def test_qwen3_next_fused_projections_save_what_qwen3_5s_do(
    saved_storage_bytes, precision, batch, seq, heads, frozen
):
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, q, k and v concatenated again for the conv:
    the saved tensors of Qwen3.5's separate projections, but in fp32 with as many key as value
    heads, where the gate z stays a view of the fused output."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = deltanet_config(heads, fused=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf, dtype=dtype).train()
    if frozen:
        model.model.layers[0].requires_grad_(False)
    x = model.model.embed_tokens(torch.randint(0, hf.vocab_size, (batch, seq)))
    measured = saved_storage_bytes(lambda: model.model.layers[0].linear_attn(x), model)
    kept_input = 0 if frozen else x.numel() * x.element_size()
    assert predicted(config, precision, batch, seq, frozen) == measured - kept_input


def fla_walk() -> tuple[list, list[int]]:
    """The analytic run of a two-layer Qwen3.5 (a DeltaNet layer, then full attention) with
    fla's rule: its events and the event counts where its steps end."""
    config = {**deltanet_config((2, 4, 32, 32)), "num_hidden_layers": 2}
    config["layer_types"] = ["linear_attention", "full_attention"]
    spec = spec_from_config(config)
    setup = TrainSetup(batch=2, seq=200, deltanet_kernels="fla")
    _, log = walk_run(spec, setup, step_sizes(spec, setup, None, "cuda"), steady_steps=1)
    return log.events, log.step_ends


def test_fla_autotunes_in_the_first_deltanet_backward_of_step_one_only():
    events, ends = fla_walk()
    buffers = [
        (i, e.label)
        for i, e in enumerate(events)
        if e.action == "alloc" and e.nbytes == TRITON_BENCHMARK_BUFFER
    ]
    ((at, label),) = buffers
    assert at < ends[0] and label == "layer 0 backward"  # step 1 ends at ends[0]


def test_torch_rule_walks_no_benchmark_buffer():
    config = {**deltanet_config((2, 4, 32, 32)), "num_hidden_layers": 1}
    spec = spec_from_config(config)
    setup = TrainSetup(batch=2, seq=200)
    _, log = walk_run(spec, setup, step_sizes(spec, setup, None, "cuda"), steady_steps=1)
    assert not [e for e in log.events if e.nbytes == TRITON_BENCHMARK_BUFFER]
