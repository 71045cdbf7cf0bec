"""Human-readable output of `memplan advise` (rich tables)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from memplan.advisor import ALLOCATOR_MARGIN, MAX_BATCH_SEARCHED, usable_bytes
from memplan.schema import Advice

GIB = 2**30

BREAKDOWN_LABELS = {
    "activations": "the activations saved for backward",
    "logits_and_loss": "the logits and the loss",
    "kv_cache": "the KV cache transformers builds in training",
    "autocast_cache": "the weight copies autocast caches in forward",
    "embedding_leaf": "the embedding output and its gradient that the loss's graph keeps",
    "transient": "the temporaries of the op at the peak",
}


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB"


def count(n: int) -> str:
    """A parameter count with three significant digits: 8.54B, 461K, 12.6M."""
    value, suffix = float(n), ""
    for larger in ("K", "M", "B", "T"):
        if float(f"{value:.3g}") < 1000:
            break
        value, suffix = value / 1000, larger
    return f"{value:.3g}{suffix}"


def describe_kernels(kernels: tuple[str, ...]) -> str:
    return ", ".join(kernels) if kernels else "none (plain Hugging Face)"


def print_advice(advice: Advice, console: Console | None = None) -> None:
    console = console or Console()
    setup, est, gpu = advice.setup, advice.estimate, advice.gpu
    options = [
        f"batch {setup.batch}",
        f"seq {setup.seq}",
        setup.precision,
        setup.optimizer,
        f"attn {setup.attn}",
    ]
    if setup.grad_checkpointing:
        options.append("gradient checkpointing")
    if setup.lora_rank:
        options.append(f"LoRA r={setup.lora_rank} on {','.join(setup.lora_targets)}")
    if setup.grad_accum > 1:
        options.append(f"grad accumulation {setup.grad_accum}")
    console.print(
        f"[bold]{advice.model}[/bold]: {count(est.params)} parameters "
        f"({count(est.trainable_params)} trainable); {', '.join(options)}"
    )
    for warning in advice.warnings:
        console.print(f"[yellow]Warning:[/yellow] {warning}")

    table = Table(title=f"Predicted peak, kernels: {describe_kernels(setup.kernels)}")
    table.add_column("alive at the peak")
    table.add_column("bytes", justify="right")
    for name, nbytes in sorted(est.breakdown.items(), key=lambda kv: -kv[1]):
        table.add_row(name.replace("_", " "), gib(nbytes))
    table.add_row("[bold]peak (steady step)[/bold]", f"[bold]{gib(est.peak_bytes)}[/bold]")
    table.add_row("peak of step 1 (no optimizer states yet)", gib(est.peak_step1_bytes))
    console.print(table)
    console.print(f"The peak falls in: {est.peak_phase} ({est.peak_label}).")

    others_with_flce = any(
        "flce" in o.kernels and o.kernels != advice.plan.kernels for o in advice.kernel_options
    )
    kernels = Table(
        title="Kernel sets compared",
        caption="The plan's set at the plan's FLCE setting; other sets with flce at --flce-chunk, "
        "else at Liger's default chunk."
        if others_with_flce
        else None,
    )
    kernels.add_column("kernels")
    kernels.add_column("predicted peak", justify="right")
    kernels.add_column("vs none", justify="right")
    baseline = advice.kernel_options[0].peak_bytes if advice.kernel_options else est.peak_bytes
    for option in advice.kernel_options:
        kernels.add_row(
            describe_kernels(option.kernels),
            gib(option.peak_bytes),
            f"{100 * (option.peak_bytes - baseline) / baseline:+.1f}%",
        )
    console.print(kernels)

    plan = advice.plan
    chunk = f", FLCE chunk {plan.flce_chunk} rows" if plan.flce_chunk else ""
    if plan.flce_memory_budget:
        chunk = (
            f", FLCE memory budget {gib(plan.flce_memory_budget)} (dW accumulated in fp32, "
            "three GEMMs per chunk)"
        )
    console.print(f"[bold]Plan:[/bold] kernels {describe_kernels(plan.kernels)}{chunk}.")
    limit = usable_bytes(gpu)
    verdict = "[green]fits[/green]" if advice.fits else "[red]does not fit[/red]"
    console.print(
        f"{gpu.name}: {gib(gpu.memory_bytes)}; usable by the allocator after the CUDA context and "
        f"a {100 * (1 - ALLOCATOR_MARGIN):.0f}% fragmentation margin: {gib(limit)}. "
        f"Predicted {gib(advice.peak_bytes)}: {verdict} "
        f"(headroom {gib(advice.headroom_bytes)})."
    )
    step = [p for p in est.timeline if p.phase == "optimizer"]
    weights = est.breakdown.get("weights", 0)
    if not advice.fits and weights > limit:
        console.print(
            f"Why: the weights alone hold {gib(weights)}, more than the {gib(limit)} usable, "
            "whatever the batch or the trainable parameters: shard them across GPUs (FSDP/ZeRO) "
            "or load them quantized."
        )
    elif not advice.fits and step and step[-1].allocated_bytes > limit:
        fewer = "" if setup.lora_rank else "fewer trainable parameters (LoRA) or "
        console.print(
            "Why: whatever the batch, the optimizer step alone holds "
            f"{gib(step[-1].allocated_bytes)} "
            f"(weights, their gradients, {setup.optimizer} states and the step's temporaries), "
            f"more than the {gib(limit)} usable: {fewer}sharding across GPUs (FSDP/ZeRO) is "
            "needed."
        )
    elif not advice.fits and est.breakdown:
        name, nbytes = max(est.breakdown.items(), key=lambda kv: kv[1])
        label = BREAKDOWN_LABELS.get(name, name.replace("_", " "))
        console.print(
            f"Why: at batch {setup.batch} x seq {setup.seq} the largest part of the peak is "
            f"{label} ({gib(nbytes)})."
        )
    if advice.max_batch is not None:
        if advice.max_batch >= MAX_BATCH_SEARCHED:
            console.print(
                f"Largest batch that fits with this plan: at least {advice.max_batch:,} "
                "(the search stops there)."
            )
        elif advice.max_batch:
            console.print(f"Largest batch that fits with this plan: {advice.max_batch}.")
        else:
            console.print("Not even batch 1 fits with this plan.")
    if advice.suggestions:
        fixes = Table(
            title="What makes it fit"
            if advice.suggestions[0].peak_bytes <= limit
            else "Closest option (nothing tried fits one GPU; shard with FSDP/ZeRO)"
        )
        fixes.add_column("change")
        fixes.add_column("predicted peak", justify="right")
        for suggestion in advice.suggestions:
            fixes.add_row(suggestion.description, gib(suggestion.peak_bytes))
        console.print(fixes)


def print_comparison(result: Any, tolerance_pct: float, console: Console | None = None) -> None:
    """`memplan check-contracts`: the analytic and the traced figures of one step."""
    import torch
    import transformers

    console = console or Console()
    setup = result.setup
    table = Table(
        title=f"{result.model}: memory contracts against the traced step (torch "
        f"{torch.__version__}, transformers {transformers.__version__})"
    )
    for header in ("figure", "analytic", "traced", "difference"):
        table.add_column(header, justify="left" if header == "figure" else "right")
    for row in result.rows:
        table.add_row(row.what, gib(row.analytic), gib(row.traced), f"{row.difference_pct:+.2f}%")
    console.print(
        f"batch {setup.batch}, seq {setup.seq}, {setup.precision}, {setup.optimizer}, "
        f"attn {setup.attn}"
        + (", gradient checkpointing" if setup.grad_checkpointing else "")
        + (
            f", LoRA r={setup.lora_rank} on {','.join(setup.lora_targets)}"
            if setup.lora_rank
            else ""
        )
    )
    console.print(table)
    est = result.traced.estimate
    kernels = ", ".join(f"{k} x{n}" for k, n in (result.traced.attention_kernels or {}).items())
    console.print(
        f"Peak: analytic {result.analytic.peak_phase} ({result.analytic.peak_label}), traced "
        f"{est.peak_phase} ({est.peak_label}). SDPA kernels traced: {kernels or 'none'}."
    )
    verdict = "agree" if result.agrees(tolerance_pct) else "[red]DISAGREE[/red]"
    console.print(
        f"The peaks {verdict} within {tolerance_pct:.2f}% ({result.peak_difference_pct:+.2f}%)."
    )
