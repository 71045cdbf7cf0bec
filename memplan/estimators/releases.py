"""What transformers releases changed in the memory of a training step, as data.

The contracts were read off transformers 5.17 (CONTRACTS_RELEASE); a TrainSetup names the
release that runs its step (TrainSetup.transformers, None: CONTRACTS_RELEASE), and the estimator
asks a Release which of these changes apply. Each entry was found by the CPU tests run on the
newer release (.ci/run) and located in transformers' source of the releases in between."""

from __future__ import annotations

import re
from dataclasses import dataclass

from memplan.families import FAMILIES
from memplan.schema import TrainSetup

CONTRACTS_RELEASE = "5.17.0"

# From 5.18 the grouped-matmul experts build the mask of expert-parallel sentinel rows (one bool
# per routed row, kept by masked_fill for backward) only under expert parallelism.
MOE_SENTINEL_MASK_UNTIL = (5, 18)
# From 5.24 DynamicLayer makes the cache's values in value_states' dtype, not the keys'; under
# autocast the keys are fp32 after RoPE and the values the projection's bf16 or fp16.
KV_VALUES_IN_KEY_DTYPE_UNTIL = (5, 24)
# From 5.24 a DeepSeek-style MoE router's weight is made and kept in fp32 in a bf16 model
# (_keep_in_fp32_modules_strict): its fp32 linear copies no weight, and the weight's gradient and
# optimizer states are fp32.
ROUTER_WEIGHT_FP32_FROM = (5, 24)
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def release_tuple(version: str) -> tuple[int, int, int]:
    """'5.24.0' -> (5, 24, 0); a suffix (.dev0, rc1, +local) is ignored."""
    match = _VERSION.match(version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a transformers release such as 5.17.0")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def release_text(version: str) -> str:
    """'5.24.0+local' -> '5.24.0', '5.24' -> '5.24.0' (ValueError as release_tuple)."""
    return ".".join(map(str, release_tuple(version)))


@dataclass(frozen=True)
class Release:
    """The transformers release that runs a step, and the memory behaviours that follow from it."""

    version: tuple[int, int, int]

    @classmethod
    def of(cls, transformers: str | None) -> Release:
        return cls(release_tuple(transformers or CONTRACTS_RELEASE))

    @property
    def moe_sentinel_mask(self) -> bool:
        return self.version[:2] < MOE_SENTINEL_MASK_UNTIL

    @property
    def kv_values_in_key_dtype(self) -> bool:
        return self.version[:2] < KV_VALUES_IN_KEY_DTYPE_UNTIL

    def router_weight_in_fp32(self, model_type: str) -> bool:
        family = FAMILIES.get(model_type)
        moe = family.config.moe if family is not None else None
        sigmoid = moe is not None and moe.router == "sigmoid_fp32"
        return sigmoid and self.version[:2] >= ROUTER_WEIGHT_FP32_FROM

    def refuses_sdpa(self, model_type: str) -> bool:
        family = FAMILIES.get(model_type)
        first = family.sdpa_refused_from if family is not None else None
        return first is not None and self.version[:2] >= first


def as_run_by(model_type: str, setup: TrainSetup, transformers: str | None) -> TrainSetup:
    """The setup as `transformers` runs it: that release named, and eager attention where the
    release refuses SDPA for the model type (it builds the model with eager then)."""
    setup = setup.model_copy(update={"transformers": transformers})
    if setup.attn == "sdpa" and Release.of(transformers).refuses_sdpa(model_type):
        return setup.model_copy(update={"attn": "eager"})
    return setup
