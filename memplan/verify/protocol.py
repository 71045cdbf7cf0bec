"""The constants of the measurement protocol (docs/measurement_protocol.md) shared by
the parent (`memplan verify`) and its child process, and the names of cases. No torch here."""

from __future__ import annotations

from memplan.schema import TrainSetup

LEARNING_RATE = 1e-5
LORA_ALPHA = 32
SGD_MOMENTUM = 0.9

# Exit codes of `python -m memplan.verify.worker`; the parent reads the result file either way.
EXIT_OK = 0
EXIT_OOM = 3
EXIT_NO_GPU = 4
EXIT_BUILD = 5
EXIT_RUN = 6

# Exit code of `memplan verify` when every case ran but at least one ran out of memory.
CLI_EXIT_OOM = 3


_SHORT_KERNEL_NAMES = {
    "rms_norm": "rms",
    "layer_norm": "ln",
    "cross_entropy": "ce",
    "embedding": "emb",
    "sink_attention": "sinks",
}


def case_name(model: str, setup: TrainSetup, *, liger: bool = False) -> str:
    """A short, unique, file-name-safe name: llama-3.2-1b_b8_s2048_bf16_gc_rms+rope+swiglu+flce."""
    parts = [model.replace("/", "--"), f"b{setup.batch}", f"s{setup.seq}", setup.precision]
    if setup.optimizer != "adamw":
        parts.append(setup.optimizer)
    if setup.grad_checkpointing:
        parts.append("gc")
    if setup.attn != "sdpa":
        parts.append(setup.attn)
    if setup.lora_rank is not None:
        parts.append(f"lora{setup.lora_rank}-{'+'.join(setup.lora_targets)}")
    if setup.grad_accum > 1:
        parts.append(f"acc{setup.grad_accum}")
    if setup.expandable_segments:
        parts.append("expandable")
    if setup.deltanet_kernels != "torch":
        parts.append(setup.deltanet_kernels)
    if setup.deltanet_conv != "torch":
        parts.append("causal-conv1d")
    if setup.strategy is not None:
        parts.append(f"{setup.strategy}x{setup.gpus}")
        if not setup.reshard_after_forward:
            parts.append("keep")
        if setup.cpu_offload:
            parts.append("offload")
    if liger:
        parts.append("liger")
    elif setup.kernels:
        parts.append("+".join(_SHORT_KERNEL_NAMES.get(k, k) for k in setup.kernels))
        if setup.flce_chunk is not None:
            parts.append(f"chunk{setup.flce_chunk}")
        if setup.flce_memory_budget is not None:
            parts.append(f"budget{-(-setup.flce_memory_budget // 2**20)}MiB")
    else:
        parts.append("hf")
    return "_".join(parts)
