"""Probe: does the GLU backward gain from Inductor's memory layout? At the sizes where memplan's
forward+backward reads 1.000-1.008 x torch.compile's (docs/bench_kernels.md, session 15;
memplan's forward is the faster one). Inductor's pointwise kernels are flat: one block of a
contiguous tensor per program, int32 offsets, no mask when the block divides the element count.
With --ncu, each backward kernel runs once for Nsight Compute (run_once_for_ncu).

GPU time alone (do_bench_cudagraph, median over interleaved rounds, us), bf16, in place over
gate and up (as memplan.apply runs it): memplan's committed backward kernel (ROWS x BLOCK tiles,
int64 row offsets, masked) and flat kernels of the same math with Inductor's layout. The rounds
rotate the order of the implementations: the GPU's clock drifts by ~2% over a minute of this
load (session 15), more than the differences measured here. Outputs of the variants are compared
with the committed kernel's (bit-identical expected).

    python benchmarks/probe_glu_backward.py [--ops geglu,swiglu] [--sizes 16384x8192,...]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_kernels import rotations
from probe_glu_roofline import _act
from triton.testing import do_bench_cudagraph

from memplan.kernels import geglu as G
from memplan.kernels import swiglu as S

SIZES = [(16384, 8192), (65536, 4096), (4096, 14336)]
BACKWARD = {"swiglu": S.swiglu_backward, "geglu": G.geglu_backward}
FLAT = [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # (BLOCK, num_warps)


@triton.jit
def _flat_backward(do_ptr, g_ptr, u_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                   MASKED: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n if MASKED else None
    do = tl.load(do_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    act, slope = _act(g, GELU)
    tl.store(g_ptr + offs, (do * u * slope).to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(u_ptr + offs, (do * act).to(u_ptr.dtype.element_ty), mask=mask)


def flat(d_out, gate, up, op: str, block: int, warps: int) -> None:
    n = gate.numel()
    _flat_backward[(triton.cdiv(n, block),)](
        d_out, gate, up, n, BLOCK=block, GELU=op == "geglu", MASKED=n % block != 0,
        num_warps=warps,
    )  # fmt: skip


def us(fn: Callable[[], object]) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def probe(op: str, rows: int, cols: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    gate0 = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    up0, d_out = torch.randn_like(gate0), torch.randn_like(gate0)
    backward = BACKWARD[op]
    want = backward(d_out, gate0, up0)
    gate, up = gate0.clone(), up0.clone()
    impls: dict[str, Callable[[], object]] = {
        "memplan committed, in place": partial(backward, d_out, gate, up, gate, up)
    }
    for block, warps in FLAT:
        g, u = gate0.clone(), up0.clone()
        flat(d_out, g, u, op, block, warps)
        same = torch.equal(g, want[0]) and torch.equal(u, want[1])
        label = f"flat BLOCK={block} warps={warps}" + ("" if same else " (OUTPUTS DIFFER)")
        impls[label] = partial(flat, d_out, g, u, op, block, warps)

    times: dict[str, list[float]] = {name: [] for name in impls}
    for name in rotations(list(impls), rounds):
        times[name].append(us(impls[name]))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return medians


def run_once_for_ncu(op: str, rows: int, cols: int) -> None:
    """memplan's backward kernel and torch.compile's forward+backward of act(gate) * up, each
    run once after a warm-up, for Nsight Compute to read their counters:

        ncu --clock-control none --kernel-name regex:"backward|triton_poi" \\
            --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes.sum \\
            python benchmarks/probe_glu_backward.py --ncu geglu:16384x8192
    """
    torch.manual_seed(0)
    gate = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    up, d_out = torch.randn_like(gate), torch.randn_like(gate)
    act = (lambda g: F.silu(g)) if op == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))
    compiled = torch.compile(lambda g, u: act(g) * u, dynamic=False)
    g_leaf, u_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    for _ in range(2):  # the second call is the one to read: compiled and warm
        BACKWARD[op](d_out, gate, up)
        torch.autograd.grad(compiled(g_leaf, u_leaf), (g_leaf, u_leaf), d_out)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="geglu,swiglu")
    parser.add_argument("--sizes", default=",".join(f"{r}x{c}" for r, c in SIZES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ncu", metavar="OP:ROWSxCOLS", help="run once for Nsight Compute")
    args = parser.parse_args()
    if args.ncu:
        op, size = args.ncu.split(":")
        run_once_for_ncu(op, *(int(v) for v in size.split("x")))
        return
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    with torch.cuda.stream(torch.cuda.Stream()):
        for op in args.ops.split(","):
            for size in args.sizes.split(","):
                rows, cols = (int(v) for v in size.split("x"))
                print(f"\n## {op} {rows}x{cols}: GPU us, median of {args.rounds} rounds")
                for name, t in probe(op, rows, cols, args.rounds).items():
                    print(f"- {name}: {t:.1f}", flush=True)


if __name__ == "__main__":
    main()
