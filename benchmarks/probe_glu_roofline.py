"""Probe: SwiGLU and GeGLU at the sizes where memplan ties torch.compile at the memory roofline
(1.000-1.010 x its forward+backward time, docs/bench_kernels.md, session 11). GPU time alone
(CUDA graph, median, us) of the forward and the in-place backward for:

- memplan's committed kernels (ROWS x BLOCK tiles numbered along memory, one per program);
- flat variants over contiguous memory: BLOCK elements per tile, one tile per program or a
  persistent grid of P programs per SM striding over the tiles, with or without cache hints
  (loads evict_first, stores ".cs": data touched once need not stay in L2).
Every variant's outputs are compared with memplan's (bit-identical, or flagged).

    python benchmarks/probe_glu_roofline.py [--sizes 16384x8192,...] [--ops swiglu,geglu]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from memplan.kernels import geglu as G
from memplan.kernels import swiglu as S
from memplan.kernels._utils import num_sms

SIZES = [(4096, 14336), (16384, 8192), (65536, 4096)]
MEMPLAN = {
    "swiglu": (S.swiglu_forward, S.swiglu_backward),
    "geglu": (G.geglu_forward, G.geglu_backward),
}


@triton.jit
def _act(g, GELU: tl.constexpr):
    """(act(g), act'(g)) in fp32, memplan's expressions."""
    if GELU:
        return G._gelu_and_slope(g, False)
    sig = tl.sigmoid(g)
    return g * sig, sig * (1.0 + g * (1.0 - sig))


@triton.jit
def _load(ptr, offs, mask, HINTS: tl.constexpr):
    if HINTS:
        return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(
            tl.float32
        )
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, offs, value, mask, HINTS: tl.constexpr):
    if HINTS:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(tile, n, BLOCK: tl.constexpr):
    """Offsets and mask of flat tile `tile` (int32: the probe's sizes are < 2**31)."""
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def flat_forward(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                 HINTS: tl.constexpr):  # fmt: skip
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs, mask = _tile(tile, n, BLOCK)
        g = _load(g_ptr, offs, mask, HINTS)
        u = _load(u_ptr, offs, mask, HINTS)
        act, _ = _act(g, GELU)
        _store(o_ptr, offs, act * u, mask, HINTS)


@triton.jit
def flat_backward(do_ptr, g_ptr, u_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                  HINTS: tl.constexpr):  # fmt: skip
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs, mask = _tile(tile, n, BLOCK)
        do = _load(do_ptr, offs, mask, HINTS)
        g = _load(g_ptr, offs, mask, HINTS)
        u = _load(u_ptr, offs, mask, HINTS)
        act, slope = _act(g, GELU)
        _store(g_ptr, offs, do * u * slope, mask, HINTS)
        _store(u_ptr, offs, do * act, mask, HINTS)


def us(fn) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=100, return_mode="median")


def probe(op: str, rows: int, cols: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    g0 = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    u0, do = torch.randn_like(g0), torch.randn_like(g0)
    n = g0.numel()
    forward, backward = MEMPLAN[op]
    ref_out = forward(g0, u0)
    ref_dg, ref_du = backward(do, g0, u0)
    gelu = op == "geglu"

    def committed() -> tuple[str, float, float]:
        g, u = g0.clone(), u0.clone()
        return (
            "memplan committed",
            us(partial(forward, g0, u0)),
            us(partial(backward, do, g, u, g, u)),
        )

    results = [committed()]
    for block, warps in ((2048, 8), (2048, 4), (4096, 8), (1024, 4)):
        for per_sm in (None, 4, 8):
            for hints in (False, True):
                grid = (triton.cdiv(n, block) if per_sm is None else num_sms() * per_sm,)
                kw = {"BLOCK": block, "GELU": gelu, "HINTS": hints, "num_warps": warps}
                out, g, u = torch.empty_like(g0), g0.clone(), u0.clone()
                flat_forward[grid](g0, u0, out, n, **kw)
                flat_backward[grid](do, g, u, n, **kw)
                same = all(
                    torch.equal(got, want)
                    for got, want in ((out, ref_out), (g, ref_dg), (u, ref_du))
                )
                fwd = us(partial(flat_forward[grid], g0, u0, out, n, **kw))
                bwd = us(partial(flat_backward[grid], do, g, u, n, **kw))
                label = f"flat block={block} warps={warps} per_sm={per_sm} hints={hints}"
                label += "" if same else " (OUTPUTS DIFFER from memplan's)"
                results.append((label, fwd, bwd))
    results.append(committed())  # again, for the drift over the run
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(f"{r}x{c}" for r, c in SIZES))
    parser.add_argument("--ops", default=",".join(MEMPLAN))
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}")
    for op in args.ops.split(","):
        for rows, cols in sizes:
            print(f"\n## {op} {rows}x{cols}: GPU us, forward / in-place backward / sum")
            results = probe(op, rows, cols)
            best = min(results, key=lambda r: r[1] + r[2])
            for label, fwd, bwd in results:
                mark = "  <- fastest" if label == best[0] else ""
                print(f"- {label}: {fwd:.1f} / {bwd:.1f} / {fwd + bwd:.1f}{mark}", flush=True)


if __name__ == "__main__":
    main()
