"""The `memplan` command line. Thin: parses options, calls the library, prints with rich.
Results go to stdout; `Error:` lines to stderr (exit 2 for usage, 1 otherwise). Nothing on the
advise path imports torch or transformers; MEMPLAN_DEBUG=1 shows tracebacks."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from memplan.errors import MemplanError, UsageError, positive_int


def console():
    """rich wraps at 80 columns when stdout is not a terminal; tables read better wider."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def cli() -> None:
    """Predict the peak GPU memory of an LLM training step, pick fused kernels, verify."""


@cli.command()
@click.option("--model", required=True, help="catalog name, config.json / folder, or hub id")
@click.option("--batch", required=True, help="sequences per forward (micro-batch)")
@click.option("--seq", required=True, help="tokens per sequence")
@click.option("--gpu", help="GPU name (default H100 80GB); see `memplan gpus`")
@click.option(
    "--gpu-mem",
    help="GPU memory with a unit, e.g. 24GiB or 24GB (overrides --gpu's); a bare number is "
    "bytes, and it must exceed the CUDA context's 600 MiB",
)
@click.option(
    "--precision",
    default="bf16",
    show_default=True,
    type=click.Choice(["bf16", "amp-bf16", "amp-fp16", "fp32"]),
)
@click.option(
    "--optimizer",
    default="adamw",
    show_default=True,
    type=click.Choice(["adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor"]),
)
@click.option("--grad-checkpointing", is_flag=True, help="recompute each layer in backward")
@click.option("--attn", default="sdpa", show_default=True, type=click.Choice(["sdpa", "eager"]))
@click.option("--lora-rank", help="LoRA rank (base weights frozen)")
@click.option(
    "--lora-targets",
    help="comma list of the linears LoRA adapts (needs --lora-rank); default q_proj,v_proj, "
    "or qkv_proj on fused-qkv models (phi3); each must be a linear of the model",
)
@click.option(
    "--grad-accum", default="1", show_default=True, help="micro-batches per optimizer step"
)
@click.option(
    "--kernels",
    default="auto",
    show_default=True,
    help="auto | none | all | comma list of rms_norm,layer_norm,rope,swiglu,geglu,"
    "cross_entropy,flce,embedding (one loss kernel: cross_entropy or flce, not both)",
)
@click.option(
    "--flce-chunk",
    help="rows per fused-linear-cross-entropy chunk (default: chosen to fit); an error when "
    "--kernels leaves flce out",
)
@click.option("--trust-remote-code", is_flag=True, help="let a hub id's config run its own code")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def advise(**opts: Any) -> None:
    """Predict the peak memory of a training step and say what to switch on."""
    from memplan.advisor import advise as run_advise

    lora_rank = positive_int("--lora-rank", opts["lora_rank"])
    targets = opts["lora_targets"]
    if targets is not None and lora_rank is None:
        raise UsageError("--lora-targets needs --lora-rank")
    if targets is not None:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    advice = run_advise(
        opts["model"],
        positive_int("--batch", opts["batch"]),
        positive_int("--seq", opts["seq"]),
        gpu=opts["gpu"],
        gpu_mem=opts["gpu_mem"],
        precision=opts["precision"],
        optimizer=opts["optimizer"],
        grad_checkpointing=opts["grad_checkpointing"],
        attn=opts["attn"],
        lora_rank=lora_rank,
        lora_targets=targets,
        grad_accum=positive_int("--grad-accum", opts["grad_accum"]),
        kernels=opts["kernels"],
        flce_chunk=positive_int("--flce-chunk", opts["flce_chunk"]),
        trust_remote_code=opts["trust_remote_code"],
    )
    from memplan.versions import warn_if_unvalidated

    warn_if_unvalidated()  # on stderr, after the input was found good: errors stay one line
    if opts["as_json"]:
        click.echo(advice.model_dump_json(indent=2))
        return
    from memplan.render import print_advice

    print_advice(advice, console())


@cli.command()
@click.option(
    "--json", "as_json", is_flag=True, help="print each model's hub id, parameter count and config"
)
def models(as_json: bool) -> None:
    """List the catalog of models."""
    from memplan.catalog import list_model_entries
    from memplan.estimators import count_params

    entries = list_model_entries()
    if as_json:
        import json

        listing = {
            e.key: {
                "hf_id": e.hf_id,
                "params": count_params(e.spec).total,
                "config": e.spec.hf_config,
            }
            for e in entries
        }
        click.echo(json.dumps(listing, indent=2))
        return
    from rich.table import Table

    from memplan.render import count

    table = Table(title="memplan catalog")
    for header in ("name", "hub id", "type", "params", "layers", "hidden", "heads/kv", "vocab"):
        table.add_column(
            header, justify="left" if header in ("name", "hub id", "type") else "right"
        )
    for entry in entries:
        spec = entry.spec
        params = count_params(spec).total
        table.add_row(
            entry.key,
            entry.hf_id or "",
            spec.model_type,
            count(params),
            str(spec.num_hidden_layers),
            str(spec.hidden_size),
            f"{spec.num_attention_heads}/{spec.num_key_value_heads}",
            f"{spec.vocab_size:,}",
        )
    console().print(table)


@cli.command()
def gpus() -> None:
    """List the catalog of GPUs."""
    from rich.table import Table

    from memplan.catalog import list_gpus
    from memplan.render import gib

    table = Table(title="GPUs")
    table.add_column("name")
    table.add_column("memory", justify="right")
    for key, gpu in list_gpus():
        table.add_row(f"{key} ({gpu.name})", gib(gpu.memory_bytes))
    console().print(table)


def _register_verify() -> None:
    from memplan.verify.cli import report_command, verify_command

    cli.add_command(verify_command, "verify")
    cli.add_command(report_command, "report")


_register_verify()


def main(argv: list[str] | None = None) -> None:
    try:
        # Without standalone mode click returns a command's ctx.exit() code instead of exiting.
        code = cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Error: aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        if os.environ.get("MEMPLAN_DEBUG") == "1":
            raise
        click.echo(f"Error: {exc.format_message()}", err=True)
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except MemplanError as exc:
        if os.environ.get("MEMPLAN_DEBUG") == "1":
            raise
        click.echo(f"Error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
