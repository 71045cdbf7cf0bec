"""apply/revert: bind memplan's kernels to one model instance, all or nothing, and undo it.

Patching replaces `forward` on module instances only (types.MethodType, with an instance
`_replicate_for_data_parallel` that rebinds it on nn.DataParallel's replicas), so torch,
torch.nn.functional and transformers' modules are never touched and other models in the process
keep their behaviour. Work is done in two phases: plan (find every module, check it has what
the generic forward needs; nothing is changed) then install (set the forwards; on any failure
every one already set is restored)."""

from __future__ import annotations

import functools
import importlib
import os
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from memplan.errors import MemplanError, UsageError
from memplan.families import FAMILIES
from memplan.families.patch_spec import PatchSpec
from memplan.patching import forwards
from memplan.schema import (
    GELU_APPROXIMATION,
    KERNEL_NAMES,
    SETUP_OPTIONS,
    ModelSpec,
    Plan,
    TrainSetup,
)
from memplan.versions import warn_if_unvalidated

# The model types memplan.apply patches (a multimodal wrapper's text model is its family's).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
_STATE_ATTR = "_memplan_patch_state"
# accelerate.prepare's mixed-precision wrapper keeps the forward it wrapped under this name.
_ACCELERATE_WRAPPED = "_original_forward"
_REPLICATE = "_replicate_for_data_parallel"

KERNEL_FUNCTIONS: dict[str, tuple[str, str]] = {
    "rms_norm": ("memplan.kernels.rms_norm", "rms_norm"),
    "layer_norm": ("memplan.kernels.layer_norm", "layer_norm"),
    "rope": ("memplan.kernels.rope", "rope"),
    "sink_attention": ("memplan.kernels.sink_attention", "sink_attention"),
    "swiglu": ("memplan.kernels.swiglu", "swiglu"),
    "geglu": ("memplan.kernels.geglu", "geglu"),
    "cross_entropy": ("memplan.kernels.cross_entropy", "cross_entropy"),
    "flce": ("memplan.kernels.fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    "embedding": ("memplan.kernels.embedding", "embedding"),
}
# The gated DeltaNet's norm, patched with the rms_norm kernel (PatchSpec.gated_norm).
GATED_NORM_FUNCTION = ("memplan.kernels.gated_rms_norm", "gated_rms_norm")


@dataclass(frozen=True)
class AppliedPatch:
    """What apply() did to a model.

    kernels: the kernels switched on, in memplan.schema.KERNEL_NAMES order.
    modules: kernel -> qualified names of the modules whose forward now uses it (the loss
        kernels name the causal-LM module by its class, e.g. "LlamaForCausalLM").
    flce_chunk: rows per FLCE chunk; None means the kernel's default formula, per call.
    flce_memory_budget: bytes FLCE may hold beyond its outputs (it picks chunk and schedule).
    skipped: kernel -> why a kernel of the plan was not switched on."""

    model_type: str
    kernels: tuple[str, ...]
    modules: Mapping[str, tuple[str, ...]]
    flce_chunk: int | None
    skipped: Mapping[str, str] = field(default_factory=dict)
    plan: Plan | None = None
    flce_memory_budget: int | None = None

    @property
    def num_modules(self) -> int:
        return len({name for names in self.modules.values() for name in names})

    def __str__(self) -> str:
        lines = [f"memplan patched {self.model_type}: {', '.join(self.kernels) or 'nothing'}"]
        for kernel in self.kernels:
            lines.append(f"  {kernel}: {len(self.modules.get(kernel, ()))} modules")
        if "flce" in self.kernels:
            if self.flce_memory_budget:
                lines.append(f"  flce memory budget: {self.flce_memory_budget} bytes")
            else:
                lines.append(f"  flce chunk: {self.flce_chunk or 'default formula'}")
        lines += [f"  skipped {kernel}: {why}" for kernel, why in self.skipped.items()]
        plan = self.plan
        if plan is not None and (plan.grad_checkpointing or plan.grad_accum > 1):
            lines.append(
                f"  the plan also advises micro-batch {plan.micro_batch}, gradient accumulation "
                f"{plan.grad_accum}, checkpointing {'on' if plan.grad_checkpointing else 'off'}: "
                "set these in your training loop"
            )
        return "\n".join(lines)


@dataclass
class _Installed:
    """One forward memplan set on a module instance (which had none of its own before: apply
    refuses forwards set by others, _check_forwards_are_free)."""

    module: nn.Module
    forward: Callable[..., Any]

    def bound_in(self, method: Any) -> bool:
        """Whether `method` is this forward bound to a module (ours, not a replacement)."""
        return getattr(method, "__func__", None) is self.forward


@dataclass
class _State:
    """A patch in place: what it did, the forwards it set, what was asked, and the norms'
    handoffs its forwards share (forwards.PrenormedHandoff, by norm module id)."""

    applied: AppliedPatch
    installed: list[_Installed]
    request: tuple[Any, ...]
    handoffs: Mapping[int, forwards.PrenormedHandoff] = field(default_factory=dict)


@dataclass
class _Target:
    name: str
    module: nn.Module
    kernels: tuple[str, ...]
    forward: Callable[..., Any]


# ---------------------------------------------------------------------------------------------
# Public API


def apply(
    model: nn.Module,
    plan: Literal["auto"] | Plan | None = "auto",
    *,
    kernels: Sequence[str] | None = None,
    flce_chunk: int | None = None,
    flce_memory_budget: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    gpu: str | None = None,
    setup: Mapping[str, Any] | None = None,
    device_facts: forwards.DeviceFacts = forwards.ON_DEVICE,
) -> AppliedPatch:
    """Patch a built transformers causal LM (or a PEFT / DDP / torch.compile wrapper of one)
    in place with memplan's kernels and return what was applied.

    plan="auto" with batch and seq asks memplan's advisor which kernels and FLCE chunk to use;
    "auto" without them, or None, switches on every kernel the architecture supports. A Plan
    is used as given (kernels it names that this model cannot use are reported in `skipped`).
    `kernels` and `flce_chunk` / `flce_memory_budget` (bytes FLCE may hold beyond dX and dW;
    it then picks its chunk and schedule) override the plan. `setup` gives the advisor what the
    model does not show (e.g. precision="amp-bf16" under autocast, grad_checkpointing=True
    switched on later, optimizer, grad_accum); the rest is read off the model. `device_facts`
    tells the kernels what the tensors cannot (the SM count and autocast of the GPU that meta
    tensors stand for); by default they ask the tensors' device. Applying the same thing twice
    changes nothing; applying something else first reverts the previous patch."""
    hf_model = unwrap(model)
    spec = spec_for(hf_model)
    _check_device(hf_model)
    warn_if_unvalidated(gpu=_gpu_name(hf_model))
    for name, value in (("flce_chunk", flce_chunk), ("flce_memory_budget", flce_memory_budget)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if flce_chunk is not None and flce_memory_budget is not None:
        raise UsageError("give flce_chunk or flce_memory_budget, not both")
    supported = supported_kernels(hf_model)

    resolved_plan = _resolve_plan(
        model, hf_model, plan, batch=batch, seq=seq, gpu=gpu, setup=setup or {}
    )
    skipped: dict[str, str] = {}
    if kernels is not None:
        chosen = _one_loss_kernel(_validate_kernel_names(kernels, supported, spec.model_type))
    elif resolved_plan is not None:
        _validate_kernel_names(resolved_plan.kernels, KERNEL_NAMES, spec.model_type)
        chosen = tuple(k for k in _one_loss_kernel(resolved_plan.kernels) if k in supported)
        skipped = {
            k: f"{spec.model_type} ({type(hf_model).__name__}) has no module it applies to"
            for k in resolved_plan.kernels
            if k not in supported
        }
    else:
        chosen = _default_kernels(hf_model, supported)
        if "flce" in supported and "flce" not in chosen:
            skipped["flce"] = _wrapped_head_reason(hf_model.lm_head)
    if flce_chunk is None and flce_memory_budget is None and resolved_plan is not None:
        flce_chunk = resolved_plan.flce_chunk
        flce_memory_budget = resolved_plan.flce_memory_budget
        if flce_chunk is not None and flce_memory_budget is not None:
            raise UsageError("the plan gives flce_chunk and flce_memory_budget; give one")
    chosen = tuple(k for k in KERNEL_NAMES if k in chosen)

    # The plan is part of what was asked: the same kernels under another plan (other advice on
    # batch split or checkpointing) are reported with that plan.
    request = (chosen, flce_chunk, flce_memory_budget, resolved_plan, device_facts)
    state: _State | None = getattr(hf_model, _STATE_ATTR, None)
    if state is not None and state.request == request:
        return state.applied

    functions = {name: load_kernel(name) for name in chosen}
    originals = {id(i.module): i for i in state.installed} if state is not None else {}
    handoffs: dict[int, forwards.PrenormedHandoff] = {}
    targets = _plan_targets(
        hf_model,
        spec,
        chosen,
        functions,
        (flce_chunk, flce_memory_budget),
        originals,
        handoffs,
        device_facts,
    )
    modules: dict[str, list[str]] = {k: [] for k in chosen}
    for target in targets:
        for kernel in target.kernels:
            modules[kernel].append(target.name)
    head = getattr(hf_model, "lm_head", None)
    for kernel in chosen:
        if modules[kernel]:
            continue
        if kernel == "flce" and head is not None and not forwards.plain_linear(head):
            skipped[kernel] = _wrapped_head_reason(head)
        elif kernel == "sink_attention" and "rope" not in chosen:
            skipped[kernel] = "it runs inside memplan's attention forward, which rope installs"
        else:
            skipped[kernel] = "no module of this model uses it"
    applied = AppliedPatch(
        model_type=spec.model_type,
        kernels=tuple(k for k in chosen if modules[k]),
        modules={k: tuple(v) for k, v in modules.items() if v},
        flce_chunk=flce_chunk if "flce" in chosen else None,
        skipped=skipped,
        plan=resolved_plan,
        flce_memory_budget=flce_memory_budget if "flce" in chosen else None,
    )

    if state is not None:
        _restore(state.installed)
        delattr(hf_model, _STATE_ATTR)
    try:
        installed = _install_all(targets)
    except MemplanError:
        if state is not None:  # put the previous patch back: the model is left as it was
            _install_all([_Target("", i.module, (), i.forward) for i in state.installed])
            setattr(hf_model, _STATE_ATTR, state)
        raise
    setattr(hf_model, _STATE_ATTR, _State(applied, installed, request, handoffs))
    return applied


def apply_setup_kernels(
    model: nn.Module, setup: TrainSetup, device_facts: forwards.DeviceFacts = forwards.ON_DEVICE
) -> AppliedPatch:
    """A setup's kernels exactly as it names them (no plan), with its FLCE chunk or budget: how
    a measured run (verify's worker) and the traced step (with the facts of the GPU its meta
    tensors stand for) patch a model."""
    return apply(
        model,
        plan=None,
        kernels=list(setup.kernels),
        flce_chunk=setup.flce_chunk,
        flce_memory_budget=setup.flce_memory_budget,
        device_facts=device_facts,
    )


def revert(model: nn.Module) -> bool:
    """Restore every forward apply() replaced; True if the model was patched."""
    hf_model = unwrap(model, caller="memplan.revert")
    state: _State | None = getattr(hf_model, _STATE_ATTR, None)
    if state is None:
        return False
    _restore(state.installed)
    delattr(hf_model, _STATE_ATTR)
    return True


def applied_patch(model: nn.Module) -> AppliedPatch | None:
    """What apply() did to this model, or None if it is not patched."""
    state: _State | None = getattr(unwrap(model, caller="applied_patch"), _STATE_ATTR, None)
    return state.applied if state is not None else None


def displaced_forwards(model: nn.Module) -> list[str]:
    """Modules whose memplan forward was replaced on the instance after apply by something that
    does not call it through accelerate's mixed-precision wrapper (e.g. TRL's fused LM head):
    their kernels no longer run."""
    hf_model = unwrap(model)
    state: _State | None = getattr(hf_model, _STATE_ATTR, None)
    if state is None:
        return []
    names = {id(module): name for name, module in hf_model.named_modules()}
    displaced = []
    for record in state.installed:
        held = (record.module.__dict__.get(a) for a in ("forward", _ACCELERATE_WRAPPED))
        if not any(record.bound_in(f) for f in held):
            displaced.append(names.get(id(record.module)) or type(record.module).__name__)
    return displaced


def accelerate_wrapped(module: nn.Module) -> bool:
    """Whether accelerate.prepare's mixed-precision wrapper is on this module's forward."""
    return _ACCELERATE_WRAPPED in module.__dict__


def unwrap(model: nn.Module, caller: str = "memplan.apply") -> nn.Module:
    """The transformers model inside PEFT, DDP/FSDP/DataParallel and torch.compile wrappers;
    `caller` names the function in the error for anything else."""
    from transformers import PreTrainedModel

    current = model
    for _ in range(16):
        if isinstance(current, PreTrainedModel):
            return current
        if isinstance(getattr(current, "_orig_mod", None), nn.Module):  # torch.compile
            current = current._orig_mod
        elif callable(getattr(current, "get_base_model", None)):  # peft.PeftModel
            current = current.get_base_model()
        elif isinstance(getattr(current, "module", None), nn.Module):  # DDP, FSDP, DataParallel
            current = current.module
        else:
            break
    raise UsageError(
        f"{caller} takes a transformers causal LM (or a PEFT, DDP or torch.compile wrapper "
        f"of one), not {type(model).__name__}"
    )


def spec_for(hf_model: nn.Module) -> PatchSpec:
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise MemplanError(
            f"memplan has no patch for model_type {model_type!r} ({type(hf_model).__name__}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family.patch


def supported_kernels(hf_model: nn.Module) -> tuple[str, ...]:
    """The kernels this model instance can use, in KERNEL_NAMES order."""
    spec = spec_for(hf_model)
    attr = spec.mlp.activation_config_attr if spec.mlp is not None else "hidden_act"
    found = set(FAMILIES[spec.model_type].kernels(getattr(hf_model.config, attr, None) or ""))
    if forwards.module_class(hf_model).__name__ not in spec.causal_lm.classes:
        found -= {"cross_entropy", "flce"}  # a base model or another head
    if _token_embedding(hf_model, spec) is None:
        found.discard("embedding")
    return tuple(k for k in KERNEL_NAMES if k in found)


def _token_embedding(hf_model: nn.Module, spec: PatchSpec) -> nn.Embedding | None:
    """The token embedding, where it is an nn.Embedding itself or the family's scaled subclass
    (EmbeddingSpec; not an adapter) with the options the kernel implements."""
    get = getattr(hf_model, "get_input_embeddings", None)
    module = get() if callable(get) else None
    plain = forwards.module_class(module) is nn.Embedding
    if not (plain or forwards.module_class(module).__name__ == spec.embedding.scaled_class):
        return None
    if not plain and not hasattr(module, spec.embedding.scale_attr):
        return None
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return None
    return module


def _gelu_approximation(mlp: nn.Module, activation: str) -> str:
    """F.gelu's `approximate` that the MLP's act_fn computes: named by the config, checked on
    the module itself (transformers releases differ in what they build for Gemma's "gelu")."""
    approximate = GELU_APPROXIMATION[activation]
    act_fn = getattr(mlp, "act_fn", None)
    if act_fn is None:
        return approximate
    x = torch.linspace(-4.0, 4.0, 33)
    y = act_fn(x)
    for candidate in (approximate, *(a for a in ("none", "tanh") if a != approximate)):
        if torch.allclose(y, F.gelu(x, approximate=candidate), rtol=0.0, atol=1e-6):
            return candidate
    raise ValueError(f"its act_fn ({type(act_fn).__name__}) is neither exact nor tanh GELU")


def load_kernel(name: str, function: tuple[str, str] | None = None) -> Callable[..., Any]:
    """Kernel `name`'s function (KERNEL_FUNCTIONS), or another (module, attribute) of it."""
    module_name, attr = function or KERNEL_FUNCTIONS[name]
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise MemplanError(f"memplan's {name} kernel cannot be loaded: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Resolution and checks


def _gpu_name(hf_model: nn.Module) -> str | None:
    """The name of the CUDA device the model's first parameter is on, or None."""
    parameter = next(hf_model.parameters(), None)
    if parameter is None or not parameter.is_cuda:
        return None
    return torch.cuda.get_device_name(parameter.device)


def _check_device(model: nn.Module) -> None:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if any(p.is_meta for p in model.parameters()):  # traced (memplan/traced): nothing launches
        return
    raise MemplanError(
        "memplan's kernels need a CUDA GPU and none is available "
        "(TRITON_INTERPRET=1 runs them on the CPU, slowly, for tests)"
    )


def _validate_kernel_names(
    names: Iterable[str], allowed: Sequence[str], model_type: str
) -> tuple[str, ...]:
    if isinstance(names, str):
        names = [names]
    names = tuple(names)
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise UsageError(
            f"unknown kernel {', '.join(map(repr, unknown))}; valid: {', '.join(KERNEL_NAMES)}"
        )
    unusable = [n for n in names if n not in allowed]
    if unusable:
        raise UsageError(
            f"{model_type} cannot use {', '.join(unusable)}; it supports: {', '.join(allowed)}"
        )
    return names


def _resolve_plan(
    model: nn.Module,
    hf_model: nn.Module,
    plan: Literal["auto"] | Plan | None,
    *,
    batch: int | None,
    seq: int | None,
    gpu: str | None,
    setup: Mapping[str, Any],
) -> Plan | None:
    unknown = sorted(set(setup) - set(SETUP_OPTIONS))
    if unknown:
        raise UsageError(
            f"unknown setup option {', '.join(unknown)}; valid: {', '.join(SETUP_OPTIONS)}"
        )
    if plan is None or isinstance(plan, Plan):
        return plan
    if plan != "auto":
        raise UsageError(f"plan must be 'auto', a memplan Plan or None, not {plan!r}")
    if batch is None or seq is None:
        return None
    try:
        from memplan.advisor import advise
        from memplan.catalog import spec_from_config
    except ImportError as exc:
        raise MemplanError(f"memplan's advisor is not available: {exc}") from exc
    config = hf_model.config
    name = getattr(config, "_name_or_path", None) or config.model_type
    model_spec = spec_from_config(config.to_dict(), name)
    options = {"gpu": gpu, **_setup_of(model, hf_model, model_spec), **setup}
    options = {k: v for k, v in options.items() if v is not None}
    return advise(model_spec, batch=batch, seq=seq, **options).plan


def _setup_of(model: nn.Module, hf_model: nn.Module, model_spec: ModelSpec) -> dict[str, Any]:
    """The advisor's setup options that can be read off the model itself."""
    dtype = next(hf_model.parameters()).dtype
    implementation = getattr(hf_model.config, "_attn_implementation", None)
    setup: dict[str, Any] = {
        "precision": {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype),
        "attn": "eager" if implementation == "eager" else "sdpa",
        "grad_checkpointing": any(
            getattr(m, "gradient_checkpointing", False) is True for m in hf_model.modules()
        ),
    }
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        lora = next(iter(peft_config.values()))
        if getattr(lora, "r", None):
            setup["lora_rank"] = lora.r
            # The adapted linears themselves: peft's target_modules may be a regex or
            # "all-linear" (expanded to qualified names), and may name lm_head or a MoE router,
            # which the estimator does not model.
            from memplan.estimators.params import lora_target_modules

            modelled = lora_target_modules(model_spec)
            adapted = {
                name.rsplit(".", 1)[-1]
                for name, module in hf_model.named_modules()
                if hasattr(module, "lora_A")
            }
            targets = tuple(t for t in modelled if t in adapted)
            if targets:
                setup["lora_targets"] = targets
    return setup


def _scaled(norm: nn.Module, spec: PatchSpec) -> bool:
    """Whether the norm has a weight for the kernel (Gemma 4's v_norm has none: its forward
    stays)."""
    flag = spec.norm.scale_flag_attr
    return flag is None or bool(getattr(norm, flag, True))


def _plan_targets(
    hf_model: nn.Module,
    spec: PatchSpec,
    chosen: tuple[str, ...],
    functions: Mapping[str, Callable[..., Any]],
    flce_setting: tuple[int | None, int | None],
    originals: Mapping[int, _Installed],
    handoffs: dict[int, forwards.PrenormedHandoff],
    facts: forwards.DeviceFacts,
) -> list[_Target]:
    """Every module to patch with its new forward; raises before anything is changed. Fills
    `handoffs` with one PrenormedHandoff per patched norm."""
    glu = next((k for k in ("swiglu", "geglu") if k in chosen), None)
    loss_kernels = _loss_kernels(
        hf_model, tuple(k for k in ("cross_entropy", "flce") if k in chosen)
    )
    embedding = _token_embedding(hf_model, spec) if "embedding" in chosen else None
    gated_norm = None
    if "rms_norm" in chosen and spec.gated_norm is not None:
        gated_norm = load_kernel("rms_norm", GATED_NORM_FUNCTION)
    targets: list[_Target] = []
    for name, module in hf_model.named_modules():
        cls = forwards.module_class(module).__name__
        try:
            if "rms_norm" in chosen and cls in spec.norm.classes and _scaled(module, spec):
                _require(module, ("weight", spec.norm.eps_attr))
                handoff = handoffs.setdefault(id(module), forwards.PrenormedHandoff(module))
                forward = forwards.norm_forward(spec.norm, functions["rms_norm"], handoff, facts)
                targets.append(_Target(name, module, ("rms_norm",), forward))
            elif gated_norm is not None and cls in spec.gated_norm.classes:
                _require(module, ("weight", spec.gated_norm.eps_attr))
                if getattr(module, "activation", "silu") not in ("silu", "swish"):
                    raise ValueError(f"its gate's activation is {module.activation!r}, not silu")
                forward = forwards.gated_norm_forward(spec.gated_norm, gated_norm, facts)
                targets.append(_Target(name, module, ("rms_norm",), forward))
            elif "rope" in chosen and cls in spec.attention.classes:
                needed = ["config", "head_dim", "scaling", "layer_idx", "o_proj"]
                needed += ["qkv_proj"] if spec.attention.qkv == "fused" else ["q_proj", "k_proj"]
                flag = spec.attention.qk_norm_flag_attr
                normed = spec.attention.qk_norm and (flag is None or getattr(module, flag, False))
                needed += ["q_norm", "k_norm"] if normed else []
                needed += ["v_norm", "v_proj"] if spec.attention.v_norm else []
                needed += [spec.attention.softcap_attr] if spec.attention.softcap_attr else []
                needed += ["sliding_window"] if spec.attention.sliding_window == "module" else []
                optional = (
                    flag,
                    spec.attention.output_dropout_attr,
                    spec.attention.rope_flag_attr,
                    spec.attention.sliding_flag_attr,
                )
                needed += [attr for attr in optional if attr]
                _require(module, needed)
                eager = forwards.family_function(module, "eager_attention_forward")
                scale = (
                    forwards.family_function(module, "get_llama_4_attn_scale")
                    if spec.attention.query_scale == "llama4"
                    else None
                )
                # sink attention runs inside this forward, with the family's sink logits
                sinks = "sink_attention" in chosen and spec.attention.sinks_attr is not None
                if sinks:
                    _require(module, (spec.attention.sinks_attr, "attention_dropout"))
                forward = forwards.attention_forward(
                    spec.attention,
                    functions["rope"],
                    eager,
                    scale,
                    sink_attention=functions["sink_attention"] if sinks else None,
                )
                kernels = ("rope", "sink_attention") if sinks else ("rope",)
                targets.append(_Target(name, module, kernels, forward))
            elif glu is not None and spec.mlp is not None and cls in spec.mlp.classes:
                projections = (
                    ("gate_up_proj",) if spec.mlp.fused_gate_up else ("gate_proj", "up_proj")
                )
                dropout = spec.mlp.output_dropout_attr
                _require(module, (*projections, "down_proj", *([dropout] if dropout else [])))
                glu_function = functions[glu]
                if glu == "geglu":
                    activation = getattr(hf_model.config, spec.mlp.activation_config_attr)
                    approximate = _gelu_approximation(module, activation)
                    glu_function = functools.partial(glu_function, approximate=approximate)
                forward = forwards.mlp_forward(spec.mlp, glu_function, facts)
                targets.append(_Target(name, module, (glu,), forward))
            elif embedding is not None and module is embedding:
                scale = (
                    spec.embedding.scale_attr
                    if forwards.module_class(module) is not nn.Embedding
                    else None
                )
                forward = forwards.embedding_forward(functions["embedding"], scale)
                targets.append(_Target(name, module, ("embedding",), forward))
            elif loss_kernels and module is hf_model:
                _require(module, ("lm_head", spec.causal_lm.base_model_attr, "config"))
                if spec.causal_lm.moe_aux_loss:
                    _require(module, ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"))
                    forwards.family_function(module, "load_balancing_loss_func")
                if spec.causal_lm.logits_scaling:
                    _require(module.config, ("logits_scaling",))
                kernels = forwards.LossKernels(
                    flce=functions.get("flce") if "flce" in loss_kernels else None,
                    cross_entropy=functions.get("cross_entropy"),
                    flce_chunk=flce_setting[0],
                    flce_memory_budget=flce_setting[1],
                    facts=facts,
                )
                original = types.MethodType(type(module).forward, module)
                forward = forwards.causal_lm_forward(spec.causal_lm, original, kernels)
                targets.append(_Target(cls, module, loss_kernels, forward))
        except (AttributeError, TypeError, ValueError) as exc:
            raise _layout_error(name or cls, module, spec, exc) from exc
    if "rms_norm" in chosen and spec.decoder_layer is not None:
        targets += _decoder_layer_targets(hf_model, spec, targets, handoffs, facts)
    _check_forwards_are_free(hf_model, targets, originals)
    return targets


def _layout_error(name: str, module: nn.Module, spec: PatchSpec, exc: Exception) -> MemplanError:
    return MemplanError(
        f"{name} ({type(module).__name__}) does not have the layout memplan's {spec.model_type} "
        f"patch expects: {exc}; the model is unchanged"
    )


def _decoder_layer_targets(
    hf_model: nn.Module,
    spec: PatchSpec,
    targets: Sequence[_Target],
    handoffs: Mapping[int, forwards.PrenormedHandoff],
    facts: forwards.DeviceFacts,
) -> list[_Target]:
    """The decoder layers whose two norms memplan patches, with their residual adds fused into
    the norms (forwards.decoder_layer_forward), wired to the modules around them."""
    layer_spec = spec.decoder_layer
    patched = {id(t.module): t.kernels for t in targets}

    def patched_norm(module: Any) -> nn.Module | None:
        ours = isinstance(module, nn.Module) and "rms_norm" in patched.get(id(module), ())
        return module if ours else None

    def attention_inputs(layer: nn.Module) -> int:
        rope = "rope" in patched.get(id(getattr(layer, "self_attn", None)), ())
        return 3 if rope and spec.attention.qkv == "separate" else 1

    def mlp_inputs(layer: nn.Module) -> int:
        kernels = patched.get(id(getattr(layer, "mlp", None)), ())
        glu = "swiglu" in kernels or "geglu" in kernels
        return 2 if glu and spec.mlp is not None and not spec.mlp.fused_gate_up else 1

    def eligible(layer: nn.Module) -> bool:
        norms = (getattr(layer, a, None) for a in ("input_layernorm", "post_attention_layernorm"))
        return all(patched_norm(norm) is not None for norm in norms)

    # in the order the base model runs them
    layers = [
        (n, m)
        for n, m in hf_model.named_modules()
        if forwards.module_class(m).__name__ in layer_spec.classes
    ]
    base = getattr(hf_model, spec.causal_lm.base_model_attr, None)
    final_norm = patched_norm(getattr(base, layer_spec.final_norm_attr, None))
    norm_module = importlib.import_module(KERNEL_FUNCTIONS["rms_norm"][0])
    norm_kernels = (norm_module.rms_norm_per_consumer, norm_module.add_rms_norm)
    result = []
    for index, (name, layer) in enumerate(layers):
        if not eligible(layer):
            continue
        try:
            multiplier = layer_spec.residual_multiplier_attr
            needed = ("self_attn", "mlp", *(layer_spec.branch_dropouts or ()))
            _require(layer, (*needed, *([multiplier] if multiplier else [])))
        except AttributeError as exc:
            raise _layout_error(name, layer, spec, exc) from exc
        if index + 1 < len(layers):
            following = layers[index + 1][1]
            next_norm = patched_norm(getattr(following, "input_layernorm", None))
            # a layer left as it is calls its norm module with one output
            next_inputs = attention_inputs(following) if eligible(following) else 1
        else:
            next_norm, next_inputs = final_norm, 1
        wiring = forwards.LayerWiring(
            layer=layer,
            attention_inputs=attention_inputs(layer),
            mlp_inputs=mlp_inputs(layer),
            input_handoff=handoffs[id(layer.input_layernorm)],
            next_norm=next_norm,
            next_inputs=next_inputs,
            next_handoff=handoffs[id(next_norm)] if next_norm is not None else None,
        )
        forward = forwards.decoder_layer_forward(layer_spec, spec.norm, norm_kernels, wiring, facts)
        result.append(_Target(name, layer, ("rms_norm",), forward))
    return result


def _one_loss_kernel(names: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels as given, with at most one loss kernel (as `memplan advise` takes them)."""
    if "cross_entropy" in names and "flce" in names:
        raise UsageError(
            "kernels cross_entropy and flce both compute the loss; pick one "
            "(flce also fuses the lm_head and never materializes the logits)"
        )
    return names


def _default_kernels(hf_model: nn.Module, supported: tuple[str, ...]) -> tuple[str, ...]:
    """Every supported kernel with one loss kernel: flce, or cross_entropy where the lm_head is
    not a plain projection (an adapter on it) and FLCE cannot read its weight."""
    head = getattr(hf_model, "lm_head", None)
    fused = head is None or forwards.plain_linear(head)
    drop = "cross_entropy" if fused else "flce"
    return tuple(k for k in supported if k != drop)


def _wrapped_head_reason(head: nn.Module) -> str:
    return (
        f"lm_head is a {type(head).__module__}.{type(head).__qualname__}, not an nn.Linear: "
        "FLCE needs the projection's weight, so the loss runs on the head's logits"
    )


def _loss_kernels(hf_model: nn.Module, chosen: tuple[str, ...]) -> tuple[str, ...]:
    """The loss kernels the causal-LM forward can use: FLCE reads lm_head's weight, which an
    adapter-wrapped head (PEFT modules_to_save, LoRA) does not hold as a plain projection."""
    head = getattr(hf_model, "lm_head", None)
    if head is not None and not forwards.plain_linear(head):
        return tuple(k for k in chosen if k != "flce")
    return chosen


def _check_forwards_are_free(
    hf_model: nn.Module, targets: Sequence[_Target], originals: Mapping[int, _Installed]
) -> None:
    """Refuse, before anything changes, what replacing a forward would silently break: accelerate's
    dispatch hooks (device_map over several devices, offload: they move weights and inputs in a
    forward memplan would replace, and FLCE reads lm_head's weight directly) and any forward
    already set on an instance by someone else (accelerate.prepare's autocast wrapper: a bf16 run
    would silently train in fp32)."""
    for name, module in hf_model.named_modules():
        if hasattr(module, "_hf_hook"):
            raise MemplanError(
                f"{name or type(module).__name__} carries an accelerate dispatch hook (device_map "
                "over several devices or offloading), which memplan's forwards would bypass; load "
                "the model on one GPU. The model is unchanged"
            )
    for target in targets:
        current = target.module.__dict__.get("forward")
        record = originals.get(id(target.module))
        ours = record is not None and record.bound_in(current)
        if current is not None and not ours:
            by = (
                "accelerate's mixed-precision wrapper (accelerator.prepare, Trainer.train)"
                if accelerate_wrapped(target.module)
                else "another library"
            )
            raise MemplanError(
                f"the forward of {target.name or type(target.module).__name__} was already "
                f"replaced on the instance by {by}, which memplan would drop; call memplan.apply "
                "before wrapping the model (MemplanTrainerCallback patches when the Trainer is "
                "built). The model is unchanged"
            )


def _require(module: nn.Module, attributes: Iterable[str]) -> None:
    missing = [a for a in attributes if not hasattr(module, a)]
    if missing:
        raise AttributeError(f"missing {', '.join(missing)}")


# ---------------------------------------------------------------------------------------------
# Install / restore


def _install_all(targets: Sequence[_Target]) -> list[_Installed]:
    installed: list[_Installed] = []
    for target in targets:
        try:
            installed.append(_install(target.module, target.forward))
        except Exception as exc:
            _restore(installed)
            raise MemplanError(
                f"memplan could not patch {target.name or type(target.module).__name__}: {exc}; "
                "every module was restored, the model is unchanged"
            ) from exc
    return installed


def _install(module: nn.Module, forward: Callable[..., Any]) -> _Installed:
    module.forward = types.MethodType(forward, module)
    module.__dict__[_REPLICATE] = types.MethodType(_replicate_patched, module)
    return _Installed(module, forward)


def _replicate_patched(self: nn.Module) -> nn.Module:
    """nn.DataParallel's replica of a patched module (torch.nn.parallel.replicate calls this).
    The class's version copies the instance __dict__, so the replica's forward would stay bound
    to this module and run its parameters, on its device, instead of the replica's."""
    replica = type(self)._replicate_for_data_parallel(self)
    for name in ("forward", _REPLICATE):
        method = self.__dict__.get(name)
        if isinstance(method, types.MethodType) and method.__self__ is self:
            replica.__dict__[name] = types.MethodType(method.__func__, replica)
    return replica


def _restore(installed: Sequence[_Installed]) -> None:
    for record in reversed(installed):
        if not record.bound_in(record.module.__dict__.get("forward")):
            # Someone (accelerate's autocast wrapper, another patcher) replaced our forward
            # after apply and may call it: removing theirs would silently drop their behaviour.
            warnings.warn(
                f"memplan: the forward of {type(record.module).__name__} was replaced after "
                "memplan.apply and is left as it is; revert before wrapping the model",
                stacklevel=3,
            )
            continue
        record.module.__dict__.pop("forward", None)
        record.module.__dict__.pop(_REPLICATE, None)
