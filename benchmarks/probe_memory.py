"""Probe what Hugging Face training really allocates, to write and check the estimator's memory
contracts. Two modes, both printing JSON:

  saved  one forward of a small model per family under saved_tensors_hooks: every saved
         activation (unique storages, parameters excluded) with the module that saved it;
         with --lora, of peft LoRA models (LORA_TARGETS per family) in every precision and
         attention, the protocol's adapters (r=16, alpha 32, no dropout).
  peak   the measurement protocol on one case with torch.cuda.memory._record_memory_history:
         the live blocks at the peak, grouped by the Python line that allocated them.

    python benchmarks/probe_memory.py saved --device cuda --out saved.json
    python benchmarks/probe_memory.py saved --lora --kernels all --out saved_lora_kernels.json
    python benchmarks/probe_memory.py peak --model llama32_1b_b8_s2048 --out peak.json
    python benchmarks/probe_memory.py peak --model qwen3-0.6b --batch 4 --seq 1024 \
        --precision amp-bf16 --kernels all --lora q_proj,v_proj --out peak.json

--model is a key of tests/data/reference_h200.json or a catalog name; --kernels (all, or a
comma list) patches the models with memplan.apply first, in both modes.
"""

from __future__ import annotations

import argparse
import collections
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
}


_ATTENTION_QV = ("q_proj", "v_proj")
_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_ALL = ("q_proj", "k_proj", "v_proj", "o_proj")

# Adapter placements probed per family: the protocol's default (q, v; qkv on phi3) and every
# linear of the layer; llama adds the single placements whose first-layer rules differ.
LORA_TARGETS: dict[str, tuple[tuple[str, ...], ...]] = {
    **{
        family: (_ATTENTION_QV, _ALL_LINEAR)
        for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
    },
    "phi3": (("qkv_proj",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("o_proj",)),
    "mixtral": (_ATTENTION_QV, _ATTENTION_ALL),
    "qwen3_moe": (_ATTENTION_QV, _ATTENTION_ALL),
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


def patch(model, kernels: str | None, flce_chunk: int | None = None) -> None:
    if not kernels:
        return
    import memplan

    names = None if kernels == "all" else kernels.split(",")
    memplan.apply(model, None, kernels=names, flce_chunk=flce_chunk)


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
                    except Exception as exc:  # a probe: record and go on
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


def run_peak(args) -> dict:
    with open("tests/data/reference_h200.json") as f:
        reference = json.load(f)
    if args.model in reference:
        case = reference[args.model]
        cfg_dict = dict(case["config"], model_type=case["model_type"])
    else:
        from memplan.catalog import resolve_model

        spec = resolve_model(args.model)
        cfg_dict = dict(spec.hf_config)
        case = {"batch": args.batch, "seq": args.seq, "options": {}}
    args.batch = args.batch or case["batch"]
    args.seq = args.seq or case["seq"]
    args.grad_ckpt = args.grad_ckpt or bool(case["options"].get("grad_ckpt"))
    if args.layers:
        cfg_dict["num_hidden_layers"] = args.layers
    cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    # Stacks on allocations only: capturing them on frees too loses the exception with which
    # non-reentrant checkpointing stops its recompute early (SystemError, torch 2.11).
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=args.attn)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    if args.lora:
        model = add_lora(model, tuple(args.lora.split(",")))
    patch(model, args.kernels, args.flce_chunk)
    model.train()
    after_model = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    peaks = []
    for _ in range(args.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "amp-bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(torch.cuda.max_memory_allocated())
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    # A block counts as allocated until the allocator frees it (free_completed), as
    # max_memory_allocated does: a block used on another stream is freed only after that
    # stream's work, later than the free request.
    live: dict[int, dict] = {}
    requested: set[int] = set()
    allocated = 0
    best = (0, -1, {}, set())
    history = []
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            allocated += ev["size"]
            if allocated > best[0]:
                best = (allocated, i, dict(live), set(requested))
        elif ev["action"] == "free_requested":
            requested.add(ev["addr"])
        elif ev["action"] == "free_completed":
            requested.discard(ev["addr"])
            old = live.pop(ev["addr"], None)
            if old is not None:
                allocated -= old["size"]
        if ev["action"] in ("alloc", "free_requested") and ev["size"] > 2**26:
            history.append((ev["action"], ev["size"], where(ev), allocated))
    groups: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    sizes: dict[str, list[int]] = collections.defaultdict(list)
    for ev in best[2].values():
        key = where(ev)
        groups[key] += ev["size"]
        counts[key] += 1
        sizes[key].append(ev["size"])
    pending: collections.Counter = collections.Counter()
    for addr in best[3]:
        if addr in best[2]:
            pending[where(best[2][addr])] += best[2][addr]["size"]
    peak_event = trace[best[1]]
    return dict(
        case=vars(args),
        after_model=after_model,
        peaks=peaks,
        traced_peak=best[0],
        peak_event=where(peak_event),
        freed_but_pending_at_peak=[dict(where=k, bytes=v) for k, v in pending.most_common(20)],
        live_at_peak=[
            dict(where=k, bytes=v, count=counts[k], largest=sorted(sizes[k])[-8:])
            for k, v in groups.most_common(60)
        ],
        big_events=history[-4000:],
    )


def where(ev: dict) -> str:
    frames = ev.get("frames") or []
    useful = [
        f
        for f in frames
        if f["filename"].endswith(".py")
        and "/torch/utils/" not in f["filename"]
        and "/torch/nn/modules/module.py" not in f["filename"]
    ]
    if not useful:
        return "<c++>"
    keep = useful[:3]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in keep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["saved", "peak"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--model", default="llama32_1b_b8_s2048", help="a key of tests/data/reference_h200.json"
    )
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kernels", help="patch with memplan first: all, or a comma list")
    ap.add_argument("--flce-chunk", type=int)
    ap.add_argument(
        "--lora",
        nargs="?",
        const="probe",
        help="saved: peft LoRA models (LORA_TARGETS); peak: a comma list of adapted linears",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.mode == "peak" and args.lora == "probe":
        ap.error("peak: --lora takes a comma list of the linears to adapt, e.g. q_proj,v_proj")
    if args.mode == "saved":
        result = run_saved(args.device, args.kernels, lora=args.lora is not None)
    else:
        result = run_peak(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
