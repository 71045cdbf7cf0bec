"""Measure what the caching allocator can reserve on this GPU in a training process: the GPU's
memory less the CUDA context and the library modules and handles a training step loads (the
`capacity_bytes` of memplan/catalog/gpus.json).

    python benchmarks/measure_gpu_capacity.py [--out FILE]

In a fresh process: initialise CUDA, run a few training steps of a small Llama with and without
memplan's kernels (cuBLAS, SDPA's flash and memory-efficient kernels, Triton, fused and foreach
AdamW load their modules), release the cache, then reserve 2 MiB-aligned blocks until the
allocator raises out of memory. Prints and writes (JSON) the total, what cudaMemGetInfo reported
at each stage, and the bytes reserved at the end."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20

TINY_LLAMA = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


def warm_up() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.patching import apply

    config = AutoConfig.for_model("llama", **TINY_LLAMA)
    for dtype, kernels, fused in (
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, True),
        (torch.float32, False, False),
    ):
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if kernels:
            apply(model)  # every kernel llama supports
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
        ids = torch.randint(0, 32000, (2, 512), device="cuda")
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del model, opt, ids
    torch.cuda.synchronize()


def reservable_bytes() -> int:
    """Reserve blocks of 8 GiB, halving at each out-of-memory down to 16 MiB (each its own
    segment), then 10 MiB, then 1 MiB requests (two per 2 MiB small-pool segment)."""
    import torch

    held = []
    for size in [8 * 2**30 >> i for i in range(10)] + [10 * MIB, MIB]:
        while True:
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    reserved = torch.cuda.memory_reserved()
    del held
    return reserved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    import torch

    torch.cuda.init()
    free_at_init, total = torch.cuda.mem_get_info()
    warm_up()
    gc.collect()
    torch.cuda.empty_cache()
    free_after_warm_up, _ = torch.cuda.mem_get_info()
    still_reserved = torch.cuda.memory_reserved()  # cuBLAS workspaces stay allocated
    reservable = reservable_bytes()
    result = {
        "device_name": torch.cuda.get_device_name(),
        "total_bytes": total,
        "free_at_init_bytes": free_at_init,
        "free_after_warm_up_bytes": free_after_warm_up,
        "reserved_after_warm_up_bytes": still_reserved,
        "non_allocator_bytes": total - free_after_warm_up - still_reserved,
        "capacity_bytes": reservable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
