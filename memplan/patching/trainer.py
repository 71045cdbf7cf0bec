"""Hugging Face Trainer integration: a callback that patches the model the Trainer trains."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from memplan.errors import MemplanError
from memplan.patching.engine import (
    AppliedPatch,
    accelerate_wrapped,
    applied_patch,
    apply,
    displaced_forwards,
    unwrap,
)
from memplan.schema import Plan


class MemplanTrainerCallback(TrainerCallback):
    """`Trainer(..., callbacks=[MemplanTrainerCallback()])` patches the model with memplan when
    the Trainer is built (on_init_end): before Trainer.train hands it to accelerate.prepare,
    whose mixed-precision wrapper then wraps the patched forward. The patch lives on the module
    instances, so DDP, accelerate and PEFT wrappers keep it. on_train_begin patches a model the
    Trainer made afresh (model_init) or one whose callback was added after construction.

    With plan="auto" and `seq` given, the advisor plans for the Trainer's
    per_device_train_batch_size; otherwise every supported kernel is switched on. What was
    applied is in `.applied`."""

    def __init__(
        self,
        plan: Literal["auto"] | Plan | None = "auto",
        *,
        kernels: Sequence[str] | None = None,
        flce_chunk: int | None = None,
        seq: int | None = None,
        gpu: str | None = None,
    ) -> None:
        self.plan = plan
        self.kernels = kernels
        self.flce_chunk = flce_chunk
        self.seq = seq
        self.gpu = gpu
        self.applied: AppliedPatch | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        self._apply(args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        # A model patched at on_init_end is now inside accelerate's wrapper: left as it is.
        if model is None:
            return
        if applied_patch(model) is not None:
            displaced = displaced_forwards(model)
            if displaced:
                warnings.warn(
                    f"memplan: the forward of {', '.join(displaced)} was replaced after the "
                    "callback patched it (TRL's SFTTrainer, for one, installs its own fused LM "
                    "head), so memplan's kernels there do not run; the rest of the patch stays",
                    stacklevel=2,
                )
            return
        if accelerate_wrapped(unwrap(model)):
            raise MemplanError(
                "the Trainer made this model in train() (model_init), or the callback was added "
                "after the Trainer was built, and accelerate's mixed-precision wrapper is already "
                "on its forward, which memplan cannot patch under; call memplan.apply(model) "
                "inside model_init, or pass the callback to Trainer(callbacks=[...])"
            )
        self._apply(args, model)

    def _apply(self, args: Any, model: Any) -> None:
        if model is None:
            return
        planned = self.seq is not None
        self.applied = apply(
            model,
            self.plan,
            kernels=self.kernels,
            flce_chunk=self.flce_chunk,
            batch=args.per_device_train_batch_size if planned else None,
            seq=self.seq,
            gpu=self.gpu,
            setup=trainer_setup(args, model) if planned else None,
        )


# TrainingArguments.optim values whose memory the advisor models, as they run: the Trainer's
# default, adamw_torch_fused, steps in place; adamw_torch is torch's foreach AdamW, whose step
# holds one sqrt(exp_avg_sq) per tensor; transformers' Adafactor keeps factored row and column
# states like torch's.
OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
}


def trainer_setup(args: Any, model: Any) -> dict[str, Any]:
    """The advisor's setup options the Trainer's arguments decide, which the model does not show
    when the Trainer is built: autocast over fp32 weights, gradient checkpointing (switched on in
    Trainer.train), the optimizer, gradient accumulation."""
    setup: dict[str, Any] = {"grad_accum": args.gradient_accumulation_steps}
    if next(unwrap(model).parameters()).dtype == torch.float32:
        if args.bf16:
            setup["precision"] = "amp-bf16"
        elif args.fp16:
            setup["precision"] = "amp-fp16"
    if args.gradient_checkpointing:
        setup["grad_checkpointing"] = True
    name = str(getattr(args.optim, "value", args.optim))
    optimizer = OPTIMIZERS.get(name)
    if optimizer is None:
        warnings.warn(
            f"memplan does not model the memory of optim={name!r} ({', '.join(OPTIMIZERS)} "
            "are): the plan is made as for torch's AdamW",
            stacklevel=2,
        )
    else:
        setup["optimizer"] = optimizer
    return setup
