"""Probe: the GLU backward's tile order (GluOp.backward_last_tile_first). A backward that walks
its tiles from the last one down starts on what the kernel before it touched last, still in the
L2; walking them from the first one up, it starts on data that kernel touched first, long since
evicted.

Two measurements, each in interleaved rounds with the order of the variants rotated (the GPU's
clock drifts by ~2% a minute under this load, session 15):

1. forward+backward as bench_kernels.py times it (do_bench, L2 flushed before each call, medians
   over rounds): torch.compile, and memplan in place and out of place with each tile order.
   Ratios to torch.compile are medians of the per-round ratios, as in bench_kernels.py.
2. the backward kernel alone after the kernel that precedes it in training: down_proj's d_product
   GEMM (d_out @ W_down) for a Llama-3-8B-like MLP (SwiGLU, hidden 4096, intermediate 14336) and
   a Gemma-7B-like one (GeGLU, 3072, 24576), 8192 tokens. The L2 is flushed, the GEMM runs, and
   CUDA events time the backward (in place, writing the product over d_product) alone.

    python benchmarks/probe_glu_order.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from bench_kernels import CASES, bench_ms, fwd_bwd, patched, rotated

from memplan.kernels import _glu as mp_glu
from memplan.kernels import geglu as mp_geglu
from memplan.kernels import swiglu as mp_swiglu

# The bench_kernels.py cells where memplan's forward+backward read 1.000-1.008 x torch.compile's
# (docs/bench_kernels.md, session 15), and one size where the tensors fit in the L2.
SIZES = [("swiglu", (16384, 8192)), ("swiglu", (16384, 14336)), ("swiglu", (65536, 4096)),
         ("swiglu", (4096, 14336)), ("geglu", (16384, 8192)), ("geglu", (65536, 4096)),
         ("swiglu", (4096, 1024))]  # fmt: skip
# (op, tokens, hidden, intermediate) of the training-step pair
MLPS = [("swiglu", 8192, 4096, 14336), ("geglu", 8192, 3072, 24576)]
BACKWARD = {"swiglu": mp_swiglu.swiglu_backward, "geglu": mp_geglu.geglu_backward}
ORDERS = {"last tile first": True, "first tile first": False}


def in_order(last_tile_first: bool | None, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with the GLU backward's tile order set (None: leave it, for torch.compile)."""
    if last_tile_first is None:
        return fn

    def call() -> object:
        with patched(mp_glu.GluOp, backward_last_tile_first=last_tile_first):
            return fn()

    return call


def forward_backward(op: str, size: tuple[int, int], rounds: int) -> None:
    factories = CASES[op](*size)
    steps: dict[str, Callable[[], object]] = {}
    baseline = "torch.compile"
    case = factories[baseline]()
    steps[baseline] = lambda case=case: fwd_bwd(case)
    for impl in ("memplan in-place bwd", "memplan"):
        for order, flag in ORDERS.items():
            case = factories[impl]()
            steps[f"{impl}, {order}"] = in_order(flag, lambda case=case: fwd_bwd(case))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for r in range(rounds):
        for name in rotated(list(steps), r):
            times[name].append(bench_ms(steps[name]))
    print(f"\n{op} {size[0]}x{size[1]}, forward+backward, do_bench median of {rounds} rounds")
    print(f"| variant | ms | x {baseline} (median of rounds) |\n|---|---:|---:|")
    for name, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[baseline]))
        print(f"| {name} | {statistics.median(t):.4f} | {ratio:.4f} |")


def after_gemm(op: str, tokens: int, hidden: int, inter: int, rounds: int) -> None:
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    d_out = torch.randn(tokens, hidden, **bf16)
    weight = torch.randn(hidden, inter, **bf16) / hidden**0.5
    gate, up = torch.randn(tokens, inter, **bf16), torch.randn(tokens, inter, **bf16)
    buffer = torch.empty(tokens, inter, **bf16)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    backward = BACKWARD[op]

    def backward_us(last_tile_first: bool, repeats: int = 10) -> float:
        samples = []
        with patched(mp_glu.GluOp, backward_last_tile_first=last_tile_first):
            for _ in range(repeats):
                flush.zero_()
                torch.matmul(d_out, weight, out=buffer)
                start.record()
                backward(buffer, gate, up, dgate=gate, dup=up, product=buffer)
                end.record()
                torch.cuda.synchronize()
                samples.append(1e3 * start.elapsed_time(end))
        return statistics.median(samples)

    times: dict[str, list[float]] = {name: [] for name in ORDERS}
    for flag in ORDERS.values():
        backward_us(flag, 2)
    for r in range(rounds):
        for name in rotated(list(ORDERS), r):
            times[name].append(backward_us(ORDERS[name]))
    print(f"\n{op} backward after the d_product GEMM, {tokens} tokens x {inter} "
          f"(hidden {hidden}), us, median of {rounds} rounds")  # fmt: skip
    for name, t in times.items():
        print(f"- {name}: {statistics.median(t):.1f} (range {min(t):.1f}-{max(t):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="two sizes, no GEMM pairs")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    with torch.cuda.stream(torch.cuda.Stream()):  # as bench_kernels.py runs its cases
        for op, size in SIZES[:2] if args.quick else SIZES:
            forward_backward(op, size, args.rounds)
            torch.cuda.empty_cache()
        for mlp in [] if args.quick else MLPS:
            after_gemm(*mlp, args.rounds)


if __name__ == "__main__":
    main()
