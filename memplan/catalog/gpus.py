"""The shipped GPU catalog (gpus.json), `--gpu NAME` lookup and `--gpu-mem SIZE` parsing.

memory_bytes is the device total as nvidia-smi reports it (MiB * 2**20); capacity_bytes, where
an entry has it, is what PyTorch's caching allocator could reserve in a training process on that
GPU (benchmarks/measure_gpu_capacity.py), and otherwise Gpu derives a nominal one."""

from __future__ import annotations

import functools
import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memplan.errors import UsageError
from memplan.schema import Gpu

_GPUS_JSON = Path(__file__).with_name("gpus.json")
DEFAULT_GPU = "h100-80gb"

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "ki": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mi": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gi": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "ti": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@functools.cache
def _entries() -> dict[str, dict[str, Any]]:
    return json.loads(_GPUS_JSON.read_text())


def _normalize(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


@functools.cache
def _names() -> dict[str, str]:
    """Every accepted spelling (normalized) -> catalog key."""
    names: dict[str, str] = {}
    for key, entry in _entries().items():
        for name in (key, entry["name"], entry["device_name"], *entry["aliases"]):
            names[_normalize(name)] = key
    return names


def _gpu(key: str) -> Gpu:
    entry = _entries()[key]
    return Gpu(
        name=entry["name"],
        memory_bytes=entry["memory_bytes"],
        capacity_bytes=entry.get("capacity_bytes"),
        capacity_measured="capacity_bytes" in entry,
        compute_capability=tuple(entry["compute_capability"]),
        sm_count=entry.get("sm_count"),
    )


def list_gpus() -> list[tuple[str, Gpu]]:
    """Every catalog GPU as (key, Gpu), in catalog order."""
    return [(key, _gpu(key)) for key in _entries()]


def resolve_gpu(name: str | None = None, memory: str | int | None = None) -> Gpu:
    """The named GPU (default H100 80GB SXM); `memory` overrides its memory (its capacity is then
    nominal), or alone describes a custom GPU. Raises UsageError when the memory leaves nothing
    for the allocator."""
    try:
        if name is None and memory is not None:
            return Gpu(name=f"custom {memory}", memory_bytes=parse_memory(memory))
        gpu = _gpu(_gpu_key(name) if name is not None else DEFAULT_GPU)
        if memory is None:
            return gpu
        return Gpu(
            name=gpu.name,
            memory_bytes=parse_memory(memory),
            compute_capability=gpu.compute_capability,
        )
    except ValidationError as exc:
        bare = str(memory).strip().isdigit()
        raise UsageError(
            f"the GPU memory {memory!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}"
            + (" (a bare number counts bytes: give a unit, e.g. 24GiB or 24GB)" if bare else "")
        ) from None


def _gpu_key(name: str) -> str:
    query = _normalize(name)
    names = _names()
    if query in names:
        return names[query]
    matches = sorted({key for spelling, key in names.items() if query and query in spelling})
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise UsageError(f"GPU name {name!r} is ambiguous; candidates: {', '.join(matches)}")
    raise UsageError(f"unknown GPU {name!r}; known GPUs: {', '.join(_entries())}")


def parse_memory(text: str | int) -> int:
    """Bytes in a size such as "24GiB", "24GB", "80G", "512MiB" or "25769803776".

    GB/MB/TB are decimal (1e9); GiB, Gi and a bare G are binary (2**30)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = Fraction(text)
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(
                f"cannot parse the GPU memory {text!r}; give bytes or a size like 24GiB, 24GB, 80G"
            )
        value = Fraction(match.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and value.denominator != 1:
            raise UsageError(f"a GPU memory in bytes must be a whole number, got {text!r}")
    if int(value) <= 0:
        raise UsageError(f"the GPU memory must be at least one byte, got {text!r}")
    return int(value)


# Ampere (compute capability 8.0) brought bf16 arithmetic, and SDPA's flash attention needs it.
BF16_FROM = (8, 0)
FLASH_ATTENTION_FROM = (8, 0)


def gpu_notes(gpu: Gpu, precision: str, attn: str, grouped_kv: bool) -> list[str]:
    """Warnings for a setup the GPU runs otherwise than the estimate assumes (an older one)."""
    cc = tuple(gpu.compute_capability)
    version = f"compute capability {cc[0]}.{cc[1]}"
    notes = []
    if precision in ("bf16", "amp-bf16") and cc < BF16_FROM:
        notes.append(
            f"{gpu.name} ({version}) has no bf16 arithmetic, which came with 8.0: bf16 training "
            "there is emulated and slow, or refused; --precision amp-fp16 or fp32 is what runs "
            "on it"
        )
    if attn == "sdpa" and precision != "fp32" and cc < FLASH_ATTENTION_FROM:
        gqa = (
            "; with grouped KV heads, as here, transformers asks SDPA for enable_gqa, which "
            "only its math path takes without flash attention: that path keeps each layer's "
            "(heads x seq x seq) probabilities, far more than predicted"
            if grouped_kv
            else ""
        )
        notes.append(
            f"SDPA's flash attention needs compute capability 8.0, which {gpu.name} lacks: the "
            "estimate assumes flash attention, and the memory-efficient kernel that runs "
            f"instead saves about the same{gqa}"
        )
    return notes
