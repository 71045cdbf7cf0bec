"""`memplan verify` and `memplan report` (registered on the main group by memplan/cli.py).

Results on stdout, progress and `Error:` lines on stderr. Exit codes: 0 all ok; 1 a failure
(no GPU, a model that does not build, a case that failed); 2 a malformed argument; 3 every case
ran but at least one ran out of memory (the result says above how many GiB)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from memplan.errors import MemplanError, UsageError, positive_int
from memplan.schema import Measurement, Report
from memplan.verify import protocol
from memplan.verify.distributed import MEASURED_STRATEGIES, TORCHRUN_STRATEGIES
from memplan.verify.runner import RANKS, with_ranks


def _one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MemplanError as exc:
            if os.environ.get("MEMPLAN_DEBUG") == "1":
                raise
            click.echo(f"Error: {getattr(exc, 'cli_message', None) or exc}", err=True)
            # SystemExit, not ctx.exit: click's main(standalone_mode=False) turns Exit into a
            # return value that the caller may drop
            sys.exit(exc.exit_code)

    return wrapper


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:.2f} GiB"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def _results_table(report: Report) -> Any:
    from rich.table import Table

    table = Table(title="memplan verify: predicted vs measured (torch.cuda.max_memory_allocated)")
    for header in (
        "case",
        "step 1 predicted",
        "step 1 measured",
        "peak predicted",
        "peak measured",
        "error",
        "reserved",
        "predicted peak phase",
        "tokens/s",
    ):
        table.add_column(
            header, justify="left" if header in ("case", "predicted peak phase") else "right"
        )
    for m in report.measurements:
        p = m.predicted
        if m.status == "oom":
            measured = f"out of memory above {_gib(m.oom_above_bytes)}"
        elif m.status == "error":
            measured = f"error: {m.error}"
        else:
            measured = _gib(m.peak_bytes)
        phase = "—"
        if p is not None:
            phase = f"{p.peak_phase} ({p.peak_label})" if p.peak_label else p.peak_phase
        elif m.prediction_error:
            phase = f"no prediction: {m.prediction_error}"
        table.add_row(
            m.case,
            _gib(p.peak_step1_bytes if p else None),
            _gib(m.peak_step1_bytes),
            _gib(p.peak_bytes if p else None),
            measured,
            _pct(m.error_pct),
            _gib(m.reserved_bytes),
            phase,
            f"{m.tokens_per_s:,.0f}" if m.tokens_per_s else "—",
        )
    return table


def _profile_tables(m: Measurement, top: int = 10) -> list[Any]:
    from rich.table import Table

    tables = []
    for key, prof in (m.profile or {}).items():
        table = Table(
            title=f"{m.case}: {key.replace('_', ' ')}, {prof.total_device_ms:.2f} ms GPU / step"
        )
        for header in ("operator", "ms / step", "calls / step", "share"):
            table.add_column(header, justify="left" if header == "operator" else "right")
        for op in prof.ops[:top]:
            table.add_row(op.name, f"{op.device_ms:.3f}", f"{op.calls:g}", f"{op.share:.1%}")
        tables.append(table)
    return tables


@click.command("verify")
@click.option("--model", help="catalog name, config.json / checkpoint folder, or hub id")
@click.option("--batch", help="sequences per forward (the micro-batch)")
@click.option("--seq", help="tokens per sequence")
@click.option("--gpu", help="GPU name for the advisor (default H100 80GB)")
@click.option("--gpu-mem", help="GPU memory for the advisor, e.g. 24GiB")
@click.option(
    "--precision", default="bf16", show_default=True, help="bf16 | amp-bf16 | amp-fp16 | fp32"
)
@click.option("--optimizer", default="adamw", show_default=True)
@click.option("--grad-checkpointing", is_flag=True)
@click.option("--attn", default="sdpa", show_default=True, help="sdpa | eager")
@click.option("--lora-rank", help="LoRA rank (peft, lora_alpha=32, dropout 0)")
@click.option(
    "--lora-targets",
    help="comma list of the linears LoRA adapts; default q_proj,v_proj, or qkv_proj on "
    "fused-qkv models (phi3)",
)
@click.option("--grad-accum", default="1", show_default=True)
@click.option(
    "--kernels",
    default="auto",
    show_default=True,
    help="auto | none | all | comma-separated kernel names",
)
@click.option("--flce-chunk", help="rows per fused-linear-cross-entropy chunk")
@click.option(
    "--gpus",
    default="1",
    show_default=True,
    help="ranks of data parallelism; rank 0 is measured, on this one GPU without --ranks "
    "torchrun (FSDP2 over a fake process group of that many ranks, DDP over one rank: its memory "
    "is any rank's)",
)
@click.option(
    "--strategy",
    type=click.Choice([*MEASURED_STRATEGIES, *TORCHRUN_STRATEGIES]),
    help="needed with --gpus > 1; DeepSpeed ZeRO (zero1/2/3, through accelerate) runs one "
    "torchrun process per GPU only",
)
@click.option(
    "--ranks",
    type=click.Choice(RANKS),
    default="auto",
    show_default=True,
    help="--gpus > 1: one torchrun process per GPU, or every rank simulated on one GPU; auto "
    "takes torchrun where this machine has a GPU per rank",
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
    help="FSDP2: shards, gradients and the optimizer step on the CPU (CPUOffloadPolicy); "
    "ZeRO's offload is predicted only (memplan advise)",
)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--steps", default="3", show_default=True, help="optimizer steps measured (>= 3)")
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    help="NAME=V1,V2,... e.g. --sweep batch=1,2,4 --sweep seq=1024,4096",
)
@click.option("--layers", help="build the model with only its first N decoder layers")
@click.option("--random-init", is_flag=True, help="random weights even where a checkpoint has real")
@click.option(
    "--timeline",
    is_flag=True,
    help="record the allocator history of one more step (for memplan report --plot)",
)
@click.option(
    "--profile",
    is_flag=True,
    help="top GPU operators by time, without and with the patch (extra processes)",
)
@click.option("--timeout", help="seconds after which a case's process is stopped")
@click.option("--out", type=click.Path(dir_okay=False), help="write the results JSON here")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@_one_line_errors
def verify_command(**opts: Any) -> None:
    """Measure the peak memory of real training steps on this GPU, next to the prediction."""
    from memplan.verify.api import NoGpuError
    from memplan.verify.cases import parse_sweeps, plan_cases

    lora_rank = positive_int("--lora-rank", opts["lora_rank"])
    _check_out(opts["out"])
    planned = plan_cases(
        opts["model"] or _missing("--model"),
        batch=positive_int("--batch", opts["batch"], required=True),
        seq=positive_int("--seq", opts["seq"], required=True),
        kernels=opts["kernels"],
        sweeps=parse_sweeps(opts["sweeps"]),
        gpu=opts["gpu"],
        gpu_mem=opts["gpu_mem"],
        steps=positive_int("--steps", opts["steps"]),
        timeline=opts["timeline"],
        layers=positive_int("--layers", opts["layers"]),
        trust_remote_code=opts["trust_remote_code"],
        random_init=opts["random_init"],
        precision=opts["precision"],
        optimizer=opts["optimizer"],
        grad_checkpointing=opts["grad_checkpointing"],
        attn=opts["attn"],
        lora_rank=lora_rank,
        lora_targets=(
            tuple(t.strip() for t in opts["lora_targets"].split(",") if t.strip())
            if opts["lora_targets"] is not None
            else None
        ),
        grad_accum=positive_int("--grad-accum", opts["grad_accum"]),
        flce_chunk=positive_int("--flce-chunk", opts["flce_chunk"]),
        **_parallelism(opts),
    )
    planned = [
        dataclasses.replace(item, case=with_ranks(item.case, opts["ranks"])) for item in planned
    ]
    timeout = positive_int("--timeout", opts["timeout"])
    try:
        report = _run_with_progress(planned, profile=opts["profile"], timeout_s=timeout)
    except NoGpuError as exc:
        if not exc.report.measurements:
            raise
        _show(exc.report, opts)  # the cases measured before the GPU went missing are kept
        where = f", written to {opts['out']}" if opts["out"] else ""
        raise MemplanError(f"{exc} ({len(exc.report.measurements)} measured{where})") from None
    _show(report, opts)
    _exit_for(report)


def _parallelism(opts: dict[str, Any]) -> dict[str, Any]:
    """The setup options of --gpus, --strategy, --no-reshard-after-forward and --cpu-offload,
    checked."""
    gpus = positive_int("--gpus", opts["gpus"])
    if gpus is not None and gpus > 1 and opts["strategy"] is None:
        raise UsageError(f"--gpus {gpus} needs --strategy ddp, fsdp2 or zero1/2/3")
    _check_offload(opts["strategy"], opts["cpu_offload"])
    if opts["strategy"] in TORCHRUN_STRATEGIES and importlib.util.find_spec("deepspeed") is None:
        raise MemplanError(
            f"--strategy {opts['strategy']} needs DeepSpeed, which this Python cannot import "
            "(pip install deepspeed)"
        )
    if not opts["reshard_after_forward"] and opts["strategy"] != "fsdp2":
        raise UsageError("--no-reshard-after-forward is an FSDP2 setting: add --strategy fsdp2")
    options: dict[str, Any] = {"gpus": gpus or 1, "strategy": opts["strategy"]}
    if not opts["reshard_after_forward"]:
        options["reshard_after_forward"] = False
    if opts["cpu_offload"]:
        options["cpu_offload"] = True
    return options


def _check_offload(strategy: str | None, offload: bool) -> None:
    """--cpu-offload is measured under FSDP2 only: DeepSpeed's offload steps with its CPU Adam,
    a compiled op that a DeepSpeed built without its ops (DS_BUILD_OPS=0) lacks."""
    if not offload or strategy == "fsdp2":
        return
    if strategy in TORCHRUN_STRATEGIES:
        raise UsageError(
            f"--strategy {strategy} with --cpu-offload is predicted only, not measured "
            "(DeepSpeed's CPU Adam needs its compiled ops): memplan advise predicts it"
        )
    raise UsageError("--cpu-offload needs --strategy fsdp2 (zero1/2/3: predicted only)")


def _show(report: Report, opts: dict[str, Any]) -> None:
    """The results: to --out, and on stdout as a table (or JSON), warnings on stderr."""
    from rich.console import Console

    from memplan.verify.report import measurement_warnings

    if opts["out"]:
        Path(opts["out"]).write_text(report.model_dump_json(indent=1))
    from memplan.cli import _reader_left

    console = Console()
    if not console.is_terminal:  # piped into a file: no wrapping at 80 columns
        console = Console(width=240)
    console.on_broken_pipe = _reader_left  # type: ignore[method-assign]
    if opts["as_json"]:
        click.echo(report.model_dump_json(indent=2))
    else:
        console.print(_results_table(report))
        for m in report.measurements:
            for table in _profile_tables(m):
                console.print(table)
            if m.profile_error:
                click.echo(f"profile: {m.profile_error}", err=True)
    for m in report.measurements:
        for warning in measurement_warnings(m):
            click.echo(f"Warning: {m.case}: {warning}", err=True)


def _check_out(path: str | None, option: str = "--out") -> None:
    """Refuse, before any work, a file that could not be written at the end."""
    if path is None:
        return
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name")


def _missing(option: str) -> Any:
    raise UsageError(f"{option} is required")


def _run_with_progress(planned: list[Any], *, profile: bool, timeout_s: int | None) -> Report:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memplan.verify.api import execute

    if len(planned) == 1:
        return execute(planned, profile=profile, timeout_s=timeout_s)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("measuring", total=len(planned))

        def on_start(i: int, item: Any) -> None:
            progress.update(task, description=f"measuring {item.case.case}")

        def on_result(i: int, m: Measurement) -> None:
            progress.advance(task)

        return execute(
            planned, profile=profile, timeout_s=timeout_s, on_start=on_start, on_result=on_result
        )


def _exit_for(report: Report) -> None:
    failed = [m for m in report.measurements if m.status == "error"]
    if failed:
        if len(report.measurements) == 1:
            raise MemplanError(failed[0].error or "the run failed")
        raise MemplanError(
            f"{len(failed)} of {len(report.measurements)} cases failed; first: "
            f"{failed[0].case}: {failed[0].error}"
        )
    oom = [m for m in report.measurements if m.status == "oom"]
    if oom:
        click.echo(
            f"measured: {len(oom)} of {len(report.measurements)} cases ran out of memory",
            err=True,
        )
        sys.exit(protocol.CLI_EXIT_OOM)


@click.command("report")
@click.argument("results", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), help="markdown file to write")
@click.option("--plot", is_flag=True, help="PNG figures next to the markdown file")
@click.option("--timeline-case", help="case whose memory timeline to plot (default: the first)")
@click.option(
    "--recompute",
    is_flag=True,
    help="predict again with the current estimator instead of the stored prediction",
)
@click.option("--title", default="memplan: predicted against measured peak memory")
@_one_line_errors
def report_command(
    results: tuple[str, ...],
    out: str | None,
    plot: bool,
    timeline_case: str | None,
    recompute: bool,
    title: str,
) -> None:
    """Markdown report (and figures) from results files written by memplan verify --out."""
    from memplan.verify.report import load_reports, render_markdown

    if plot and not out:
        raise UsageError("--plot writes PNG files next to the report: give --out report.md")
    if timeline_case is not None and not plot:
        raise UsageError("--timeline-case chooses the timeline of --plot: give --plot too")
    _check_out(out)
    report = load_reports(results)
    if recompute:
        from memplan.verify.predict import attach_prediction

        report = report.model_copy(
            update={"measurements": [attach_prediction(m) for m in report.measurements]}
        )
    figures = None
    if plot:
        from memplan.verify.plots import write_figures

        figures = write_figures(report.measurements, Path(out), timeline_case=timeline_case)
    text = render_markdown(report, sources=results, figures=figures, title=title)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}" + (f" and {len(figures)} figures" if figures else ""), err=True)
    else:
        click.echo(text)
