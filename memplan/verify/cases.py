"""From what the user asked (`memplan verify` options or `memplan.verify(...)` arguments) to the
list of cases to measure: the model spec, the setup with its kernels resolved, the sweep
expanded. No torch here."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import UsageError, option_error
from memplan.estimators.params import default_lora_targets
from memplan.estimators.releases import as_run_by
from memplan.schema import (
    KERNEL_NAMES,
    Advice,
    Gpu,
    ModelSpec,
    Plan,
    TrainSetup,
    VerifyCase,
    make_setup,
)
from memplan.schema import SETUP_OPTIONS as TRAIN_SETUP_OPTIONS
from memplan.verify.predict import spec_from_hf_config, with_layers
from memplan.verify.protocol import case_name
from memplan.versions import installed_versions

# Options of TrainSetup that verify passes through unchanged (batch, seq and kernels apart).
SETUP_OPTIONS = (*TRAIN_SETUP_OPTIONS, "flce_chunk")

KernelChoice = str | tuple[str, ...]  # "auto", "all", or the kernels by name (() for none)

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class PlannedCase:
    case: VerifyCase
    spec: ModelSpec
    gpu: Gpu | None


def parse_kernels(value: str | Sequence[str] | None) -> KernelChoice:
    """'auto' | 'all' | 'none' | 'rms_norm,swiglu' (or '+' between names) | a list of names."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "all"):
            return text
        if text in ("none", ""):
            return ()
        names = [n.strip() for n in text.replace("+", ",").split(",") if n.strip()]
    else:
        names = list(value)
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise UsageError(
            f"unknown kernel {', '.join(map(repr, unknown))}; valid: auto, none, all, "
            + ", ".join(KERNEL_NAMES)
        )
    return tuple(k for k in KERNEL_NAMES if k in names)


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise ValueError(text)


_SWEEP_PARSERS: dict[str, Any] = {
    "batch": int,
    "seq": int,
    "lora_rank": int,
    "grad_accum": int,
    "flce_chunk": int,
    "layers": int,
    "precision": str,
    "optimizer": str,
    "attn": str,
    "grad_checkpointing": _parse_bool,
    "kernels": parse_kernels,
    "gpus": int,
    "strategy": str,
    "reshard_after_forward": _parse_bool,
}


def parse_sweeps(items: Sequence[str]) -> dict[str, list[Any]]:
    """`batch=1,2,4` `seq=1024,4096` -> {"batch": [1, 2, 4], "seq": [1024, 4096]}. Kernel sets
    inside a kernels sweep join their names with '+': kernels=none,rms_norm+swiglu,auto."""
    sweeps: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise UsageError(f"--sweep takes NAME=V1,V2,... (e.g. batch=1,2,4), got {item!r}")
        parser = _SWEEP_PARSERS.get(key)
        if parser is None:
            raise UsageError(f"cannot sweep {key!r}; sweepable: {', '.join(_SWEEP_PARSERS)}")
        if key in sweeps:
            raise UsageError(f"--sweep {key} is given twice")
        parsed = []
        for raw in values.split(","):
            try:
                parsed.append(parser(raw.strip()))
            except ValueError:
                raise UsageError(f"--sweep {key}: {raw.strip()!r} is not a valid value") from None
        sweeps[key] = parsed
    return sweeps


def check_sweeps(sweeps: Mapping[str, Sequence[Any]] | None) -> dict[str, list[Any]]:
    """`sweeps` as plan_cases takes them from Python: sweepable keys only, each with a non-empty
    list of values; kernel values parsed as in `--sweep kernels=...` ("rms_norm+swiglu")."""
    checked: dict[str, list[Any]] = {}
    for key, values in (sweeps or {}).items():
        if key not in _SWEEP_PARSERS:
            raise UsageError(f"cannot sweep {key!r}; sweepable: {', '.join(_SWEEP_PARSERS)}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise UsageError(f"sweep {key!r} takes a non-empty list of values, got {values!r}")
        checked[key] = [parse_kernels(v) for v in values] if key == "kernels" else list(values)
    return checked


def resolve_spec(
    model: Any, *, trust_remote_code: bool = False, layers: int | None = None
) -> tuple[ModelSpec, str | None]:
    """The spec of a catalog name, a config path, a ModelSpec, a transformers config or model;
    and the checkpoint folder to load weights from when `model` is a folder that has them."""
    checkpoint: str | None = None
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, str):
        from memplan.catalog import resolve_model

        spec = resolve_model(model, trust_remote_code=trust_remote_code)
        path = Path(model)
        if path.is_dir() and any(next(path.glob(g), None) for g in _WEIGHT_FILES):
            checkpoint = str(path.resolve())
    else:
        config = getattr(model, "config", model)
        if not hasattr(config, "to_dict"):
            raise UsageError(
                "model must be a catalog name, a path, a ModelSpec, or a transformers config or "
                f"model, not {type(model).__name__}"
            )
        name = getattr(config, "_name_or_path", None) or None
        spec = spec_from_hf_config(config.to_dict(), name)
    if layers is not None:
        spec = with_layers(spec, layers)
        checkpoint = None  # a cut model is built from its config
    return spec, checkpoint


def resolve_gpu(gpu: str | Gpu | None, gpu_mem: str | int | None) -> Gpu | None:
    if isinstance(gpu, Gpu):
        return gpu
    if gpu is None and gpu_mem is None:
        return None
    from memplan.catalog import resolve_gpu as catalog_gpu

    return catalog_gpu(name=gpu, memory=gpu_mem)


def advised_plan(spec: ModelSpec, setup: TrainSetup, kernels: str, gpu: Gpu | None) -> Plan:
    """The advisor's plan for this setup with kernels 'auto' or 'all'."""
    from memplan.advisor import advise

    options = {name: getattr(setup, name) for name in SETUP_OPTIONS}
    if not setup.lora_rank:
        options.pop("lora_targets")  # TrainSetup's default, meaningless without a rank
    return advise(spec, batch=setup.batch, seq=setup.seq, kernels=kernels, gpu=gpu, **options).plan


def resolve_kernels(
    spec: ModelSpec, setup: TrainSetup, kernels: KernelChoice, gpu: Gpu | None
) -> TrainSetup:
    """The setup with the kernels the run will patch in and their FLCE chunk."""
    if isinstance(kernels, str):
        plan = advised_plan(spec, setup, kernels, gpu)
        names = tuple(plan.kernels)
        if setup.flce_chunk is not None:
            chunk, budget = setup.flce_chunk, None
        else:
            chunk, budget = plan.flce_chunk, plan.flce_memory_budget
    else:
        from memplan.advisor import parse_kernels as supported_names  # checks the architecture

        names = supported_names(list(kernels), spec) or ()
        chunk, budget = setup.flce_chunk, setup.flce_memory_budget
    flce = "flce" in names
    return setup.model_copy(
        update={
            "kernels": names,
            "flce_chunk": chunk if flce else None,
            "flce_memory_budget": budget if flce else None,
        }
    )


# What a plan sets (_setup_from_plan); sweeping one of them beside a plan would measure the
# plan's value at every point of the sweep.
_DECIDED_BY_PLAN = ("batch", "grad_accum", "grad_checkpointing", "flce_chunk")


def _setup_from_plan(fields: dict[str, Any], plan: Plan) -> dict[str, Any]:
    fields = dict(fields)
    if plan.micro_batch is not None:
        fields["batch"] = plan.micro_batch
    if plan.grad_accum > 1:
        fields["grad_accum"] = plan.grad_accum
    if plan.grad_checkpointing:
        fields["grad_checkpointing"] = True
    if fields.get("flce_chunk") is None and fields.get("flce_memory_budget") is None:
        if plan.flce_chunk is not None:
            fields["flce_chunk"] = plan.flce_chunk
        if plan.flce_memory_budget is not None:
            fields["flce_memory_budget"] = plan.flce_memory_budget
    return fields


def _display_name(spec: ModelSpec) -> str:
    """The catalog name, or the folder name of a config given by path."""
    name = spec.name or spec.model_type
    path = Path(name)
    if path.exists():
        path = path.parent if path.is_file() else path
        return path.resolve().name or spec.model_type
    return name


def plan_cases(
    model: Any,
    *,
    batch: int,
    seq: int,
    kernels: str | Sequence[str] | None = "auto",
    plan: Plan | Advice | None = None,
    sweeps: Mapping[str, Sequence[Any]] | None = None,
    gpu: str | Gpu | None = None,
    gpu_mem: str | int | None = None,
    steps: int = 3,
    timeline: bool = False,
    layers: int | None = None,
    trust_remote_code: bool = False,
    random_init: bool = False,
    **setup_options: Any,
) -> list[PlannedCase]:
    """Every case to measure, in sweep order (the last sweep varies fastest).

    A `plan` (or an Advice's plan) decides the kernels, the FLCE chunk, the micro-batch with its
    gradient accumulation and checkpointing, as memplan.apply and a training script would."""
    unknown = sorted(set(setup_options) - set(SETUP_OPTIONS))
    if unknown:
        raise UsageError(
            f"unknown setup option {', '.join(unknown)}; valid: {', '.join(SETUP_OPTIONS)}"
        )
    if steps < 3:
        raise option_error(
            "the protocol measures at least 3 steps, got {} {value}", "steps", value=steps
        )
    if isinstance(plan, Advice):
        plan = plan.plan
    gpu_spec = resolve_gpu(gpu, gpu_mem)
    base_kernels = parse_kernels(kernels)
    if plan is not None:
        base_kernels = parse_kernels(list(plan.kernels))
    sweeps = check_sweeps(sweeps)
    decided = [k for k in _DECIDED_BY_PLAN if k in sweeps]
    if plan is not None and decided:
        raise UsageError(
            f"a plan decides {', '.join(_DECIDED_BY_PLAN)}: sweep {', '.join(decided)} "
            "without a plan, or verify one plan per case"
        )
    keys = list(sweeps)
    planned: list[PlannedCase] = []
    from memplan.advisor import installed_deltanet

    # the gated DeltaNet kernels transformers will run where the case runs, as advise takes them
    deltanet = installed_deltanet()
    uncut, full_checkpoint = resolve_spec(model, trust_remote_code=trust_remote_code)
    uncut_name = _display_name(uncut)
    seen: dict[str, int] = {}
    for values in itertools.product(*(sweeps[k] for k in keys)):
        point = dict(zip(keys, values))
        case_layers = point.pop("layers", layers)
        case_kernels = point.pop("kernels", base_kernels)
        if case_layers is None:
            spec, checkpoint, name = uncut, full_checkpoint, uncut_name
        else:  # a cut model is built from its config, and named after the model as given
            spec, checkpoint = with_layers(uncut, case_layers), None
            name = f"{uncut_name}-l{case_layers}"
        fields = {"batch": batch, "seq": seq, **deltanet}
        fields.update(setup_options, **point)
        if fields.get("lora_targets") is None:
            fields.pop("lora_targets", None)
            if fields.get("lora_rank"):  # the architecture's own: qkv_proj where it is fused
                fields["lora_targets"] = default_lora_targets(spec)
        if plan is not None:
            fields = _setup_from_plan(fields, plan)
        setup = resolve_kernels(spec, make_setup(**fields), case_kernels, gpu_spec)
        # SDPA asked of a model type the installed transformers builds with eager only
        setup = as_run_by(spec.model_type, setup, installed_versions()["transformers"])
        label = case_name(name, setup)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        planned.append(
            PlannedCase(
                case=VerifyCase(
                    case=label,
                    model=name,
                    model_type=spec.model_type,
                    hf_config=spec.hf_config,
                    checkpoint=None if random_init else checkpoint,
                    trust_remote_code=trust_remote_code,
                    setup=setup,
                    steps=steps,
                    record_timeline=timeline,
                ),
                spec=spec,
                gpu=gpu_spec,
            )
        )
    return planned
