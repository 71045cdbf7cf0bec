"""The child process of `memplan verify`: one run of the measurement protocol
(docs/measurement_protocol.md) in a fresh process, nothing else on the GPU before it.

    python -m memplan.verify.worker CASE_JSON OUT_JSON

Reads a VerifyCase, always writes a Measurement to OUT_JSON, and exits with one of the codes in
memplan.verify.protocol: ok, out of memory, no usable GPU, build failed, step failed."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import memplan
from memplan.schema import (
    Measurement,
    ModelSpec,
    ProfileOp,
    ProfileTable,
    TrainSetup,
    VerifyCase,
)
from memplan.verify import distributed, protocol
from memplan.verify.allocator_trace import downsample, events_from_trace, marker_sizes

# Where tensors go. The protocol measures on CUDA; CPU tests point this at "cpu" and replace
# torch.cuda's memory counters with fakes to run the rest of the child as it is.
DEVICE = "cuda"


class _Failure(Exception):
    def __init__(self, kind: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.exit_code = exit_code


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text


def _warn(rec: dict[str, Any], message: str) -> None:
    """Something the parent should know that does not fail the case: one line on stderr and one
    in the result's env["warnings"]."""
    print(f"Warning: {message}", file=sys.stderr)
    env = rec.setdefault("env", {})
    env["warnings"] = "\n".join(filter(None, [env.get("warnings"), message]))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _check_gpu(rec: dict[str, Any]) -> None:
    import torch

    if not torch.cuda.is_available():
        raise _Failure(
            "no_gpu",
            "no CUDA GPU is available (torch.cuda.is_available() is False)",
            protocol.EXIT_NO_GPU,
        )
    try:
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
    except Exception as exc:  # a broken driver or a GPU in a bad state
        message = f"CUDA is not usable: {_one_line(exc)}"
        raise _Failure("no_gpu", message, protocol.EXIT_NO_GPU) from exc
    import transformers

    rec["env"] = {
        "gpu": name,
        "gpu_total_gib": f"{total / 2**30:.2f}",
        # the prediction is made for this GPU (memplan.verify.predict.measured_gpu)
        "gpu_total_bytes": str(total),
        "compute_capability": f"{major}.{minor}",
        "gpu_free_at_start_gib": f"{free / 2**30:.2f}",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "triton": _version("triton"),
        "flash-linear-attention": _version("fla-core"),
        "memplan": memplan.__version__,
        "python": platform.python_version(),
    }


def _build_model(case: VerifyCase, rec: dict[str, Any]) -> tuple[Any, int]:
    """The model in the protocol's dtype, on the GPU, in training mode, with checkpointing,
    LoRA and the patch (memplan's or Liger's) as the setup asks; returns (model, vocab)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    setup = case.setup
    dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    params = _param_count(case)
    model_bytes = None if params is None else params * (2 if dtype == torch.bfloat16 else 4)
    device = distributed.init_device(setup, DEVICE, model_bytes, torch.cuda.mem_get_info()[0])
    torch.manual_seed(0)
    try:
        if case.checkpoint is not None:
            model = AutoModelForCausalLM.from_pretrained(
                case.checkpoint,
                dtype=dtype,
                attn_implementation=setup.attn,
                device_map=device,
                trust_remote_code=case.trust_remote_code,
            )
            rec["weights"] = "checkpoint"
        else:
            fields = {k: v for k, v in case.hf_config.items() if k != "model_type"}
            config = AutoConfig.for_model(case.model_type, **fields)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    config, dtype=dtype, attn_implementation=setup.attn
                )
    except Exception as exc:
        if _is_oom(exc):
            raise
        raise _Failure(
            "build", f"the model failed to build: {_one_line(exc)}", protocol.EXIT_BUILD
        ) from exc
    if distributed.prepares_from_cpu(setup) and device != "cpu":
        # made on the GPU for speed; prepared from the CPU, with no trace left in the allocator
        model.to("cpu")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model.train()
    rec["n_params"] = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size

    try:
        if case.liger:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=model)
            rec["env"]["liger_kernel"] = _version("liger-kernel")
        if setup.grad_checkpointing:
            with warnings.catch_warnings():
                # transformers >= 5.2x renames it activation_checkpointing_enable; same behaviour
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable()
        if setup.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=setup.lora_rank,
                lora_alpha=protocol.LORA_ALPHA,
                target_modules=list(setup.lora_targets),
                lora_dropout=0.0,
            )
            model = get_peft_model(model, lora)
            rec["env"]["peft"] = _version("peft")
        if setup.kernels:
            from memplan.patching.engine import apply_setup_kernels

            applied = apply_setup_kernels(model, setup)
            rec["applied"] = _applied_summary(applied)
            kernels = tuple(rec["applied"]["kernels"])
            if kernels != setup.kernels:  # the measurement describes what really ran
                rec["applied"]["requested"] = list(setup.kernels)
                rec["setup"] = setup.model_copy(update={"kernels": kernels})
        if setup.strategy is not None:
            if not distributed.is_zero(setup):  # ZeRO is prepared with its optimizer (_Trainer)
                model = distributed.prepare(model, setup, DEVICE)
            else:
                rec["env"]["deepspeed"] = _version("deepspeed")
            rec["env"]["accelerate"] = _version("accelerate")
            rec["env"]["world_size"] = str(setup.gpus)
            real = distributed.launched_ranks() is not None
            rec["env"]["ranks"] = "torchrun" if real else "simulated on one GPU"
    except Exception as exc:
        if _is_oom(exc):
            raise
        raise _Failure(
            "build", f"preparing the model failed: {_one_line(exc)}", protocol.EXIT_BUILD
        ) from exc
    rec["after_model_bytes"] = _allocated()
    return model, vocab


def _allocated() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _case_spec(case: VerifyCase) -> ModelSpec | None:
    """The case's model as the estimator sees it; None for a model type without a family
    entry."""
    from memplan.errors import MemplanError
    from memplan.verify.predict import spec_from_hf_config

    try:
        return spec_from_hf_config({"model_type": case.model_type, **case.hf_config}, case.model)
    except MemplanError:
        return None


def _check_deltanet_kernels(case: VerifyCase) -> None:
    """The gated DeltaNet kernels the case asks are the ones transformers will run here: fla's
    rule where the `fla` package imports, causal-conv1d's conv where `causal_conv1d` does, and
    the torch fallback for what does not import."""
    from memplan.advisor import DELTANET_FAST_PACKAGES, installed_deltanet

    spec = _case_spec(case)
    if spec is None or not spec.linear_attention_layers:
        return
    here = installed_deltanet()
    for field, (_, package) in DELTANET_FAST_PACKAGES.items():
        asked = getattr(case.setup, field)
        if asked != here[field]:
            imports = "does not import" if here[field] == "torch" else "imports"
            message = (
                f"the case asks {field}={asked} but {package} {imports} here, so transformers "
                "would run another kernel"
            )
            raise _Failure("build", message, protocol.EXIT_BUILD)


def _param_count(case: VerifyCase) -> int | None:
    """The model's parameters as the estimator counts them; None for a model type without a
    family entry."""
    from memplan.estimators import count_params

    spec = _case_spec(case)
    return None if spec is None else count_params(spec).total


def _applied_summary(applied: Any) -> dict[str, Any]:
    modules = getattr(applied, "modules", {}) or {}
    return {
        "model_type": getattr(applied, "model_type", None),
        "kernels": list(getattr(applied, "kernels", ())),
        "modules": {kernel: len(names) for kernel, names in modules.items()},
        "flce_chunk": getattr(applied, "flce_chunk", None),
        "flce_memory_budget": getattr(applied, "flce_memory_budget", None),
        "skipped": dict(getattr(applied, "skipped", {}) or {}),
    }


def _make_optimizer(params: list[Any], name: str) -> Any:
    import torch

    lr = protocol.LEARNING_RATE
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=protocol.SGD_MOMENTUM)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    if name == "adamw-8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


class _Trainer:
    """The protocol's step, written once for the measured, the recorded and the profiled steps."""

    def __init__(self, case: VerifyCase, model: Any, vocab: int) -> None:
        import torch

        setup = case.setup
        self.model = model
        self.accum = setup.grad_accum
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in params)
        try:
            self.opt = _make_optimizer(params, setup.optimizer)
        except Exception as exc:
            raise _Failure(
                "build", f"the optimizer failed to build: {_one_line(exc)}", protocol.EXIT_BUILD
            ) from exc
        # DeepSpeed's engine: it casts the model, scales fp16 losses and steps the optimizer
        self.engine = self._zero_engine(setup) if distributed.is_zero(setup) else None
        amp = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(setup.precision)
        if self.engine is not None:  # DeepSpeed's bf16/fp16 mode casts the model: no autocast
            amp = None
        self.autocast = (lambda: torch.autocast(DEVICE, dtype=amp)) if amp else None
        # fp16 autocast needs loss scaling to train; its state is a few scalars
        self.scaler = torch.amp.GradScaler(DEVICE) if amp == torch.float16 else None
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        self.ids = torch.randint(
            0, vocab, (setup.batch, setup.seq), device=DEVICE, generator=generator
        )
        self.loss: Any = None
        self.optimizer_name = setup.optimizer

    def _zero_engine(self, setup: TrainSetup) -> Any:
        try:
            self.model = distributed.prepare_zero(self.model, self.opt, setup)
        except Exception as exc:
            if _is_oom(exc):
                raise
            message = f"preparing the model failed: {_one_line(exc)}"
            raise _Failure("build", message, protocol.EXIT_BUILD) from exc
        return self.model

    def _backward(self, loss: Any, last: bool) -> None:
        if self.engine is not None:  # as accelerate's DeepSpeedEngineWrapper.backward
            self.engine.set_gradient_accumulation_boundary(is_boundary=last)
            self.engine.backward(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self) -> None:
        """The optimizer's step; DeepSpeed's engine.step also zeroes the gradients, right after
        the last backward as accelerate calls it."""
        if self.engine is not None:
            self.engine.step()
        elif self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()

    def skipped_every_step(self) -> bool:
        """True when the fp16 loss scaler found inf/NaN gradients at every step so far: the
        optimizer never stepped and holds no state. Plain SGD keeps no state either way."""
        return (
            self.scaler is not None
            and self.optimizer_name != "sgd"
            and self.n_trainable > 0
            and not self.opt.state
        )

    def step(self, mark: Any = None) -> None:
        """One optimizer step; `mark(name)` is called at each phase boundary when given."""
        model, ids, opt = self.model, self.ids, self.opt
        for micro in range(self.accum):
            suffix = f" {micro + 1}" if self.accum > 1 else ""
            # as accelerate accumulates: ranks sync gradients on the last micro-batch only
            distributed.sync_gradients(model, micro == self.accum - 1)
            if mark:
                mark("forward" + suffix)
            if self.autocast is not None:
                with self.autocast():
                    self.loss = model(input_ids=ids, labels=ids).loss
            else:
                self.loss = model(input_ids=ids, labels=ids).loss
            if mark:
                mark("backward" + suffix)
            # DeepSpeed's engine divides the loss by the accumulation steps itself
            unscaled = self.accum == 1 or self.engine is not None
            loss = self.loss if unscaled else self.loss / self.accum
            self._backward(loss, micro == self.accum - 1)
            del loss
        if mark:
            mark("optimizer")
        self._optimizer_step()
        if mark:
            mark("zero_grad")
        if self.engine is None:
            opt.zero_grad(set_to_none=True)
        if mark:
            mark("end")


def build_trainer(case: VerifyCase) -> _Trainer:
    """The case's model, optimizer and inputs as the protocol builds them, warmed up by 3 steps:
    for probes that time or trace steps in a process of their own (benchmarks/probe_*.py)."""
    import torch

    rec: dict[str, Any] = {}
    _check_gpu(rec)
    model, vocab = _build_model(case, rec)
    trainer = _Trainer(case, model, vocab)
    for _ in range(3):
        trainer.step()
    torch.cuda.synchronize()
    return trainer


def _measure(case: VerifyCase, trainer: _Trainer, rec: dict[str, Any]) -> None:
    import torch

    setup = case.setup
    rec["oom_phase"] = "step 1"
    trainer.step()
    torch.cuda.synchronize()
    rec["peak_step1_bytes"] = torch.cuda.max_memory_allocated()
    start = time.perf_counter()
    for n in range(2, case.steps + 1):
        rec["oom_phase"] = f"step {n}"
        trainer.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    rec["peak_bytes"] = torch.cuda.max_memory_allocated()
    rec["reserved_bytes"] = torch.cuda.max_memory_reserved()
    rec["end_allocated_bytes"] = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    rec["non_allocator_bytes"] = total - free - torch.cuda.memory_reserved()
    rec["step_s"] = elapsed / (case.steps - 1)
    rec["tokens_per_s"] = setup.batch * setup.seq * setup.grad_accum / rec["step_s"]
    rec["loss"] = float(trainer.loss.item())
    rec["status"] = "ok"
    if trainer.skipped_every_step():
        _warn(
            rec,
            "the fp16 loss scaler skipped every optimizer step (inf/NaN gradients), so the "
            "optimizer states were never allocated and the measured peak lacks them",
        )
    if case.record_timeline:
        rec["oom_phase"] = "the recorded step"
        try:
            rec["timeline_measured"] = _record_timeline(trainer)
        except Exception as exc:  # the peaks are measured; the timeline is an extra
            if _is_oom(exc):
                raise
            _warn(rec, f"the memory timeline was not recorded: {_one_line(exc)}")
    rec.pop("oom_phase")


_PHASES_PER_MICRO_BATCH = ("forward", "backward")


def _record_timeline(trainer: _Trainer) -> list[dict[str, Any]]:
    """One more steady-state step under the allocator's history; peaks are already taken."""
    import torch

    names = [
        f"{p} {i + 1}" if trainer.accum > 1 else p
        for i in range(trainer.accum)
        for p in _PHASES_PER_MICRO_BATCH
    ] + ["optimizer", "zero_grad", "end"]
    sizes = dict(zip(names, marker_sizes(len(names))))

    def mark(name: str) -> None:
        marker = torch.empty(sizes[name], dtype=torch.uint8, device=DEVICE)
        del marker

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=4_000_000
    )
    try:
        trainer.step(mark)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    trace = snapshot["device_traces"][device]
    events = events_from_trace(trace, baseline_bytes=baseline, phases=names)
    kept = downsample([e for e in events if e.phase != "end"], max_points=1500)
    return [e.model_dump() for e in kept]


_TRACE_ACTIONS = (
    "alloc",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
)


def _start_allocator_trace() -> None:
    import torch

    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=10_000_000
    )


def _stop_allocator_trace() -> list[tuple[str, int, int]]:
    """Every allocation, completed free and segment change since _start_allocator_trace."""
    import torch

    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    # an 'oom' entry has no address: it carries the driver's free bytes at the failure instead
    return [
        (e["action"], e["addr"] if "addr" in e else e.get("device_free", 0), e["size"])
        for e in trace
        if e["action"] in _TRACE_ACTIONS
    ]


def _profile(case: VerifyCase, trainer: _Trainer, rec: dict[str, Any], top: int = 40) -> None:
    """torch.profiler over 2 steady-state steps after 2 warm-up steps (Triton compiles,
    cuBLAS picks its algorithms, the optimizer states appear)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        trainer.step()
    torch.cuda.synchronize()
    steps = 2
    activities = [ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step()
        torch.cuda.synchronize()

    def self_device_us(evt: Any) -> float:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            value = getattr(evt, attr, None)
            if value is not None:
                return float(value)
        return 0.0

    averages = prof.key_averages()
    kernels = [e for e in averages if str(e.device_type).endswith("CUDA")]
    ops = [e for e in averages if str(e.device_type).endswith("CPU") and self_device_us(e) > 0]
    total_us = sum(self_device_us(e) for e in kernels) or 1.0

    def table(events: list[Any]) -> list[ProfileOp]:
        events = sorted(events, key=self_device_us, reverse=True)[:top]
        return [
            ProfileOp(
                name=e.key if len(e.key) <= 100 else e.key[:97] + "...",
                device_ms=self_device_us(e) / 1000 / steps,
                calls=e.count / steps,
                share=self_device_us(e) / total_us,
            )
            for e in events
        ]

    rec["profile"] = {
        "self": ProfileTable(
            steps=steps,
            total_device_ms=total_us / 1000 / steps,
            ops=table(ops),
            kernels=table(kernels),
        ).model_dump()
    }
    rec["status"] = "ok"


def run(case: VerifyCase) -> tuple[Measurement, int]:
    rec: dict[str, Any] = {
        "case": case.case,
        "model": case.model,
        "setup": case.setup,
        "steps": case.steps,
        "liger": case.liger,
        "model_type": case.model_type,
        "hf_config": case.hf_config,
        "status": "error",
    }
    code = protocol.EXIT_OK
    try:
        distributed.select_device(DEVICE)
        _check_gpu(rec)
        _check_deltanet_kernels(case)
        if case.setup.strategy is not None:
            try:
                distributed.init_process_group(case.setup, DEVICE)
            except Exception as exc:
                raise _Failure("build", _one_line(exc), protocol.EXIT_BUILD) from exc
        if case.record_allocator_trace:
            _start_allocator_trace()
        try:
            _build_and_step(case, rec)
        except _Failure:
            raise
        except Exception as exc:
            if not _is_oom(exc):
                raise _Failure("run", _one_line(exc), protocol.EXIT_RUN) from exc
            import torch

            above = torch.cuda.max_memory_allocated()
            free, total = torch.cuda.mem_get_info()
            rec.update(
                status="oom",
                oom_above_bytes=above,
                # what the step found taken outside the allocator when it ran out
                non_allocator_bytes=total - free - torch.cuda.memory_reserved(),
                error=f"out of memory in {rec.get('oom_phase', 'the run')} above "
                f"{above / 2**30:.2f} GiB allocated",
            )
            code = protocol.EXIT_OOM
    except _Failure as failure:
        if failure.__cause__ is not None:
            traceback.print_exception(failure.__cause__, file=sys.stderr)
        rec.update(status="error", error_kind=failure.kind, error=str(failure))
        code = failure.exit_code
    rec.pop("oom_phase", None)
    if case.record_allocator_trace and code in (protocol.EXIT_OK, protocol.EXIT_OOM):
        rec["allocator_trace"] = _stop_allocator_trace()
    if case.setup.strategy is not None:
        distributed.destroy_process_group()
    return Measurement.model_validate(rec), code


def _build_and_step(case: VerifyCase, rec: dict[str, Any]) -> None:
    """Build the model and run the case's steps; the model, and a DDP reducer's hold on the
    process group, are gone when this returns, before the group is destroyed."""
    rec["oom_phase"] = "the model build"
    model, vocab = _build_model(case, rec)
    rec["oom_phase"] = "the optimizer or input setup"
    trainer = _Trainer(case, model, vocab)
    rec["n_trainable"] = trainer.n_trainable
    if trainer.engine is not None:  # what the engine keeps of the model it partitioned
        rec["after_model_bytes"] = _allocated()
    if case.mode == "profile":
        _profile(case, trainer, rec)
    else:
        _measure(case, trainer, rec)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m memplan.verify.worker CASE_JSON OUT_JSON", file=sys.stderr)
        return 2
    case = VerifyCase.model_validate_json(Path(args[0]).read_text())
    with contextlib.redirect_stdout(sys.stderr):  # stdout stays clean for the parent
        measurement, code = run(case)
    if distributed.rank() == 0:  # under torchrun, rank 0 reports
        Path(args[1]).write_text(measurement.model_dump_json(indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
