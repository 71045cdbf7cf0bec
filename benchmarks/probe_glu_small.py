"""Probe: SwiGLU and GeGLU at narrow rows, where memplan's GPU time was 1.16 and 1.27 x
Liger's (4096 x 1024, docs/bench_kernels.md, session 5). GPU time alone (CUDA graph, median),
forward and the in-place backward (d_gate, d_up written over gate and up, as memplan.apply runs
it), for:

- memplan's committed kernels and launch configuration (ROWS x BLOCK tiles);
- Liger-Kernel 0.8.5's kernels, where installed;
- with --sweep: memplan's kernels under other (tile, warps) configurations, and for SwiGLU a
  one-row-per-program variant (Liger-Kernel's layout: a scalar int64 row base, int32 column
  offsets, column blocks on grid axis 1) by block and warps, its outputs checked
  bit-identical to memplan's.

Cited in docs/bench_kernels.md.

    python benchmarks/probe_glu_small.py [--sweep] [--sizes 4096x1024,...] [--ops swiglu]
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from memplan.kernels import _glu
from memplan.kernels import geglu as G
from memplan.kernels import swiglu as S
from memplan.kernels._utils import next_power_of_2

MEMPLAN = {
    "swiglu": (S.swiglu_forward, S.swiglu_backward),
    "geglu": (G.geglu_forward, G.geglu_backward),
}
SIZES = [(4096, 1024), (16384, 1024), (4096, 4096), (4096, 14336), (16384, 8192)]


@triton.jit
def row_tile(stride, n_cols, BLOCK: tl.constexpr):
    """(row offset, columns, mask) of this program: one row, one block of columns."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return tl.program_id(0).to(tl.int64) * stride, cols, cols < n_cols


@triton.jit
def row_forward(g_ptr, u_ptr, o_ptr, stride, n_cols, BLOCK: tl.constexpr):
    base, cols, mask = row_tile(stride, n_cols, BLOCK)
    g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + base + cols, (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_backward(do_ptr, g_ptr, u_ptr, stride, n_cols, BLOCK: tl.constexpr):
    base, cols, mask = row_tile(stride, n_cols, BLOCK)
    do = tl.load(do_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = do * u * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(g_ptr + base + cols, dg.to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(u_ptr + base + cols, (do * silu).to(u_ptr.dtype.element_ty), mask=mask)


def graph_us(fn, *args, **kwargs) -> float:
    return 1e3 * do_bench_cudagraph(partial(fn, *args, **kwargs), rep=200, return_mode="median")


def memplan_times(op: str, do, g0, u0) -> tuple[float, float]:
    forward, backward = MEMPLAN[op]
    g, u = g0.clone(), u0.clone()
    return graph_us(forward, g0, u0), graph_us(backward, do, g, u, g, u)


def liger_times(op: str, do, g0, u0) -> tuple[float, float] | None:
    try:
        ops = importlib.import_module(f"liger_kernel.ops.{op}")
    except ImportError:
        return None
    forward, backward = getattr(ops, f"{op}_forward"), getattr(ops, f"{op}_backward")
    g, u = g0.clone(), u0.clone()
    return graph_us(forward, g0, u0), graph_us(backward, g, u, do)


def probe(op: str, rows: int, cols: int, sweep: bool) -> list[tuple[str, float, float]]:
    """memplan as committed, Liger, and with `sweep` the tile configurations (and for SwiGLU
    the one-row-per-program variants)."""
    g0 = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    u0, do = torch.randn_like(g0), torch.randn_like(g0)
    committed = _glu.elementwise_launch_config(cols)
    results = [
        (f"memplan committed (rows, block, warps) = {committed}", *memplan_times(op, do, g0, u0))
    ]
    liger = liger_times(op, do, g0, u0)
    if liger is not None:
        results.append(("Liger 0.8.5", *liger))
    if sweep:
        results += sweep_tiles(op, cols, do, g0, u0)
    if sweep and op == "swiglu":
        results += sweep_row_kernels(rows, cols, do, g0, u0)
    return results


def sweep_tiles(op: str, cols: int, do, g0, u0) -> list[tuple[str, float, float]]:
    results = []
    for tile in (1024, 2048, 4096):
        for warps in (2, 4, 8):
            block = min(next_power_of_2(cols), tile)
            config = (tile // block, block, warps)
            _glu.elementwise_launch_config = lambda n, c=config: c
            try:
                times = memplan_times(op, do, g0, u0)
                results.append((f"memplan tile={tile} warps={warps}", *times))
            finally:
                _glu.elementwise_launch_config = committed_config
    return results


def sweep_row_kernels(rows: int, cols: int, do, g0, u0) -> list[tuple[str, float, float]]:
    ref = (S.swiglu_forward(g0, u0), *S.swiglu_backward(do, g0, u0))
    results = []
    for block in sorted({min(b, next_power_of_2(cols)) for b in (1024, 2048, 4096)}):
        grid = (rows, triton.cdiv(cols, block))
        for warps in (2, 4, 8):
            out, g, u = torch.empty_like(g0), g0.clone(), u0.clone()
            launch = {"BLOCK": block, "num_warps": warps}
            row_forward[grid](g0, u0, out, cols, cols, **launch)
            row_backward[grid](do, g, u, cols, cols, **launch)
            for got, want in zip((out, g, u), ref, strict=True):
                assert torch.equal(got, want), f"row variant differs at {rows}x{cols} {launch}"
            fwd = graph_us(row_forward[grid], g0, u0, out, cols, cols, **launch)
            bwd = graph_us(row_backward[grid], do, g, u, cols, cols, **launch)
            results.append((f"row block={block} warps={warps}", fwd, bwd))
    return results


committed_config = _glu.elementwise_launch_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also the variants (slow)")
    parser.add_argument("--sizes", default=",".join(f"{r}x{c}" for r, c in SIZES))
    parser.add_argument("--ops", default=",".join(MEMPLAN))
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}")
    for op in args.ops.split(","):
        for rows, cols in sizes:
            print(f"\n## {op} {rows}x{cols}: GPU us, forward / in-place backward / sum")
            for label, fwd, bwd in probe(op, rows, cols, args.sweep):
                print(f"- {label}: {fwd:.2f} / {bwd:.2f} / {fwd + bwd:.2f}", flush=True)


if __name__ == "__main__":
    main()
