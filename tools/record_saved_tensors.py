"""Record what Hugging Face training saves for backward: the fixtures
tests/data/saved_cuda_probe*.json, against which tests/test_estimator_contracts.py checks the
estimator's memory contracts. Run on a GPU (the fixtures are CUDA's bytes).

One forward of a small model per family under saved_tensors_hooks: every saved activation
(unique storages, parameters excluded) with the module that saved it; with --lora, of peft LoRA
models (LORA_TARGETS per family) in every precision and attention, the measurement protocol's
adapters (r=16, alpha 32, no dropout); with --kernels (all, or a comma list), patched with
memplan.apply first. Writes JSON.

    python tools/record_saved_tensors.py --out tests/data/saved_cuda_probe.json
    python tools/record_saved_tensors.py --kernels all \\
        --out tests/data/saved_cuda_probe_kernels.json
    python tools/record_saved_tensors.py --lora --out tests/data/saved_cuda_probe_lora.json
    python tools/record_saved_tensors.py --lora --kernels all \
        --out tests/data/saved_cuda_probe_lora_kernels.json
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "ministral3": {"head_dim": 64},
    "qwen2": {},
    "qwen3": {"head_dim": 64},
    "gemma": {"head_dim": 64},
    "gemma2": {"head_dim": 64, "sliding_window": 64, "query_pre_attn_scalar": 64},
    "gemma3_text": {"head_dim": 64, "sliding_window": 64, "query_pre_attn_scalar": 64},
    "phi3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "head_dim": 64,
    },
    "seed_oss": {"head_dim": 64},
    # layer 1 without RoPE, and with a window shorter than the probe's sequence
    "smollm3": {"no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 32},
    # granite-3.3-8b-instruct's multipliers
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 16.0,
    },
    "olmo2": {},
    # one sliding and one full layer: a cos/sin pair each, the window reached at seq 64
    "olmo3": {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    # a sliding layer that rotates and a full one without RoPE, the window reached at seq 64
    "exaone4": {
        "head_dim": 64,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # a dense layer, then a MoE layer with a shared expert and two expert groups; q/k norms,
    # q/k/v biases, half of each head rotated
    "glm4_moe": {
        "head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_group": 2,
        "topk_group": 1,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    # a dense layer, then a MoE layer (shared expert, two expert groups); latent attention
    # with a q latent, q/k heads of 48 (16 rotated), v heads of 32, as many KV heads as heads
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    # a sliding layer and a full one of its own head dim and KV head whose values are its keys,
    # the window reached at seq 64
    "gemma4_text": {
        "head_dim": 64,
        "global_head_dim": 128,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 0,
    },
    # a sliding and a full layer with sinks, the window reached at seq 64; biased experts
    "gpt_oss": {
        "head_dim": 64,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    # a layer that rotates (L2 q/k norms, chunks of 32 positions) and one without RoPE
    # (temperature-scaled queries); four experts beside the shared one
    "llama4_text": {
        "head_dim": 64,
        "num_local_experts": 4,
        "no_rope_layers": [1, 0],
        "attention_chunk_size": 32,
        "floor_scale": 16,
    },
    # a gated DeltaNet layer (twice as many value heads as key heads) and a gated full
    # attention layer, a quarter of each head rotated
    "qwen3_5_text": {
        "head_dim": 64,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    },
    # qwen3_5_text's two layers, each with a MoE block: four experts, a shared expert of its
    # own width and its sigmoid gate
    "qwen3_5_moe_text": {
        "head_dim": 64,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 192,
    },
    # the same layers with Qwen3-Next's fused DeltaNet projections (in_proj_qkvz, in_proj_ba)
    "qwen3_next": {
        "head_dim": 64,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 192,
    },
}


_ATTENTION_QV = ("q_proj", "v_proj")
_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_ALL = ("q_proj", "k_proj", "v_proj", "o_proj")

# Adapter placements recorded per family: the protocol's default (q, v; qkv on phi3) and every
# linear of the layer; llama adds the single placements whose first-layer rules differ.
LORA_TARGETS: dict[str, tuple[tuple[str, ...], ...]] = {
    **{
        family: (_ATTENTION_QV, _ALL_LINEAR)
        for family in (
            "llama",
            "mistral",
            "ministral3",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
            "olmo2",
            "olmo3",
            "seed_oss",
            "smollm3",
            "granite",
            "exaone4",
            "gemma4_text",
            "qwen3_5_text",
        )
    },
    "phi3": (("qkv_proj",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("o_proj",)),
    "mixtral": (_ATTENTION_QV, _ATTENTION_ALL),
    "qwen3_moe": (_ATTENTION_QV, _ATTENTION_ALL),
    "glm4_moe": (_ATTENTION_QV, _ATTENTION_ALL),
    "deepseek_v3": (
        ("q_b_proj", "kv_b_proj"),
        ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    ),
    "gpt_oss": (_ATTENTION_QV, _ATTENTION_ALL),
    # the estimate adapts attention only in a MoE model
    "llama4_text": (_ATTENTION_QV, _ATTENTION_ALL),
    "qwen3_5_moe_text": (_ATTENTION_QV, _ATTENTION_ALL),
    "qwen3_next": (_ATTENTION_QV, _ATTENTION_ALL),
}
LORA_TARGETS["llama"] += (
    ("o_proj",),
    ("v_proj",),
    ("k_proj",),
    ("gate_proj", "up_proj", "down_proj"),
)


def build(model_type: str, overrides: dict, dtype: torch.dtype, attn: str, device: str):
    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model


def patch(model, kernels: str | None) -> None:
    if not kernels:
        return
    import memplan

    names = None if kernels == "all" else kernels.split(",")
    memplan.apply(model, None, kernels=names)


def saved_tensors(model, ids, autocast: bool, device: str) -> list[dict]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current = ["<top>"]
    hooks = []
    for name, mod in model.named_modules():
        # Linear layers get no hooks: a hooked down_proj keeps nn.Linear's call (and saves the
        # product) where memplan's GLU kernel would run it and recompute the product.
        if isinstance(mod, torch.nn.Linear):
            continue
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: current.append(n)))
        hooks.append(mod.register_forward_hook(lambda m, a, o: current.pop() and None))
    seen: dict[int, dict] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen[ptr] = dict(
                    module=current[-1],
                    shape=list(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""),
                    nbytes=t.untyped_storage().nbytes(),
                )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    del out
    return list(seen.values())


def add_lora(model, targets: tuple[str, ...]):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, target_modules=list(targets), lora_dropout=0.0)
    return get_peft_model(model, config)


def run_saved(device: str, kernels: str | None, lora: bool = False) -> dict:
    result = {}
    batch, seq = 2, 64
    for model_type, overrides in FAMILIES.items():
        placements = LORA_TARGETS[model_type] if lora else ((),)
        for precision in ("bf16", "fp32", "amp-bf16"):
            for attn in ("sdpa", "eager"):
                if precision != "bf16" and attn == "eager" and not lora:
                    continue
                for targets in placements:
                    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
                    torch.manual_seed(0)
                    key = "/".join([model_type, precision, attn, *(["+".join(targets)] * lora)])
                    try:
                        model = build(model_type, overrides, dtype, attn, device)
                        if targets:
                            model = add_lora(model, targets)
                        patch(model, kernels)
                        model.train()
                        ids = torch.randint(0, TINY["vocab_size"], (batch, seq), device=device)
                        amp = precision.startswith("amp")
                        result[key] = saved_tensors(model, ids, amp, device)
                        del model
                    except Exception as exc:  # recorded in the fixture, and the rest goes on
                        result[key] = {"error": repr(exc)[:300]}
    return {
        "batch": batch,
        "seq": seq,
        "kernels": kernels,
        "lora": {"r": 16, "alpha": 32} if lora else None,
        "tiny": TINY,
        "families": FAMILIES,
        "saved": result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", help="patch with memplan first: all, or a comma list")
    ap.add_argument("--lora", action="store_true", help="peft LoRA models (LORA_TARGETS)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = run_saved(args.device, args.kernels, lora=args.lora)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
