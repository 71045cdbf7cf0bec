"""The Hugging Face model of a config.json, on the meta device, prepared as the measurement
protocol prepares it (memplan/verify/worker.py _build_model): the protocol's dtype and
attention, gradient checkpointing, peft LoRA. No memory is allocated."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from memplan.errors import MemplanError
from memplan.schema import TrainSetup
from memplan.verify import protocol

if TYPE_CHECKING:
    from memplan.patching.forwards import DeviceFacts

# What peft adapts when no --lora-targets is given, for the families whose attention projections
# peft's own table does not name (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING is
# consulted first).
FALLBACK_LORA_TARGETS = ("q_proj", "v_proj")


def param_dtype(setup: TrainSetup) -> torch.dtype:
    return torch.bfloat16 if setup.precision == "bf16" else torch.float32


def hf_config(config: dict[str, Any], *, name: str | None, trust_remote_code: bool) -> Any:
    """The transformers config object of a config.json dict. A model_type transformers does not
    know is custom code: it needs --trust-remote-code and the hub id to fetch that code."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise MemplanError("the model config has no 'model_type' key")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    if model_type in CONFIG_MAPPING:
        with quiet():
            try:
                return AutoConfig.for_model(model_type, **fields)
            except Exception as exc:  # noqa: BLE001 - a config transformers refuses
                raise MemplanError(
                    f"transformers cannot read this {model_type} config: {_first_line(exc)}"
                ) from exc
    if not config.get("auto_map"):
        import transformers

        raise MemplanError(
            f"model_type {model_type!r} is not known to the installed transformers "
            f"{transformers.__version__}, and the config names no custom code (auto_map)"
        )
    if not trust_remote_code:
        raise MemplanError(
            f"model_type {model_type!r} is custom code from the hub: it runs only with "
            "--trust-remote-code (read the code first)"
        )
    if not name or "/" not in name:
        raise MemplanError(
            f"model_type {model_type!r} is custom code: give its hub id as --model so that "
            "transformers can fetch the code"
        )
    with quiet():
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=True)
        except Exception as exc:  # noqa: BLE001
            raise MemplanError(
                f"the custom code of {name!r} could not be loaded: {_first_line(exc)}"
            ) from exc


def build_model(
    config: Any,
    setup: TrainSetup,
    *,
    trust_remote_code: bool = False,
    checkpoint_context: Callable[[], tuple[Any, Any]] | None = None,
    device_facts: DeviceFacts | None = None,
    on_built: Callable[[Any], None] | None = None,
) -> Any:
    """The model on the meta device, in training mode, with checkpointing, LoRA and memplan's
    kernels as the setup asks. `checkpoint_context` is torch.utils.checkpoint's context_fn (the
    traced autocast uses it to open an autocast region around each layer's recomputation, as
    torch does on CUDA); `device_facts` tells the kernels what the meta tensors cannot: the
    GPU's SM count and the emulated autocast; `on_built` is called with the model transformers
    built, before LoRA adds its adapters (the order the GPU allocates them in)."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "model")
    try:
        with quiet(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config,
                dtype=param_dtype(setup),
                attn_implementation=setup.attn,
                trust_remote_code=trust_remote_code,
            )
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own code
        raise MemplanError(
            f"transformers could not build {model_type} from this config: {_first_line(exc)}"
        ) from exc
    model.train()
    if on_built is not None:
        on_built(model)
    try:
        if setup.grad_checkpointing:
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if checkpoint_context is not None:
                kwargs["context_fn"] = checkpoint_context
            with quiet():
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if setup.lora_rank is not None:
            model = _with_lora(model, setup)
        if setup.kernels:
            _with_kernels(model, setup, device_facts)
    except MemplanError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise MemplanError(
            f"preparing {model_type} for training failed: {_first_line(exc)}"
        ) from exc
    return model


def _with_lora(model: Any, setup: TrainSetup) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise MemplanError("a LoRA estimate needs peft: pip install peft") from exc
    lora = LoraConfig(
        r=setup.lora_rank,
        lora_alpha=protocol.LORA_ALPHA,
        target_modules=list(setup.lora_targets),
        lora_dropout=0.0,
    )
    try:
        with quiet():
            return get_peft_model(model, lora)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)})
        raise MemplanError(
            f"LoRA targets {', '.join(setup.lora_targets)} do not name linear layers of this "
            f"model ({_first_line(exc)}); its linear layers: {', '.join(names)}"
        ) from exc


def _with_kernels(model: Any, setup: TrainSetup, device_facts: DeviceFacts | None) -> None:
    """memplan's kernels patched in as the worker patches them; their eager paths then run on
    the meta tensors, allocating what they allocate on the GPU (memplan.kernels._op)."""
    from memplan.patching.engine import apply_setup_kernels
    from memplan.patching.forwards import ON_DEVICE

    applied = apply_setup_kernels(model, setup, device_facts or ON_DEVICE)
    missing = set(setup.kernels) - set(applied.kernels)
    if missing:
        raise MemplanError(f"kernels {', '.join(sorted(missing))} do not apply to this model")


def _is_linear(module: Any) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def default_lora_targets(model_type: str) -> tuple[str, ...]:
    """peft's default adapter placement for this model_type, else q_proj and v_proj."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError:
        return FALLBACK_LORA_TARGETS
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return tuple(targets) if targets else FALLBACK_LORA_TARGETS


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' and peft's warnings (about meta weights, unused config keys) would drown
    the one line the command prints."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
