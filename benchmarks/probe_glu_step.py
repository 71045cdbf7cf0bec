"""Probe: where GeGLU 16384x8192's forward+backward loses 4 us to torch.compile's (0.497 against
0.493 ms on the GPU alone, docs/bench_kernels.md, session 15) when its kernels alone tie or lead
(Nsight Compute: backward 307.5 against 306.9-307.4 us).

bench_kernels.py times memplan's in-place mode on inputs it overwrites: every timed call writes
the gradients over gate and up, and the next call's forward reads them. After many calls the
inputs hold whatever that recursion leaves, not the random values the other implementations
keep. This probe measures, GPU time alone (do_bench_cudagraph, median over interleaved rounds):
- forward+backward through autograd: memplan in place (its inputs drifting, as in the bench),
  memplan out of place, torch.compile;
- memplan's backward kernel alone, out of place, on fresh random inputs and on the drifted ones;
and prints what the drifted inputs hold (zeros, subnormals, non-finite values, median |x|).

With --ncu, each forward+backward runs once after a warm-up, for Nsight Compute with the L2 left
as the previous kernel leaves it (--cache-control none):

    ncu --clock-control none --cache-control none --kernel-name regex:"geglu|triton_poi" \\
        --metrics gpu__time_duration.sum python benchmarks/probe_glu_step.py --ncu

    python benchmarks/probe_glu_step.py [--size 16384x8192] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from bench_kernels import graph_ms, rotated

from memplan.kernels import geglu as G


def activation_input(rows: int, cols: int, scale: float) -> torch.Tensor:
    """A non-leaf bf16 tensor that requires grad, as bench_kernels.py's inputs."""
    leaf = (torch.randn(rows, cols, device="cuda") * scale).to(torch.bfloat16).requires_grad_()
    return leaf * 1


def eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def forward_backward(fn: Callable, gate, up, d_out) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(fn(gate, up), (gate, up), d_out)


def us(fn: Callable[[], object]) -> float:
    """bench_kernels.py's CUDA-graph time, captured on the current stream (where the inputs'
    autograd nodes were recorded: see graph_ms)."""
    return 1e3 * graph_ms(fn)


def describe(name: str, t: torch.Tensor) -> str:
    t = t.detach().float()
    finite = t.isfinite()
    tiny = (t != 0) & (t.abs() < torch.finfo(torch.bfloat16).tiny)
    magnitude = t[finite].abs().median().item() if finite.any() else float("nan")
    return (
        f"{name}: zeros {(t == 0).float().mean().item():.3f}, subnormal "
        f"{tiny.float().mean().item():.3f}, non-finite {(~finite).float().mean().item():.3f}, "
        f"median |x| {magnitude:.3g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16384x8192")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ncu", action="store_true", help="run each step once for Nsight Compute")
    args = parser.parse_args()
    rows, cols = (int(v) for v in args.size.split("x"))
    with torch.cuda.stream(torch.cuda.Stream()):  # as bench_kernels.py runs its cases
        run(rows, cols, args.rounds, args.ncu)


def run(rows: int, cols: int, rounds: int, ncu: bool) -> None:
    torch.manual_seed(0)
    inputs = {
        name: (activation_input(rows, cols, 2.0), activation_input(rows, cols, 1.0))
        for name in ("in place", "out of place", "compile")
    }
    d_out = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(eager, dynamic=False)
    steps = {
        "memplan in place, inputs drifting": partial(
            forward_backward, partial(G.geglu, in_place_backward=True), *inputs["in place"], d_out
        ),
        "memplan out of place": partial(forward_backward, G.geglu, *inputs["out of place"], d_out),
        "torch.compile": partial(forward_backward, compiled, *inputs["compile"], d_out),
    }
    for step in steps.values():
        step()
    if ncu:
        torch.cuda.synchronize()
        for step in steps.values():
            step()
        torch.cuda.synchronize()
        return
    times: dict[str, list[float]] = {name: [] for name in steps}
    fresh = [t.detach().clone() for t in inputs["out of place"]]
    drifted = fresh
    for r in range(rounds):
        for name in rotated(list(steps), r):
            times[name].append(us(steps[name]))
        drifted = [t.detach().clone() for t in inputs["in place"]]
        for label, (gate, up) in (("backward alone, fresh inputs", fresh),
                                  ("backward alone, drifted inputs", drifted)):  # fmt: skip
            d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
            kernel = partial(G.geglu_backward, d_out, gate, up, d_gate, d_up)
            times.setdefault(label, []).append(us(kernel))
    print(torch.cuda.get_device_name(), f"geglu {rows}x{cols}, median of {rounds} rounds")
    for name, t in times.items():
        print(f"- {name}: {statistics.median(t):.1f} us (range {min(t):.1f}-{max(t):.1f})")
    print(describe("drifted gate", drifted[0]))
    print(describe("drifted up", drifted[1]))
    print(describe("fresh gate", fresh[0]))


if __name__ == "__main__":
    main()
