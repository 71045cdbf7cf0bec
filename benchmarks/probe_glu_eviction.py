"""Probe: the eviction policies of the GLU kernels' loads (memplan.kernels._glu.EVICTION). In
place, the backward writes the gradients over the lines it has just read; probe_glu_backward.py
measured that 0.1-0.7% slower than the same kernel writing new tensors, and "evict_last" on the
loads of gate and up closing the gap. Nsight Compute's DRAM bytes of the kernels (--ncu) show
whether the lines a policy keeps in the L2 cost the next kernel.

Two measurements, each in interleaved rounds with the order of the variants rotated (the GPU's
clock drifts by ~2% a minute under this load, session 15):

1. forward+backward as bench_kernels.py times it (do_bench, L2 flushed before each call, medians
   over rounds): torch.compile, memplan in place with each policy, and memplan out of place
   with the first two. Ratios
   to torch.compile are medians of the per-round ratios, as in bench_kernels.py.
2. the backward kernel between the kernels around it in training, for a Llama-3-8B-like MLP
   (SwiGLU, hidden 4096, intermediate 14336) and a Gemma-7B-like one (GeGLU, 3072, 24576), 8192
   tokens: the L2 is flushed, down_proj's d_product GEMM (d_out @ W_down) runs, then the
   backward (in place, writing the product over d_product), then gate_proj's d_x GEMM reading
   d_gate; CUDA events time the last two.

Session 16 ran this probe, as probe_glu_order.py at commit 166ac53, on the order of the
backward's tiles instead (last tile first, to start on what the forward left in the L2): 0.25-0.4%
faster in forward+backward, no faster after the GEMM, so not adopted (docs/bench_kernels.md).

    python benchmarks/probe_glu_eviction.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from types import SimpleNamespace

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
_DEFAULT = {key: "" for key in mp_glu.EVICTION}
# The committed policies (evict_last on every load since session 16), the default, and the first
# step session 16 measured: evict_last on the backward's loads of gate and up alone.
POLICIES = {
    "committed": dict(mp_glu.EVICTION),
    "default policies": _DEFAULT,
    "evict_last on gate and up in backward": {**_DEFAULT, "backward_gate_up": "evict_last"},
}


def with_policy(policy: dict[str, str], fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with the GLU kernels' loads under `policy` (memplan.kernels._glu.EVICTION)."""

    def call() -> object:
        with patched(mp_glu, EVICTION=policy):
            return fn()

    return call


def forward_backward(op: str, size: tuple[int, int], rounds: int) -> None:
    factories = CASES[op](*size)
    steps: dict[str, Callable[[], object]] = {}
    baseline = "torch.compile"
    case = factories[baseline]()
    steps[baseline] = lambda case=case: fwd_bwd(case)
    for impl in ("memplan in-place bwd", "memplan"):
        for name, policy in POLICIES.items() if impl != "memplan" else list(POLICIES.items())[:2]:
            case = factories[impl]()
            steps[f"{impl}, {name}"] = with_policy(policy, lambda case=case: fwd_bwd(case))
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


def mlp_tensors(tokens: int, hidden: int, inter: int) -> SimpleNamespace:
    """The tensors of training_sequence, random bf16, and a 256 MB buffer to flush the L2."""
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    return SimpleNamespace(
        d_out=torch.randn(tokens, hidden, **bf16),
        w_down=torch.randn(hidden, inter, **bf16) / hidden**0.5,
        w_gate=torch.randn(inter, hidden, **bf16) / inter**0.5,
        gate=torch.randn(tokens, inter, **bf16),
        up=torch.randn(tokens, inter, **bf16),
        buffer=torch.empty(tokens, inter, **bf16),
        d_x=torch.empty(tokens, hidden, **bf16),
        flush=torch.empty(256 * 2**20, dtype=torch.int8, device="cuda"),
    )


def training_sequence(op: str, t: SimpleNamespace, events: list | None = None) -> None:
    """The L2 flushed, down_proj's d_product GEMM, the backward in place writing the product
    over d_product (as memplan.apply runs it), gate_proj's d_x GEMM reading d_gate; `events`
    (three) recorded before the backward, between it and the GEMM, and after the GEMM."""
    t.flush.zero_()
    torch.matmul(t.d_out, t.w_down, out=t.buffer)
    kernels = (
        lambda: BACKWARD[op](t.buffer, t.gate, t.up, dgate=t.gate, dup=t.up, product=t.buffer),
        lambda: torch.matmul(t.gate, t.w_gate, out=t.d_x),
    )
    for i, kernel in enumerate(kernels):
        if events:
            events[i].record()
        kernel()
    if events:
        events[-1].record()


def after_gemm(op: str, tokens: int, hidden: int, inter: int, rounds: int) -> None:
    tensors = mlp_tensors(tokens, hidden, inter)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def sample(policy: dict[str, str], repeats: int = 10) -> tuple[float, float]:
        """Median us of the backward, and of the d_x GEMM after it."""
        samples = []
        with patched(mp_glu, EVICTION=policy):
            for _ in range(repeats):
                training_sequence(op, tensors, events)
                torch.cuda.synchronize()
                samples.append([1e3 * events[i].elapsed_time(events[i + 1]) for i in (0, 1)])
        return tuple(statistics.median(column) for column in zip(*samples))

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in POLICIES}
    for policy in POLICIES.values():
        sample(policy, 2)
    for r in range(rounds):
        for name in rotated(list(POLICIES), r):
            times[name].append(sample(POLICIES[name]))
    print(f"\n{op} backward after the d_product GEMM, then the d_x GEMM reading d_gate; {tokens}"
          f" tokens x {inter} (hidden {hidden}), us, median of {rounds} rounds")  # fmt: skip
    for name, t in times.items():
        glu, gemm = ([s[i] for s in t] for i in (0, 1))
        print(f"- {name}: backward {statistics.median(glu):.1f} (range {min(glu):.1f}-"
              f"{max(glu):.1f}), next GEMM {statistics.median(gemm):.1f} (range "
              f"{min(gemm):.1f}-{max(gemm):.1f})")  # fmt: skip


def sequence_for_ncu(op: str, tokens: int, hidden: int, inter: int) -> None:
    """training_sequence once per policy after a warm-up, for Nsight Compute to count the DRAM
    bytes of each kernel with the L2 as the previous kernel left it:

        ncu --clock-control none --cache-control none \\
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
            python benchmarks/probe_glu_eviction.py --ncu
    """
    tensors = mlp_tensors(tokens, hidden, inter)
    for _ in range(2):  # a warm-up, then the launches to read (4 kernels per policy)
        for policy in POLICIES.values():
            with patched(mp_glu, EVICTION=policy):
                training_sequence(op, tensors)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="two sizes, no GEMM pairs")
    parser.add_argument("--ncu", action="store_true", help="sequence_for_ncu on the first MLP")
    args = parser.parse_args()
    if args.ncu:
        sequence_for_ncu(*MLPS[0])
        return
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    with torch.cuda.stream(torch.cuda.Stream()):  # as bench_kernels.py runs its cases
        for op, size in SIZES[:2] if args.quick else SIZES:
            forward_backward(op, size, args.rounds)
            torch.cuda.empty_cache()
        for mlp in [] if args.quick else MLPS:
            after_gemm(*mlp, args.rounds)


if __name__ == "__main__":
    main()
