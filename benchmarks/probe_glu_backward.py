"""Probe: what the GLU backward kernel's time depends on, at the sizes where both it and
torch.compile's run at the memory roofline. GPU time alone (do_bench_cudagraph, median over
interleaved rounds, us), bf16; the rounds rotate the order of the implementations, since the
GPU's clock drifts by ~2% over a minute of this load (session 15). The variants:
- memplan's committed kernel in place over gate and up (as memplan.apply runs it), out of place,
  and in place with the gradients swapped (d_gate over up's buffer, d_up over gate's);
- flat kernels of the same math with Inductor's layout (one block of a contiguous tensor per
  program, int32 offsets, no mask when the block divides the element count), in place or out of
  place, with cache modifiers (.cg/.cs) or eviction policies on the loads of gate and up;
- Inductor's own backward (torch.compile of the two gradients, out of place), and its generated
  kernel (torch 2.11) launched from here, with memplan's math or its own;
- with --tma, TMA-descriptor kernels, one tile per program or persistent and pipelined.
Outputs are compared with the committed kernel's: bit-identical expected, within 0.1 for
Inductor's, whose bf16 rounding differs. With --ncu, memplan's backward and torch.compile's
forward+backward run once each for Nsight Compute (run_once_for_ncu).

    python benchmarks/probe_glu_backward.py [--ops geglu,swiglu] [--sizes 16384x8192,...] [--tma]
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
from triton.language.extra import libdevice
from triton.testing import do_bench_cudagraph

from memplan.kernels import geglu as G
from memplan.kernels import swiglu as S

SIZES = [(16384, 8192), (65536, 4096), (4096, 14336)]
BACKWARD = {"swiglu": S.swiglu_backward, "geglu": G.geglu_backward}
# (BLOCK, num_warps, in place, cache modifier of the loads of gate and up, of the stores,
# eviction policy of the loads of gate and up)
FLAT = [(1024, 4, True, "", "", ""), (1024, 4, False, "", "", ""), (2048, 8, True, "", "", ""),
        (1024, 4, True, ".cg", "", ""), (1024, 4, True, "", ".cs", ""),
        (1024, 4, True, "", ".cg", ""), (1024, 4, True, ".cg", ".cs", ""),
        (1024, 4, True, "", "", "evict_first"), (1024, 4, True, "", "", "evict_last"),
        (1024, 4, False, "", "", "evict_first")]  # fmt: skip


@triton.jit
def _flat_backward(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr,
                   GELU: tl.constexpr, MASKED: tl.constexpr, LOAD_CM: tl.constexpr,
                   STORE_CM: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n if MASKED else None
    do = tl.load(do_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, cache_modifier=LOAD_CM, eviction_policy=EVICT)
    u = tl.load(u_ptr + offs, mask=mask, cache_modifier=LOAD_CM, eviction_policy=EVICT)
    g, u = g.to(tl.float32), u.to(tl.float32)
    act, slope = _act(g, GELU)
    dg = (do * u * slope).to(dg_ptr.dtype.element_ty)
    tl.store(dg_ptr + offs, dg, mask=mask, cache_modifier=STORE_CM)
    tl.store(du_ptr + offs, (do * act).to(du_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE_CM)  # fmt: skip


def flat(d_out, gate, up, op: str, block: int, warps: int, d_gate=None, d_up=None,
         load_cm: str = "", store_cm: str = "", evict: str = "") -> None:  # fmt: skip
    """The flat kernel, in place over gate and up unless d_gate and d_up are given."""
    n = gate.numel()
    _flat_backward[(triton.cdiv(n, block),)](
        d_out, gate, up, gate if d_gate is None else d_gate, up if d_up is None else d_up, n,
        BLOCK=block, GELU=op == "geglu", MASKED=n % block != 0, LOAD_CM=load_cm,
        STORE_CM=store_cm, EVICT=evict, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _tma_tile(do_desc, g_desc, u_desc, r, c, GELU: tl.constexpr):
    do = do_desc.load([r, c]).to(tl.float32)
    g = g_desc.load([r, c]).to(tl.float32)
    u = u_desc.load([r, c]).to(tl.float32)
    act, slope = _act(g, GELU)
    g_desc.store([r, c], (do * u * slope).to(g_desc.dtype))
    u_desc.store([r, c], (do * act).to(u_desc.dtype))


@triton.jit
def _tma_backward(do_desc, g_desc, u_desc, n_tiles, n_col_blocks, R: tl.constexpr,
                  C: tl.constexpr, GELU: tl.constexpr, PERSISTENT: tl.constexpr,
                  STAGES: tl.constexpr):  # fmt: skip
    """In place over gate and up through TMA descriptors of (R x C) boxes: one tile per program,
    or (PERSISTENT) a loop over tiles with the loads pipelined STAGES deep."""
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            _tma_tile(do_desc, g_desc, u_desc, (tile // n_col_blocks) * R,
                      (tile % n_col_blocks) * C, GELU)  # fmt: skip
    else:
        tile = tl.program_id(0)
        _tma_tile(do_desc, g_desc, u_desc, (tile // n_col_blocks) * R,
                  (tile % n_col_blocks) * C, GELU)  # fmt: skip


def tma(d_out, gate, up, op: str, box: tuple[int, int], warps: int, stages: int) -> None:
    """`_tma_backward` over (rows x cols) tensors; persistent (2 programs per SM) if stages."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, cols = gate.shape
    descs = [TensorDescriptor.from_tensor(t, list(box)) for t in (d_out, gate, up)]
    n_col_blocks = triton.cdiv(cols, box[1])
    n_tiles = triton.cdiv(rows, box[0]) * n_col_blocks
    sms = torch.cuda.get_device_properties(gate.device).multi_processor_count
    grid = (min(n_tiles, 2 * sms),) if stages else (n_tiles,)
    _tma_backward[grid](*descs, n_tiles, n_col_blocks, R=box[0], C=box[1], GELU=op == "geglu",
                        PERSISTENT=stages > 0, STAGES=max(stages, 1), num_warps=warps)  # fmt: skip


# (box rows, box cols, num_warps, pipeline stages; 0: one tile per program)
TMA = [(8, 256, 4, 0), (16, 256, 4, 0), (32, 256, 8, 0), (16, 256, 4, 2), (16, 256, 4, 3),
       (32, 256, 8, 2)]  # fmt: skip


@triton.jit
def _inductor_clone(in_ptr0, in_ptr1, in_ptr2, out_ptr0, out_ptr1, xnumel: tl.constexpr,
                    XBLOCK: tl.constexpr, GELU: tl.constexpr, OWN_MATH: tl.constexpr):  # fmt: skip
    """Inductor's generated backward (torch 2.11, H200: XBLOCK=1024, num_warps=4, num_stages=1)
    as it reads: in_ptr0 = d_out, in_ptr1 = up, in_ptr2 = gate; the element count a constant.
    OWN_MATH: the same loads and stores around memplan's expressions instead."""
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_ptr0 + xindex, None).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + xindex, None).to(tl.float32)
    tmp5 = tl.load(in_ptr2 + xindex, None).to(tl.float32)
    if OWN_MATH:
        act, slope = _act(tmp5, GELU)
        d_gate, d_up = tmp0 * tmp1 * slope, tmp0 * act
    elif GELU:
        tmp6 = tmp5 * tmp5
        tmp13 = libdevice.tanh((tmp5 + tmp6 * tmp5 * 0.044715) * 0.7978845608028654)
        tmp15 = tmp13 + 1.0
        tmp18 = tmp5 * 0.5
        tmp26 = tmp18 * (1.0 - tmp13 * tmp13) * ((tmp6 * 0.134145 + 1.0) * 0.7978845608028654)
        d_gate, d_up = tmp0 * tmp1 * (tmp15 * 0.5 + tmp26), tmp0 * (tmp18 * tmp15)
    else:
        tmp9 = libdevice.exp(-tmp5) + 1.0
        tmp12 = 1 / tmp9
        d_gate = tmp0 * tmp1 * tmp12 * (tmp5 * (1.0 - tmp12) + 1.0)
        d_up = tmp0 * (tmp5 / tmp9)
    tl.store(out_ptr0 + xindex, d_gate, None)
    tl.store(out_ptr1 + xindex, d_up, None)


def inductor_clone(d_out, gate, up, d_gate, d_up, op: str, stages: int, own_math: bool) -> None:
    n = gate.numel()
    _inductor_clone[(n // 1024,)](d_out, up, gate, d_gate, d_up, xnumel=n, XBLOCK=1024,
                                  GELU=op == "geglu", OWN_MATH=own_math, num_warps=4,
                                  num_stages=stages)  # fmt: skip


def inductor_backward(op: str, d_out, gate, up) -> tuple[torch.Tensor, torch.Tensor]:
    """The two gradients of act(gate) * up as autograd writes them, for torch.compile to fuse
    into one kernel: Inductor's backward of the op without its forward."""
    if op == "geglu":
        d_gate = torch.ops.aten.gelu_backward(d_out * up, gate, approximate="tanh")
        return d_gate, d_out * F.gelu(gate, approximate="tanh")
    return torch.ops.aten.silu_backward(d_out * up, gate), d_out * F.silu(gate)


def us(fn: Callable[[], object]) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def probe(op: str, rows: int, cols: int, rounds: int, args_tma: bool) -> dict[str, float]:
    torch.manual_seed(0)
    gate0 = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    up0, d_out = torch.randn_like(gate0), torch.randn_like(gate0)
    backward = BACKWARD[op]
    want = backward(d_out, gate0, up0)
    gate, up = gate0.clone(), up0.clone()
    impls: dict[str, Callable[[], object]] = {
        "memplan committed, in place": partial(backward, d_out, gate, up, gate, up)
    }
    g, u = gate0.clone(), up0.clone()
    d_gate, d_up = torch.empty_like(g), torch.empty_like(u)
    impls["memplan committed, out of place"] = partial(backward, d_out, g, u, d_gate, d_up)
    g, u = gate0.clone(), up0.clone()  # d_gate over up's buffer and d_up over gate's
    impls["memplan committed, in place swapped"] = partial(backward, d_out, g, u, u, g)
    for block, warps, in_place, load_cm, store_cm, evict in FLAT:
        g, u = gate0.clone(), up0.clone()
        outs = {} if in_place else {"d_gate": torch.empty_like(g), "d_up": torch.empty_like(u)}
        run = partial(flat, d_out, g, u, op, block, warps, load_cm=load_cm, store_cm=store_cm,
                      evict=evict, **outs)  # fmt: skip
        run()
        got = (g, u) if in_place else (outs["d_gate"], outs["d_up"])
        same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        label = (f"flat BLOCK={block} warps={warps} {'in place' if in_place else 'out of place'}"
                 f" loads{load_cm or ' default'} {evict or ''} stores{store_cm or ' default'}"
                 + ("" if same else " (OUTPUTS DIFFER)"))  # fmt: skip
        impls[label] = run
    inductor = torch.compile(partial(inductor_backward, op), dynamic=False)
    got = inductor(d_out, gate0, up0)
    close = all((a.float() - b.float()).abs().max().item() < 0.1 for a, b in zip(got, want))
    label = "Inductor, out of place" + ("" if close else " (DIFFER)")
    impls[label] = partial(inductor, d_out, gate0, up0)
    for stages, own_math in (1, False), (3, False), (1, True):
        d_gate, d_up = torch.empty_like(gate0), torch.empty_like(up0)
        run = partial(inductor_clone, d_out, gate0, up0, d_gate, d_up, op, stages, own_math)
        run()
        close = all((a.float() - b.float()).abs().max().item() < 0.1
                    for a, b in zip((d_gate, d_up), want))  # fmt: skip
        label = (
            f"Inductor's kernel launched here, num_stages={stages}"
            + (", memplan's math" if own_math else "")
            + ("" if close else " (DIFFER)")
        )
        impls[label] = run
    for r, c, warps, stages in TMA if args_tma else []:
        g, u = gate0.clone(), up0.clone()
        try:
            tma(d_out, g, u, op, (r, c), warps, stages)
        except Exception as exc:  # a variant that does not compile costs its row only
            print(f"- tma {r}x{c} warps={warps} stages={stages}: {type(exc).__name__}: "
                  f"{str(exc)[:200]}")  # fmt: skip
            continue
        same = torch.equal(g, want[0]) and torch.equal(u, want[1])
        label = f"tma box {r}x{c} warps={warps} stages={stages}" + ("" if same else " (DIFFER)")
        impls[label] = partial(tma, d_out, g, u, op, (r, c), warps, stages)

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
    parser.add_argument("--tma", action="store_true", help="add the TMA-descriptor variants")
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
                for name, t in probe(op, rows, cols, args.rounds, args.tma).items():
                    print(f"- {name}: {t:.1f}", flush=True)


if __name__ == "__main__":
    main()
