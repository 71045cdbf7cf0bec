"""Tiny models of every family memplan patches, built from the catalog's published configs with
the sizes shrunk (hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, vocab 256)."""

from __future__ import annotations

import copy

import torch

from memplan.families import FAMILIES as _REGISTRY

# family (config.model_type) -> the catalog entry its tiny model is shrunk from
FAMILIES: dict[str, str] = {name: family.tiny_from for name, family in _REGISTRY.items()}

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def catalog_config(name: str) -> dict:
    from memplan.catalog import resolve_model

    return dict(resolve_model(name).hf_config)


def shrink(
    config: dict,
    sizes: dict | None = None,
    *,
    window: int = 8,
    experts: int = 4,
    moe_intermediate: int = 32,
    dropout: bool = False,
    **overrides,
) -> dict:
    """The catalog config at the given sizes (default TINY); options that depend on the size
    follow it: token ids inside the vocabulary, a sliding window shorter than the test
    sequences (so it matters), alternating sliding/full layers for Gemma 2/3/4, OLMo 3, EXAONE 4
    (whose full layers apply no RoPE) and gpt-oss, Gemma 4's full layers of their own head dim
    and one KV head, layers with and without RoPE for SmolLM3, fewer experts (in two groups where
    the router picks groups first, after one dense layer), DeepSeek-V3's latent attention at
    small ranks, Ministral 3's query factor past the fourth position.
    Without `dropout` the family's dropouts are off, so that two models of it compute the same
    in training whatever random numbers each draws."""
    sizes = TINY if sizes is None else sizes
    config = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    config.update(sizes)
    if not dropout:
        residual_key = _REGISTRY[config["model_type"]].config.residual_dropout_key
        config.update({key: 0.0 for key in ("attention_dropout", residual_key) if key})
    for key, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if config.get(key) is not None:
            config[key] = small
    if config.get("sliding_window") is not None:
        config["sliding_window"] = window
    if "query_pre_attn_scalar" in config:
        config["query_pre_attn_scalar"] = config["head_dim"]
    families = ("gemma2", "gemma3_text", "olmo3", "exaone4", "gemma4_text", "gpt_oss")
    if config["model_type"] in families:
        kinds = ("sliding_attention", "full_attention")
        layers = overrides.get("num_hidden_layers", config["num_hidden_layers"])
        config["layer_types"] = [kinds[i % 2] for i in range(layers)]
    if "global_head_dim" in config:  # gemma4: full layers of twice the head dim, one KV head
        config.update(global_head_dim=2 * config["head_dim"], num_global_key_value_heads=1)
    if "no_rope_layers" in config:  # smollm3: RoPE in even layers only; its config derives
        # the layer types from these
        layers = overrides.get("num_hidden_layers", config["num_hidden_layers"])
        config["no_rope_layers"] = [int(i % 2 == 0) for i in range(layers)]
        config.pop("layer_types", None)
    if "moe_layers" in config:  # llama4: every layer a mixture of experts, chunks shorter
        # than the test sequences
        layers = overrides.get("num_hidden_layers", config["num_hidden_layers"])
        config.update(moe_layers=list(range(layers)), attention_chunk_size=window)
    if "num_local_experts" in config:  # mixtral, gpt_oss, llama4
        config["num_local_experts"] = experts
    if "num_experts" in config:  # qwen3_moe; its last layer dense, so that MLP takes the GLU
        config.update(num_experts=experts, moe_intermediate_size=moe_intermediate)
        if _REGISTRY[config["model_type"]].config.moe.dense_layers_key == "mlp_only_layers":
            config["mlp_only_layers"] = [config["num_hidden_layers"] - 1]
    if "shared_expert_intermediate_size" in config:  # Qwen3.5-MoE: the shared expert (its GLU)
        config["shared_expert_intermediate_size"] = config["intermediate_size"]
    if "n_routed_experts" in config:  # DeepSeek-style (glm4_moe, deepseek_v3): two groups of
        # experts, the router picking one; one dense layer first
        config.update(n_routed_experts=experts, moe_intermediate_size=moe_intermediate, n_group=2)
        config.update(topk_group=1, first_k_dense_replace=1)
    if "kv_lora_rank" in config:  # deepseek_v3's latent attention: k and v for every head,
        # q and k heads wider than v's, the rotated part a third of them
        heads = config["num_attention_heads"]
        q_rank = 48 if config.get("q_lora_rank") is not None else None
        config.update(num_key_value_heads=heads, kv_lora_rank=32, q_lora_rank=q_rank)
        config.update(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    config.update(overrides)
    if "kv_lora_rank" in config:  # the rotary tables' width, as the config class derives it
        config["head_dim"] = config["qk_rope_head_dim"]
    if "num_experts_per_tok" in config:
        config.update(num_experts_per_tok=2, output_router_logits=True)
    if "linear_num_value_heads" in config:  # qwen3_5_text: a gated DeltaNet layer, then a full
        # attention one; DeltaNet heads as the attention's, twice as many value as key heads
        layers = overrides.get("num_hidden_layers", config["num_hidden_layers"])
        kinds = ("linear_attention", "full_attention")
        config.update(
            layer_types=[kinds[i % 2] for i in range(layers)],
            linear_num_key_heads=config["num_key_value_heads"],
            linear_num_value_heads=2 * config["num_key_value_heads"],
            linear_key_head_dim=config["head_dim"],
            linear_value_head_dim=config["head_dim"],
        )
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "llama_4_scaling_beta" in rope:
        # Ministral 3: positions from 4 on get a query factor other than 1, so that it matters
        config["rope_parameters"] = {**rope, "original_max_position_embeddings": 4}
    config.update(overrides)
    return config


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    config = shrink(catalog_config(FAMILIES[family]), **overrides)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random model of the family (eager attention, train mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(dtype).train()


def pair(family: str, dtype: torch.dtype = torch.float32, **overrides):
    """(reference, twin): two models of the family with the same weights."""
    reference = build(family, dtype, **overrides)
    return reference, copy.deepcopy(reference)


def batch(seed: int = 1, b: int = 2, t: int = 12, vocab: int = 256, pad: int = 3):
    """input_ids, attention_mask and labels; the last `pad` tokens of row 0 are padding
    (mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (b, t), generator=g)
    attention_mask = torch.ones(b, t, dtype=torch.long)
    labels = input_ids.clone()
    if pad:
        attention_mask[0, -pad:] = 0
        labels[0, -pad:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in fp32."""
    actual, expected = actual.detach().float(), expected.detach().float()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_grads_close(reference, patched, tol: float) -> None:
    """Every parameter gradient of `patched` within relative error tol of `reference`'s, or of
    a thousandth of the largest gradient's norm where it is smaller than that (a gradient a
    thousand times below the largest, as a DeltaNet's dt_bias beside MoE blocks, is rounding)."""
    named = dict(patched.named_parameters())
    norms = [p.grad.detach().float().norm() for p in reference.parameters() if p.grad is not None]
    floor = 1e-3 * max(norms, default=torch.tensor(0.0))
    checked = 0
    for name, param in reference.named_parameters():
        other = named[name]
        if param.grad is None:
            assert other.grad is None, name
            continue
        assert other.grad is not None, name
        diff = (other.grad.detach().float() - param.grad.detach().float()).norm()
        err = (diff / torch.maximum(param.grad.detach().float().norm(), floor)).item()
        assert err <= tol, f"grad of {name}: relative error {err:.2e} > {tol:.0e}"
        checked += 1
    assert checked > 0


def lockstep(
    reference,
    patched,
    steps: int,
    loss_tol: float,
    grad_tol: float | None,
    lr: float = 1e-3,
    pad: int = 3,
):
    """AdamW steps on both models with the same batches: at every step the patched loss must be
    within loss_tol of the reference's, and at the first step every gradient within grad_tol
    (None: not checked). Later steps' gradients are not compared: Adam's first update is about
    lr * sign(g), so entries with |g| near rounding noise move the two models apart by ~lr,
    which says nothing about the kernels. `pad`: padding tokens in each batch's first row.
    Returns both loss lists."""
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=lr)
    opt_pat = torch.optim.AdamW(patched.parameters(), lr=lr)
    losses_ref, losses_pat = [], []
    for step in range(steps):
        inputs = batch(seed=step, pad=pad)
        out_ref, out_pat = reference(**inputs), patched(**inputs)
        out_ref.loss.backward()
        out_pat.loss.backward()
        err = rel_err(out_pat.loss, out_ref.loss)
        assert err <= loss_tol, f"step {step}: loss {out_pat.loss.item()} vs {out_ref.loss.item()}"
        if step == 0 and grad_tol is not None:
            assert_grads_close(reference, patched, grad_tol)
        opt_ref.step()
        opt_pat.step()
        opt_ref.zero_grad(set_to_none=True)
        opt_pat.zero_grad(set_to_none=True)
        losses_ref.append(out_ref.loss.item())
        losses_pat.append(out_pat.loss.item())
    return losses_ref, losses_pat
