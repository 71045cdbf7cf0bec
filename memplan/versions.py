"""The versions memplan was validated with, as data, and the one warning line when what is
installed lies outside them. Torch-free: versions are read with importlib.metadata, so the
advise path can check them without importing torch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata
from typing import TextIO


@dataclass(frozen=True)
class Validated:
    """One setup memplan was validated on: the releases, the GPU, what ran there and the
    committed result files (glob patterns from the repository's root) that record it."""

    torch: str
    triton: str
    transformers: str
    gpu: str | None  # torch.cuda.get_device_name(); None: CPU, Triton's interpreter
    ran: str
    results: tuple[str, ...] = ()


VALIDATED: tuple[Validated, ...] = (
    Validated(
        "2.11.0", "3.6.0", "5.17.0", "NVIDIA H200",
        "the GPU tests, the kernel and loss benchmarks, the accuracy measurements",
        ("tests/data/measurements_h200.json", "benchmarks/results_*h200*.json"),
    ),
    Validated(
        "2.11.0", "3.6.0", "5.17.0", "NVIDIA H100 80GB HBM3",
        "end-to-end training steps",
        ("benchmarks/results_e2e_h100.json",),
    ),
    Validated("2.13.0", "3.9.0", "5.17.0", None, "the CPU test suite, pinned (.ci/run)"),
)  # fmt: skip

PACKAGES = ("torch", "triton", "transformers")


def release(version: str) -> str:
    """The release part of a version: '2.11.0+cu130' -> '2.11.0'."""
    return version.split("+", 1)[0]


def installed_versions() -> dict[str, str | None]:
    """The installed release of each of PACKAGES (None where it is not installed)."""
    found: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            found[package] = release(metadata.version(package))
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def unvalidated(installed: dict[str, str | None], gpu: str | None = None) -> list[str]:
    """'name version' for each installed package (and the GPU, when given) that no row of
    VALIDATED has."""
    outside = [
        f"{package} {version}"
        for package, version in installed.items()
        if version is not None and version not in {getattr(v, package) for v in VALIDATED}
    ]
    if gpu is not None and gpu not in {v.gpu for v in VALIDATED}:
        outside.append(f"GPU {gpu}")
    return outside


def warning_line(installed: dict[str, str | None], gpu: str | None = None) -> str | None:
    """The one warning line for what lies outside VALIDATED, or None."""
    outside = unvalidated(installed, gpu)
    if not outside:
        return None
    validated = "; ".join(
        f"{package} {', '.join(sorted({getattr(v, package) for v in VALIDATED}))}"
        for package in PACKAGES
    )
    gpus = ", ".join(sorted({v.gpu for v in VALIDATED if v.gpu}))
    return (
        f"Warning: memplan was not validated with {', '.join(outside)} (validated: {validated}; "
        f"GPUs {gpus}); its kernels and predictions may differ there."
    )


def warn_if_unvalidated(gpu: str | None = None, stream: TextIO | None = None) -> bool:
    """Print the warning line on stderr if the installed versions (or `gpu`) are outside
    VALIDATED; True if it did."""
    line = warning_line(installed_versions(), gpu)
    if line is None:
        return False
    print(line, file=stream or sys.stderr)
    return True
