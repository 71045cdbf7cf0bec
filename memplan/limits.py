"""The largest (and smallest) inputs advise accepts, each with the reason it is a bound.

Past these a prediction stops meaning anything (a micro-batch of 1e23 sequences), or the step
walk, which visits every layer, stops answering within seconds (100,000 layers). Each error
says the bound and why, in the Python API's names (batch) or the command line's (--batch)."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import MemplanError, option_error
from memplan.estimators.params import LORA_TARGET_SHAPES
from memplan.schema import SHARDING_STRATEGIES, STRATEGIES, ModelSpec

# advisor.largest_batch searches batches up to here (it says "at least" when that fits).
MAX_BATCH = 2**20
# 128x the longest context in the catalog (131,072 tokens).
MAX_SEQ = 2**24
# The peak is that of one micro-batch whatever the number after the second one.
MAX_GRAD_ACCUM = 2**20
# advise never picks fewer rows than this (advisor.choose_flce_chunk stops halving at 64).
MIN_FLCE_CHUNK = 64
# 16x the 16,384 GPUs Llama 3.1 405B trained on; the smallest-GPU-count search stops here.
MAX_GPUS = 2**18


@dataclass(frozen=True)
class SizeBound:
    most: int
    why: str


# The config sizes a model may have: several times those of the largest published decoders.
SPEC_BOUNDS: dict[str, SizeBound] = {
    "num_hidden_layers": SizeBound(
        512,
        "4x the 126 layers of Llama 3.1 405B; advise walks the step layer by layer some "
        "hundred times, and this bound keeps it within seconds",
    ),
    "hidden_size": SizeBound(2**17, "8x the 16,384 of Llama 3.1 405B"),
    "intermediate_size": SizeBound(2**19, "about 10x the 53,248 of Llama 3.1 405B"),
    "moe_intermediate_size": SizeBound(2**19, "as intermediate_size"),
    "vocab_size": SizeBound(2**22, "16x the 262,144 tokens of Gemma 3's vocabulary"),
    "num_attention_heads": SizeBound(2**12, "32x the 128 heads of Llama 3.1 405B"),
    "num_key_value_heads": SizeBound(2**12, "as num_attention_heads"),
    "head_dim": SizeBound(2**12, "16x the 256 of Gemma"),
    "num_experts": SizeBound(2**12, "16x the 256 routed experts of DeepSeek-V3"),
}


def check_setup(
    *,
    batch: int,
    seq: int,
    grad_accum: int,
    lora_rank: int | None = None,
    flce_chunk: int | None = None,
    gpus: int = 1,
) -> None:
    """UsageError for a count that is not a positive integer or is past its bound."""
    counts = {"batch": batch, "seq": seq, "grad_accum": grad_accum, "gpus": gpus}
    optional = {"lora_rank": lora_rank, "flce_chunk": flce_chunk}
    counts.update({name: value for name, value in optional.items() if value is not None})
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise option_error("{} must be a positive integer, got {value!r}", name, value=value)
    if batch > MAX_BATCH:
        raise option_error(
            "{} is the micro-batch (sequences per forward) and may be at most {most:,} (2**20), "
            "got {value:,}: the largest-batch search stops there; for a larger batch per "
            "optimizer step give a micro-batch and {}",
            "batch",
            "grad_accum",
            most=MAX_BATCH,
            value=batch,
        )
    if seq > MAX_SEQ:
        raise option_error(
            "{} may be at most {most:,} tokens (2**24, 128x the longest context in the catalog), "
            "got {value:,}",
            "seq",
            most=MAX_SEQ,
            value=seq,
        )
    if grad_accum > MAX_GRAD_ACCUM:
        raise option_error(
            "{} may be at most {most:,} (2**20) micro-batches per optimizer step, got {value:,} "
            "(the peak is that of one micro-batch whatever the count past 2)",
            "grad_accum",
            most=MAX_GRAD_ACCUM,
            value=grad_accum,
        )
    if flce_chunk is not None and flce_chunk < MIN_FLCE_CHUNK:
        raise option_error(
            "{} must be at least {least} rows, got {value}: fewer rows per chunk only add GEMM "
            "launches (one per chunk) and save next to nothing ({least} rows of logits of a "
            "256K vocabulary take 64 MiB in fp32); memplan itself never goes below {least}",
            "flce_chunk",
            least=MIN_FLCE_CHUNK,
            value=flce_chunk,
        )


def check_parallelism(
    gpus: int, strategy: str | None, reshard_after_forward: bool, cpu_offload: bool
) -> None:
    """UsageError for a GPU count past MAX_GPUS, an unknown strategy, or an option the
    strategy does not have."""
    if gpus > MAX_GPUS:
        raise option_error(
            "{} may be at most {most:,} (2**18), got {value:,}", "gpus", most=MAX_GPUS, value=gpus
        )
    if strategy is not None and strategy not in STRATEGIES:
        raise option_error(
            "{} must be one of {choices}, got {value!r}",
            "strategy",
            choices=", ".join(STRATEGIES),
            value=strategy,
        )
    if gpus > 1 and strategy is None:
        raise option_error(
            "{} {gpus} needs {} (one of {choices})",
            "gpus",
            "strategy",
            gpus=gpus,
            choices=", ".join(STRATEGIES),
        )
    if not reshard_after_forward and strategy != "fsdp2":
        raise option_error(
            "{} off is an FSDP2 setting: add {} fsdp2", "reshard_after_forward", "strategy"
        )
    if cpu_offload and strategy not in SHARDING_STRATEGIES:
        raise option_error(
            "{} needs a sharding {}: fsdp2, zero1, zero2 or zero3", "cpu_offload", "strategy"
        )


def check_lora_rank(spec: ModelSpec, rank: int, targets: tuple[str, ...]) -> None:
    """A LoRA rank above the smaller side of an adapted linear adds parameters and memory but
    no rank: the update B @ A of an (out x in) weight has rank at most min(in, out)."""
    most = largest_lora_rank(spec, targets)
    if most is None or rank <= most:
        return
    target = min(
        (t for t in targets if t in LORA_TARGET_SHAPES),
        key=lambda t: min(LORA_TARGET_SHAPES[t](spec)),
    )
    d_in, d_out = LORA_TARGET_SHAPES[target](spec)
    raise option_error(
        "{} {rank:,} is more than {target}'s smaller side ({d_in:,} -> {d_out:,}): the "
        "update of that weight has rank at most {most:,}, so a larger rank adds parameters "
        "and memory and nothing else; give at most {most:,}",
        "lora_rank",
        rank=rank,
        target=target,
        d_in=d_in,
        d_out=d_out,
        most=most,
    )


def check_spec(spec: ModelSpec) -> None:
    """MemplanError for a model size past SPEC_BOUNDS."""
    for field, bound in SPEC_BOUNDS.items():
        value = getattr(spec, field)
        if value > bound.most:
            raise MemplanError(
                f"the model's {field} is {value:,}; memplan takes at most {bound.most:,} "
                f"({bound.why})"
            )


def largest_lora_rank(spec: ModelSpec, targets: tuple[str, ...]) -> int | None:
    """The largest rank check_lora_rank accepts for these targets (None: no bound known)."""
    sides = [min(LORA_TARGET_SHAPES[t](spec)) for t in targets if t in LORA_TARGET_SHAPES]
    return min(sides) if sides else None
