"""Human-readable output of `memplan advise`: the verdict and what to do first, then the setup,
the kernels and what is alive at the peak, then a legend of the terms used; `verbose` adds the
breakdown, every kernel set's predicted peak and every suggestion as tables.

Every "does it fit" here is the advisor's (Advice.fits, Suggestion.fits); what the verdict says
is built in verdict_lines alone."""

from __future__ import annotations

import io
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memplan.advisor import MAX_BATCH_SEARCHED
from memplan.catalog import DEFAULT_GPU, resolve_gpu
from memplan.schema import NOMINAL_OUTSIDE_ALLOCATOR, Advice, TrainSetup

GIB = 2**30

BREAKDOWN_LABELS = {
    "activations": "the activations saved for backward",
    "logits_and_loss": "the logits and the loss",
    "kv_cache": "the KV cache transformers builds in training",
    "autocast_cache": "the weight copies autocast caches in forward",
    "embedding_leaf": "the embedding output and its gradient that the loss's graph keeps",
    "transient": "the temporaries of the op at the peak",
}

STRATEGY_NAMES = {
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}

PRECISION_TERMS = {
    "bf16": "weights, gradients and optimizer states all in bf16 (no fp32 master copy)",
    "amp-bf16": "fp32 weights, gradients and optimizer states; autocast runs the matmuls in bf16",
    "amp-fp16": "fp32 weights, gradients and optimizer states; autocast runs the matmuls in "
    "fp16, with a loss scaler",
    "fp32": "weights, gradients, optimizer states and every op in fp32",
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


# ---------------------------------------------------------------------------------- verdict


def verdict_lines(advice: Advice) -> list[str]:
    """The answer: fits or not, on which GPU, the predicted peak against what is usable, the
    headroom, and when it does not fit, why. Rich markup."""
    setup, est, gpu = advice.setup, advice.estimate, advice.gpu
    limit = capacity(advice)
    reserved = est.reserved
    default = resolve_gpu(DEFAULT_GPU)
    assumed = " (the default GPU)" if gpu == default else ""
    head = f"[bold]{escape(advice.model)}[/bold], batch {setup.batch} x seq {setup.seq}"
    on = escape(gpu.name) + assumed
    if setup.strategy is not None:
        per = " per rank" if setup.gpus > 1 else ""
        head += per
        offload = " and CPU offload" if setup.cpu_offload else ""
        on = f"{setup.gpus} x {on} with {STRATEGY_NAMES[setup.strategy]}{offload} (rank 0's peak)"
    if advice.fits:
        lines = [f"{head} on {on}: [green]fits[/green], {gib(advice.headroom_bytes)} headroom."]
    else:
        where = f" ({reserved.oom_phase}, {reserved.oom_label})" if reserved else ""
        lines = [f"{head} on {on}: [red]does not fit[/red], out of memory{escape(where)}."]
    source = (
        "measured"
        if gpu.capacity_measured
        else f"nominal: {gib(gpu.memory_bytes)} less {gib(NOMINAL_OUTSIDE_ALLOCATOR)} that a "
        "training process uses outside the allocator, measured on an H100"
    )
    margin = (
        f", less a {gib(advice.safety_margin_bytes)} safety margin"
        if advice.safety_margin_bytes
        else ""
    )
    allocator = "expandable segments" if setup.expandable_segments else "default settings"
    if reserved is not None and advice.fits:
        predicted = f"{gib(advice.peak_bytes)} allocated, {gib(reserved.reserved_bytes)} reserved"
    else:
        predicted = f"{gib(advice.peak_bytes)} allocated"
    lines.append(
        f"Predicted peak {predicted} (PyTorch's caching allocator, {allocator}, replayed); "
        f"the allocator can reserve {gib(gpu.capacity)} ({source}){margin}."
    )
    if advice.fits:
        return lines
    if advice.peak_bytes <= limit:
        lines.append(
            f"Why: the allocated peak fits the {gib(limit)}, but the allocator's cache is too "
            "fragmented by then to place the next block."
        )
        return lines
    step = [p for p in est.timeline if p.phase == "optimizer"]
    weights = est.breakdown.get("weights", 0)
    if weights > limit:
        lines.append(
            f"Why: the weights alone hold {gib(weights)}, more than the {gib(limit)} usable, "
            "whatever the batch or the trainable parameters: shard them across GPUs (FSDP/ZeRO) "
            "or load them quantized."
        )
    elif step and step[-1].allocated_bytes > limit:
        fewer = "" if setup.lora_rank else "fewer trainable parameters (LoRA) or "
        lines.append(
            "Why: whatever the batch, the optimizer step alone holds "
            f"{gib(step[-1].allocated_bytes)} "
            f"(weights, their gradients, {setup.optimizer} states and the step's temporaries), "
            f"more than the {gib(limit)} usable: {fewer}sharding across GPUs (FSDP/ZeRO) is "
            "needed."
        )
    elif est.breakdown:
        name, nbytes = max(est.breakdown.items(), key=lambda kv: kv[1])
        label = BREAKDOWN_LABELS.get(name, name.replace("_", " "))
        lines.append(
            f"Why: at batch {setup.batch} x seq {setup.seq} the largest part of the peak is "
            f"{label} ({gib(nbytes)})."
        )
    return lines


def capacity(advice: Advice) -> int:
    """What the allocator may reserve: the GPU's capacity less the safety margin."""
    return advice.gpu.capacity - advice.safety_margin_bytes


def headroom(advice: Advice, reserved_bytes: int) -> int:
    """What is left of the capacity at this reserved peak."""
    return capacity(advice) - reserved_bytes


# ---------------------------------------------------------------------------------- the plan


def apply_line(setup: TrainSetup) -> str | None:
    """The memplan.apply call that patches a model as the setup says (None: no kernels)."""
    if not setup.kernels:
        return None
    args = [f"kernels={json.dumps(list(setup.kernels))}"]
    if setup.flce_chunk is not None:
        args.append(f"flce_chunk={setup.flce_chunk}")
    if setup.flce_memory_budget is not None:
        args.append(f"flce_memory_budget={setup.flce_memory_budget}")
    return f"memplan.apply(model, {', '.join(args)})"


def lora_line(setup: TrainSetup) -> str | None:
    if not setup.lora_rank:
        return None
    return (
        f"peft.LoraConfig(r={setup.lora_rank}, "
        f"target_modules={json.dumps(list(setup.lora_targets))})"
    )


def training_arguments_line(setup: TrainSetup) -> str | None:
    """The Hugging Face TrainingArguments that run the step as predicted, when the plan splits
    the batch or checkpoints (None otherwise)."""
    fused = setup.optimizer == "adamw-fused"
    if setup.grad_accum == 1 and not setup.grad_checkpointing and not fused:
        return None
    args = [f"per_device_train_batch_size={setup.batch}"]
    if fused:
        args.append('optim="adamw_torch_fused"')
    if setup.grad_accum > 1:
        args.append(f"gradient_accumulation_steps={setup.grad_accum}")
    if setup.grad_checkpointing:
        args.append("gradient_checkpointing=True")
    amp = {"amp-bf16": "bf16=True", "amp-fp16": "fp16=True"}.get(setup.precision)
    if amp:
        args.append(amp)
    return f"TrainingArguments({', '.join(args)})"


def plan_code(setup: TrainSetup) -> list[str]:
    """Copy-paste lines for the setup: apply, LoRA, TrainingArguments (those that apply)."""
    environment = (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # in the environment, before CUDA starts"
        if setup.expandable_segments
        else None
    )
    lines = [environment, apply_line(setup), lora_line(setup), training_arguments_line(setup)]
    return [line for line in lines if line]


def _todo(advice: Advice) -> list[tuple[str, bool]]:
    """What to do first, as (line, is_code)."""
    if advice.fits:
        code = plan_code(advice.setup)
        if not code:
            return [("Run it as it is: no memplan kernel was asked for.", False)]
        return [("Do this:", False), *((line, True) for line in code)]
    if not advice.suggestions:
        return _gpu_lines(advice)
    first, *others = advice.suggestions
    if not first.fits:
        where = "one GPU" if advice.setup.gpus == 1 else f"{advice.setup.gpus} GPUs"
        return [
            (
                f"Nothing tried fits {where}; the closest: "
                f"{escape(first.description)}: {gib(first.peak_bytes)} predicted.",
                False,
            ),
            *_gpu_lines(advice),
        ]
    lines = [
        (
            f"Do this first: {escape(first.description)}.\n"
            f"  Predicted {gib(first.peak_bytes)} allocated, "
            f"{gib(headroom(advice, first.reserved_bytes))} headroom:",
            False,
        ),
        *((line, True) for line in plan_code(first.setup)),
    ]
    if others:
        lines.append(("Also fits:", False))
        lines += [(f"  - {escape(s.description)}: {gib(s.peak_bytes)}", False) for s in others]
    return lines + _gpu_lines(advice)


def _gpu_lines(advice: Advice) -> list[tuple[str, bool]]:
    """The fewest GPUs of this kind for each strategy, then accelerate's config of the fewest
    (the first listed among equals)."""
    if not advice.gpu_counts:
        return []
    lines = [(f"Across GPUs of this kind (each rank runs batch {advice.setup.batch}):", False)]
    for option in advice.gpu_counts:
        name = STRATEGY_NAMES[option.strategy]
        if option.gpus is None:
            why = f"{option.why_none} (rank 0 peaks at {gib(option.peak_bytes)})"
            lines.append((f"  - {name}: no number of GPUs: {escape(why)}", False))
            continue
        change = f", {escape(option.change)}" if option.change else ""
        lines.append(
            (
                f"  - {name}: {option.gpus} GPUs{change}: rank 0 peaks at "
                f"{gib(option.peak_bytes)} ({escape(option.checked)})",
                False,
            )
        )
    found = [o for o in advice.gpu_counts if o.gpus is not None and o.accelerate_config]
    if found:
        best = min(found, key=lambda o: o.gpus or 0)
        lines.append(
            (
                f"accelerate launch --config_file with this config runs {best.gpus} ranks of "
                f"{STRATEGY_NAMES[best.strategy]}:",
                False,
            )
        )
        lines += [(line, True) for line in (best.accelerate_config or "").splitlines()]
    return lines


# ---------------------------------------------------------------------------------- details


def _setup_line(advice: Advice) -> str:
    setup, est = advice.setup, advice.estimate
    options = [setup.precision, setup.optimizer, f"attention {setup.attn}"]
    if setup.grad_checkpointing:
        options.append("gradient checkpointing")
    if setup.lora_rank:
        options.append(f"LoRA r={setup.lora_rank} on {','.join(setup.lora_targets)}")
    if setup.grad_accum > 1:
        options.append(f"{setup.grad_accum} accumulation steps")
    if setup.count_vision_tower:
        options.append(f"vision tower counted, {setup.count_vision_tower}")
    if est.host_bytes:
        options.append(f"CPU offload: {gib(est.host_bytes)} of host memory per rank")
    return (
        f"Setup: {count(est.params)} parameters ({count(est.trainable_params)} trainable); "
        f"{', '.join(options)}."
    )


def _kernels_line(advice: Advice) -> str:
    plan = advice.plan
    if not plan.kernels:
        return "Kernels: none (plain Hugging Face)."
    parts = []
    for kernel in plan.kernels:
        saved = advice.kernel_savings.get(kernel)
        note = (
            ""
            if saved is None
            else ("for speed: saves no memory here" if saved == 0 else f"saves {gib(saved)}")
        )
        if kernel == "flce" and plan.flce_chunk:
            note += f"; chunk {plan.flce_chunk} rows"
        elif kernel == "flce" and plan.flce_memory_budget:
            note += f"; memory budget {gib(plan.flce_memory_budget)}"
        parts.append(f"{kernel} ({note})" if note else kernel)
    return f"Kernels: {', '.join(parts)}."


def _peak_line(advice: Advice) -> str:
    est = advice.estimate
    parts = ", ".join(
        f"{name.replace('_', ' ')} {gib(nbytes)}"
        for name, nbytes in sorted(est.breakdown.items(), key=lambda kv: -kv[1])
    )
    return f"At the peak ({est.peak_phase}: {est.peak_label}): {parts}."


def _max_batch_line(advice: Advice) -> str | None:
    if advice.max_batch is None:
        return None
    if advice.max_batch >= MAX_BATCH_SEARCHED:
        return (
            f"Largest batch that fits with these kernels: at least {advice.max_batch:,} "
            "(the search stops there)."
        )
    if advice.max_batch:
        return f"Largest batch that fits with these kernels: {advice.max_batch}."
    return "Largest batch that fits with these kernels: none, not even batch 1."


def _max_seq_line(advice: Advice) -> str | None:
    if not advice.max_seq:  # not even SEQ_STEP tokens: the largest batch's line says enough
        return None
    return f"Largest sequence that fits at batch {advice.setup.batch}: {advice.max_seq:,} tokens."


def legend_lines(advice: Advice, verbose: bool = False) -> list[tuple[str, str]]:
    """(term, meaning) for each term the output uses."""
    setup = advice.setup
    terms = [(setup.precision, PRECISION_TERMS[setup.precision])]
    shown = set(advice.plan.kernels)
    for s in advice.suggestions:
        shown |= set(s.setup.kernels)
    if verbose:
        shown |= {k for o in advice.kernel_options for k in o.kernels}
    if "flce" in shown:
        terms.append(
            (
                "flce",
                "fused linear cross entropy: lm_head and loss computed in chunks of rows, so "
                "the whole batch's logits never exist",
            )
        )
    if "transient" in advice.estimate.breakdown:
        terms.append(("transient", "the temporaries of the op running at the peak"))
    terms.append(("allocated", "what torch.cuda.max_memory_allocated() reports: the tensors alive"))
    terms.append(
        (
            "reserved",
            "torch.cuda.max_memory_reserved(): the segments PyTorch's caching allocator holds, "
            "allocated or cached; the step fits when, replayed through a model of that "
            "allocator, it never needs more than the GPU can give",
        )
    )
    return terms


def _legend(advice: Advice, verbose: bool) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(style="dim")
    for term, meaning in legend_lines(advice, verbose):
        grid.add_row(f"  {term}:", escape(meaning))
    return grid


def _breakdown_table(advice: Advice) -> Table:
    est = advice.estimate
    table = Table(title=f"Predicted peak, kernels: {describe_kernels(advice.setup.kernels)}")
    table.add_column("alive at the peak")
    table.add_column("bytes", justify="right")
    for name, nbytes in sorted(est.breakdown.items(), key=lambda kv: -kv[1]):
        table.add_row(name.replace("_", " "), gib(nbytes))
    table.add_row("[bold]peak (steady step)[/bold]", f"[bold]{gib(est.peak_bytes)}[/bold]")
    table.add_row("peak of step 1 (no optimizer states yet)", gib(est.peak_step1_bytes))
    return table


def _kernels_table(advice: Advice) -> Table:
    others_with_flce = any(
        "flce" in o.kernels and o.kernels != advice.plan.kernels for o in advice.kernel_options
    )
    table = Table(
        title="Kernel sets compared",
        caption="The plan's set at the plan's FLCE setting; other sets with flce at --flce-chunk, "
        "else at Liger's default chunk."
        if others_with_flce
        else None,
    )
    table.add_column("kernels")
    table.add_column("predicted peak", justify="right")
    table.add_column("vs none", justify="right")
    baseline = advice.kernel_options[0].peak_bytes if advice.kernel_options else advice.peak_bytes
    for option in advice.kernel_options:
        table.add_row(
            describe_kernels(option.kernels),
            gib(option.peak_bytes),
            f"{100 * (option.peak_bytes - baseline) / baseline:+.1f}%",
        )
    return table


def _suggestions_table(advice: Advice) -> Table:
    table = Table(title="What makes it fit" if advice.suggestions[0].fits else "Closest option")
    table.add_column("change (kernels as they are unless named)")
    table.add_column("predicted peak", justify="right")
    table.add_column("headroom", justify="right")
    for s in advice.suggestions:
        table.add_row(s.description, gib(s.peak_bytes), gib(headroom(advice, s.reserved_bytes)))
    return table


# ---------------------------------------------------------------------------------- output


def print_advice(advice: Advice, console: Console | None = None, *, verbose: bool = False) -> None:
    console = console or Console()
    for line in verdict_lines(advice):
        console.print(line)
    for warning in advice.warnings:  # one line each, as the terminal wraps it
        console.print(f"[yellow]Warning:[/yellow] {escape(warning)}", soft_wrap=True)
    console.print()
    for line, is_code in _todo(advice):
        if is_code:
            # one unwrapped line, no highlighting: it is meant to be copied
            console.print(f"    {line}", markup=False, highlight=False, soft_wrap=True)
        else:
            console.print(line)
    console.print()
    console.print(escape(_setup_line(advice)))
    console.print(escape(_kernels_line(advice)))
    console.print(escape(_peak_line(advice)))
    for line in (_max_batch_line(advice), _max_seq_line(advice)):
        if line:
            console.print(line)
    if verbose:
        console.print(_breakdown_table(advice))
        console.print(_kernels_table(advice))
        if advice.suggestions:
            console.print(_suggestions_table(advice))
    console.print()
    console.print("Terms:", style="dim")
    console.print(_legend(advice, verbose))
    if not verbose:
        console.print(
            "--verbose adds the breakdown, every kernel set's peak and the suggestions as tables.",
            style="dim",
        )


def advice_text(advice: Advice, *, verbose: bool = False, width: int = 100) -> str:
    """print_advice as plain text (no colour)."""
    out = io.StringIO()
    print_advice(advice, Console(file=out, width=width, color_system=None), verbose=verbose)
    return out.getvalue()


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
