"""Probe: the cross-entropy kernel's time with a logit softcap (Gemma 2's 30), for comparing two
source trees (A/B of a kernel change) in separate processes.

    python benchmarks/probe_softcap.py [SOURCE_ROOT]

SOURCE_ROOT (default: this checkout) is put first on sys.path, so an extracted older tree
(`git archive REV memplan | tar x -C /tmp/old`) can be timed the same way. Session 10 timed the
series form of tanh near 0 here: +15-17% forward at cap 30, so it runs only for caps >= 1e3."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

from memplan.kernels.cross_entropy import cross_entropy  # noqa: E402


def main() -> None:
    for rows, vocab in ((8192, 256000), (16384, 32000)):
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        leaf = logits.clone().requires_grad_()

        def forward(logits=logits, target=target) -> None:
            cross_entropy(logits, target, softcap=30.0)

        def forward_backward(leaf=leaf, target=target) -> None:
            cross_entropy(leaf, target, softcap=30.0).backward()

        fwd = triton.testing.do_bench(forward)
        both = triton.testing.do_bench(forward_backward)
        print(f"{rows} x {vocab} softcap 30: forward {fwd:.3f} ms, forward+backward {both:.3f} ms")


if __name__ == "__main__":
    main()
