"""The `memplan` command line. Thin: parses options, calls the library, prints with rich.
Results go to stdout; `Error:` lines to stderr (exit 2 for usage, 1 otherwise). Nothing on the
advise path imports torch or transformers; MEMPLAN_DEBUG=1 shows tracebacks."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from memplan.errors import MemplanError, positive_int


def console():
    """rich wraps at 80 columns when stdout is not a terminal; tables read better wider. rich
    exits 1 when the reader closes stdout; memplan exits 0 (_reader_left)."""
    from rich.console import Console

    out = Console(width=None if sys.stdout.isatty() else 100)
    out.on_broken_pipe = _reader_left  # type: ignore[method-assign]
    return out


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        # click turns a closed stdout into exit 1; the reader left with what it wanted
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _reader_left()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
    type=click.Choice(
        ["adamw", "adamw-fused", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor"]
    ),
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
@click.option(
    "--alloc-conf",
    help="PYTORCH_CUDA_ALLOC_CONF of the training run (default: this environment's), e.g. "
    "expandable_segments:True",
)
@click.option(
    "--safety-margin",
    help="memory to keep free of the allocator's capacity: a size (2GiB) or a share (5%%)",
)
@click.option(
    "--method",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "analytic", "traced"]),
    help="analytic: the registry's memory contracts only (under 1 s); traced: run the model's "
    "transformers code on meta tensors (torch + transformers, seconds); auto: analytic for "
    "registry families, traced otherwise, and at the edge of the GPU's memory the verdict from "
    "the traced step where it applies (seconds)",
)
@click.option(
    "--gpus",
    default="1",
    show_default=True,
    help="data-parallel ranks, each running --batch sequences; the prediction is rank 0's",
)
@click.option(
    "--strategy",
    type=click.Choice(["ddp", "fsdp2", "zero1", "zero2", "zero3"]),
    help="how the ranks split the model (needed with --gpus > 1): DDP, FSDP2, DeepSpeed ZeRO "
    "stage 1/2/3, as accelerate runs them",
)
@click.option(
    "--reshard-after-forward/--no-reshard-after-forward",
    default=True,
    show_default=True,
    help="FSDP2: decoder layers free their gathered weights after forward",
)
@click.option(
    "--cpu-offload",
    is_flag=True,
    help="FSDP2: weights, gradients and optimizer states on the CPU; ZeRO: optimizer states "
    "(and, at stage 3, weights)",
)
@click.option(
    "--count-vision-tower",
    type=click.Choice(["frozen", "trained"]),
    help="a multimodal config (gemma3, mistral3): count its vision tower and projector, "
    "frozen (weights; also a trainable tower under text-only batches, which gets no gradient) "
    "or trained (weights, gradients, optimizer states); never their activations. Default: "
    "the text model alone",
)
@click.option(
    "--deltanet-kernels",
    type=click.Choice(["auto", "torch", "fla"]),
    default="auto",
    show_default=True,
    help="Qwen3.5 and Qwen3-Next: whose chunked delta rule runs the gated DeltaNet layers, "
    "transformers' torch fallback or flash-linear-attention's kernels; auto: fla where it "
    "imports here, as transformers decides",
)
@click.option(
    "--deltanet-conv",
    type=click.Choice(["auto", "torch", "causal_conv1d"]),
    default="auto",
    show_default=True,
    help="Qwen3.5 and Qwen3-Next: whose causal conv runs in the gated DeltaNet layers, torch's "
    "or causal-conv1d's kernel; auto: causal-conv1d where it imports here, as transformers "
    "decides",
)
@click.option(
    "--transformers",
    help="the transformers release that will run the step, e.g. 5.24.0 (default: the "
    "installed one); the prediction follows what changed between releases",
)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
@click.option(
    "--verbose", "-v", is_flag=True, help="add the breakdown, kernel and suggestion tables"
)
def advise(**opts: Any) -> None:
    """Predict the peak memory of a training step and say what to switch on."""
    from memplan.advisor import advise as run_advise

    lora_rank = positive_int("--lora-rank", opts["lora_rank"])
    targets = opts["lora_targets"]
    if targets is not None:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    from memplan.estimators.allocator import parse_alloc_conf

    # The run's allocator setting, as PyTorch itself reads it from the environment.
    conf = opts["alloc_conf"]
    if conf is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
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
        expandable_segments=parse_alloc_conf(conf),
        safety_margin=opts["safety_margin"],
        method=None if opts["method"] == "auto" else opts["method"],
        transformers=opts["transformers"],
        gpus=positive_int("--gpus", opts["gpus"]),
        strategy=opts["strategy"],
        reshard_after_forward=opts["reshard_after_forward"],
        cpu_offload=opts["cpu_offload"],
        count_vision_tower=opts["count_vision_tower"],
        deltanet_kernels=None if opts["deltanet_kernels"] == "auto" else opts["deltanet_kernels"],
        deltanet_conv=None if opts["deltanet_conv"] == "auto" else opts["deltanet_conv"],
    )
    from memplan.versions import warn_if_unvalidated

    warn_if_unvalidated()  # on stderr, after the input was found good: errors stay one line
    if opts["as_json"]:
        click.echo(advice.model_dump_json(indent=2))
        return
    from memplan.render import print_advice

    print_advice(advice, console(), verbose=opts["verbose"])


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
@click.option(
    "--json", "as_json", is_flag=True, help="print each GPU's name, memory and compute capability"
)
def gpus(as_json: bool) -> None:
    """List the catalog of GPUs."""
    from memplan.catalog import DEFAULT_GPU, list_gpus
    from memplan.render import gib

    if as_json:
        import json

        listing = {
            key: {
                "name": gpu.name,
                "memory_bytes": gpu.memory_bytes,
                "capacity_bytes": gpu.capacity,
                "capacity_measured": gpu.capacity_measured,
                "compute_capability": list(gpu.compute_capability),
                "default": key == DEFAULT_GPU,
            }
            for key, gpu in list_gpus()
        }
        click.echo(json.dumps(listing, indent=2))
        return
    from rich.table import Table

    table = Table(title="GPUs")
    table.add_column("name")
    table.add_column("memory", justify="right")
    table.add_column("compute capability", justify="right")
    for key, gpu in list_gpus():
        default = " \\[default]" if key == DEFAULT_GPU else ""
        major, minor = gpu.compute_capability
        table.add_row(f"{key} ({gpu.name}){default}", gib(gpu.memory_bytes), f"{major}.{minor}")
    console().print(table)


@cli.command("check-contracts")
@click.option("--model", required=True, help="a registry family's catalog name or config.json")
@click.option("--batch", default="2", show_default=True)
@click.option("--seq", default="1024", show_default=True)
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
    type=click.Choice(["adamw", "adam", "sgd", "sgd-momentum", "adafactor"]),
)
@click.option("--grad-checkpointing", is_flag=True)
@click.option("--attn", default="sdpa", show_default=True, type=click.Choice(["sdpa", "eager"]))
@click.option("--lora-rank", help="LoRA rank (peft, alpha 32, no dropout)")
@click.option("--lora-targets", help="comma list of the linears LoRA adapts")
@click.option("--grad-accum", default="1", show_default=True)
@click.option("--layers", help="cut the model to its first N decoder layers (faster)")
@click.option(
    "--tolerance",
    default=1.0,
    show_default=True,
    type=float,
    help="largest |peak difference| in % of the analytic peak that passes",
)
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON")
def check_contracts(**opts: Any) -> None:
    """Compare a family's hand-written memory contracts with its code traced on the installed
    torch and transformers; exit 1 when the peaks differ by more than --tolerance."""
    from memplan.catalog import resolve_model
    from memplan.estimators.params import default_lora_targets
    from memplan.schema import make_setup
    from memplan.verify.predict import with_layers

    spec = resolve_model(opts["model"])
    layers = positive_int("--layers", opts["layers"])
    if layers is not None:
        spec = with_layers(spec, layers)
    lora_rank = positive_int("--lora-rank", opts["lora_rank"])
    targets = opts["lora_targets"]
    setup = make_setup(
        batch=positive_int("--batch", opts["batch"]),
        seq=positive_int("--seq", opts["seq"]),
        precision=opts["precision"],
        optimizer=opts["optimizer"],
        grad_checkpointing=opts["grad_checkpointing"],
        attn=opts["attn"],
        lora_rank=lora_rank,
        lora_targets=tuple(t.strip() for t in targets.split(",") if t.strip())
        if targets
        else default_lora_targets(spec),
        grad_accum=positive_int("--grad-accum", opts["grad_accum"]),
    )
    try:
        from memplan.traced.compare import compare
    except ImportError as exc:
        raise MemplanError(
            f"check-contracts traces the model: it needs torch and transformers ({exc})"
        ) from exc
    result = compare(spec, setup)
    passed = result.agrees(opts["tolerance"])
    if opts["as_json"]:
        import json

        rows = [
            {
                "what": r.what,
                "analytic": r.analytic,
                "traced": r.traced,
                "difference_pct": r.difference_pct,
            }
            for r in result.rows
        ]
        click.echo(
            json.dumps(
                {
                    "model": result.model,
                    "setup": setup.model_dump(),
                    "rows": rows,
                    "attention_kernels": result.traced.attention_kernels,
                    "agrees": passed,
                },
                indent=2,
            )
        )
    else:
        from memplan.render import print_comparison

        print_comparison(result, opts["tolerance"], console())
    if not passed:
        sys.exit(1)


def _register_verify() -> None:
    from memplan.verify.cli import report_command, verify_command

    cli.add_command(verify_command, "verify")
    cli.add_command(report_command, "report")


_register_verify()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:  # a bare `memplan` asks what it can do: the help, exit 0
        with click.Context(cli, info_name="memplan", **cli.context_settings) as ctx:
            click.echo(cli.get_help(ctx))
        sys.exit(0)
    try:
        # Without standalone mode click returns a command's ctx.exit() code instead of exiting.
        code = cli.main(args=args, prog_name="memplan", standalone_mode=False)
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
        click.echo(f"Error: {getattr(exc, 'cli_message', None) or exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_left()
    sys.exit(code if isinstance(code, int) else 0)


def _reader_left() -> None:
    """The reader of stdout closed it (`memplan advise ... | head -1`): it has what it wanted.
    Exit 0 without a traceback, with stdout pointed at /dev/null so that Python's own flush at
    exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)
