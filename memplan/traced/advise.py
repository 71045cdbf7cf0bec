"""`memplan advise` for a model the families registry does not hold: the traced estimate, the
largest batch that fits, and what to change when it does not. No memplan kernel applies (the
patches come from the registry), so the plan is plain Hugging Face."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memplan.errors import UsageError
from memplan.schema import (
    Advice,
    Gpu,
    KernelOption,
    MemoryEstimate,
    Plan,
    Suggestion,
    TrainSetup,
    make_setup,
)
from memplan.traced import trace_config
from memplan.traced.batch import largest_traced_batch
from memplan.traced.estimate import TracedEstimate
from memplan.traced.model import default_lora_targets
from memplan.traced.verdict import replayed


def traced_advice(
    config: dict[str, Any],
    name: str,
    batch: int,
    seq: int,
    *,
    gpu: Gpu,
    precision: str = "bf16",
    optimizer: str = "adamw",
    grad_checkpointing: bool = False,
    attn: str = "sdpa",
    lora_rank: int | None = None,
    lora_targets: Iterable[str] | None = None,
    grad_accum: int = 1,
    kernels: str | Iterable[str] | None = "auto",
    flce_chunk: int | None = None,
    trust_remote_code: bool = False,
    reason: str = "",
) -> Advice:
    """The Advice of the traced step; `reason` is the warning line that says why (and that) the
    estimate is traced."""
    from memplan.advisor import fits

    model_type = str(config.get("model_type"))
    _no_kernels(kernels, flce_chunk, model_type)
    if isinstance(lora_targets, str):
        lora_targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
    targets = (
        default_lora_targets(model_type)
        if lora_targets is None
        else tuple(dict.fromkeys(lora_targets))
    )
    setup = make_setup(
        batch=batch,
        seq=seq,
        precision=precision,
        optimizer=optimizer,
        grad_checkpointing=grad_checkpointing,
        attn=attn,
        lora_rank=lora_rank,
        lora_targets=targets,
        grad_accum=grad_accum,
    )

    def trace(trial: TrainSetup):
        return trace_config(config, trial, gpu, name=name, trust_remote_code=trust_remote_code)

    traced = trace(setup)
    estimate = judged(traced, setup, gpu)
    warnings = [reason] if reason else []
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    if isinstance(positions, int) and seq > positions:
        warnings.append(f"seq {seq} is longer than the model's max_position_embeddings {positions}")
    # The largest batch whose allocated peak fits: an upper bound of the one that runs.
    max_batch, note = largest_traced_batch(trace, setup, traced, gpu.capacity)
    if note:
        warnings.append(note)
    fit = fits(estimate)
    assert estimate.reserved is not None
    return Advice(
        model=name,
        setup=setup,
        gpu=gpu,
        peak_bytes=estimate.peak_bytes,
        estimate=estimate,
        plan=Plan(
            kernels=(),
            micro_batch=batch,
            grad_accum=grad_accum,
            grad_checkpointing=grad_checkpointing,
            predicted_peak_bytes=estimate.peak_bytes,
        ),
        fits=fit,
        headroom_bytes=estimate.reserved.headroom_bytes,
        kernel_options=[KernelOption(kernels=(), peak_bytes=estimate.peak_bytes)],
        suggestions=[] if fit else _suggestions(trace, setup, max_batch, model_type, gpu),
        max_batch=max_batch,
        warnings=warnings,
    )


def judged(traced: TracedEstimate, setup: TrainSetup, gpu: Gpu) -> MemoryEstimate:
    """The traced estimate with its verdict: its event stream replayed through the allocator
    model with the GPU's capacity."""
    reserved = replayed(traced.events.events, setup, gpu)
    return traced.estimate.model_copy(update={"reserved": reserved})


def _no_kernels(
    kernels: str | Iterable[str] | None, flce_chunk: int | None, model_type: str
) -> None:
    names = (
        [k.strip() for k in kernels.split(",") if k.strip()]
        if isinstance(kernels, str)
        else list(kernels or ())
    )
    if names and names not in (["auto"], ["none"]):
        raise UsageError(
            f"no memplan kernel applies to {model_type} (it has no family entry; its estimate is "
            "traced from its transformers code): use --kernels none or auto"
        )
    if flce_chunk is not None:
        raise UsageError(f"--flce-chunk sets the flce kernel, which does not apply to {model_type}")


def _suggestions(
    trace: Any, setup: TrainSetup, max_batch: int | None, model_type: str, gpu: Gpu
) -> list[Suggestion]:
    """What makes the step fit, cheapest first, each traced: micro-batches with gradient
    accumulation, checkpointing, LoRA on the attention projections (with checkpointing)."""
    from memplan.advisor import fits

    sequences = setup.batch * setup.grad_accum
    ladder: list[tuple[str, dict]] = []
    if max_batch:
        micro = max(d for d in range(1, min(max_batch, setup.batch) + 1) if setup.batch % d == 0)
        accum = sequences // micro
        ladder.append(
            (
                f"micro-batch {micro} x {accum} accumulation steps",
                {"batch": micro, "grad_accum": accum},
            )
        )
    if not setup.grad_checkpointing:
        ladder.append(("gradient checkpointing (~30% slower steps)", {"grad_checkpointing": True}))
    if not setup.lora_rank:
        targets = default_lora_targets(model_type)
        lora = {"lora_rank": 16, "lora_targets": targets}
        on = f"LoRA r=16 on {', '.join(targets)}"
        ladder.append((f"{on} (base frozen)", lora))
        if not setup.grad_checkpointing:
            ladder.append(
                (f"{on} and gradient checkpointing", {**lora, "grad_checkpointing": True})
            )
    tried: list[Suggestion] = []
    for description, change in ladder:
        trial = setup.model_copy(update=change)
        # Every micro-step after the first is the same step: two show the peak of any number.
        traced_setup = trial.model_copy(update={"grad_accum": min(trial.grad_accum, 2)})
        try:
            estimate = judged(trace(traced_setup), trial, gpu)
        except Exception:  # noqa: BLE001 - a suggestion that cannot be traced is left out
            continue
        assert estimate.reserved is not None
        tried.append(
            Suggestion(
                description=description,
                setup=trial,
                peak_bytes=estimate.peak_bytes,
                fits=fits(estimate),
                reserved_bytes=estimate.reserved.reserved_bytes,
            )
        )
        if fits(estimate):
            return [tried[-1]]
    return sorted(tried, key=lambda s: s.peak_bytes)[:1]
