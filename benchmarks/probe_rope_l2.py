"""Probe: RoPE kernels alone with a cold and a warm L2, where memplan's in-place forward+backward
read 1.03 x Liger's under do_bench (which flushes the L2 before every call) and 0.99 x in a CUDA
graph at 4 x 4096 tokens, 32 + 8 heads of 128 (docs/bench_kernels.md, session 11).

GPU time (us) of the forward and of the in-place backward, each kernel launched alone on
(B, S, heads, D) memory seen as (B, heads, S, D), bf16, cos/sin (1, S, D) as HF builds them:
- memplan: the committed launcher (one program per token on a (seq, batch) grid);
- batch_fastest: the same kernel body on a 1-d grid whose batch index varies fastest, so the
  programs of one position run together and read its cos/sin row once from DRAM (on the
  committed grid a row is read once per batch element, after q/k traffic has evicted it);
- half_cos: reads only the first halves of cos and sin (exact only where both halves are equal,
  as in transformers' rotary embeddings): what reading both halves costs;
- Liger-Kernel 0.8.5's rope_forward / rope_backward (in place, where installed).
Cold: triton.testing.do_bench (L2 flushed); warm: do_bench_cudagraph.

    python benchmarks/probe_rope_l2.py [--sizes 4x4096x32x8x128,...]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

from memplan.kernels import rope as R
from memplan.kernels._utils import next_power_of_2

SIZES = [(1, 4096, 32, 8, 128), (4, 4096, 32, 8, 128), (4, 4096, 32, 8, 64),
         (8, 8192, 32, 8, 128)]  # fmt: skip


@triton.jit
def _variant_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, batch, n_q_heads, n_k_heads,
                    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, cos_sb, cos_ss,
                    HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                    BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, BATCH_FASTEST: tl.constexpr,
                    HALF_COS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if BATCH_FASTEST:
        b = (pid % batch).to(tl.int64)
        s = (pid // batch).to(tl.int64)
    else:
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HALF
    cs_offset = b * cos_sb + s * cos_ss + dims[None, :]
    if HALF_COS:
        cos1 = tl.load(cos_ptr + cs_offset, mask=dmask[None, :], other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs_offset, mask=dmask[None, :], other=0.0).to(tl.float32)
        cos2, sin2 = cos1, sin1
    else:
        cos1, cos2 = R._load_halves(cos_ptr + cs_offset, dmask[None, :], HALF)
        sin1, sin2 = R._load_halves(sin_ptr + cs_offset, dmask[None, :], HALF)
    q_in, q_mask = R._head_tile(q_ptr, b, s, n_q_heads, q_sb, q_ss, q_sh, HALF, BLOCK_QH, BLOCK_D)
    k_in, k_mask = R._head_tile(k_ptr, b, s, n_k_heads, k_sb, k_ss, k_sh, HALF, BLOCK_KH, BLOCK_D)
    q1, q2 = R._load_halves(q_in, q_mask, HALF)
    k1, k2 = R._load_halves(k_in, k_mask, HALF)
    R._rotate_and_store(q_in, q_mask, HALF, q1, q2, cos1, cos2, sin1, sin2, BACKWARD)
    R._rotate_and_store(k_in, k_mask, HALF, k1, k2, cos1, cos2, sin1, sin2, BACKWARD)


def variant(q, k, cos, sin, backward: bool, batch_fastest: bool, half_cos: bool) -> None:
    """In place, as the committed in-place launcher (q, k: (B, heads, S, D) views)."""
    batch, n_q, seq, head_dim = q.shape
    n_k = k.shape[1]
    cos = cos.expand(batch, seq, head_dim)
    sin = sin.expand(batch, seq, head_dim)
    block_d = next_power_of_2(head_dim // 2)
    block_qh, block_kh = next_power_of_2(n_q), next_power_of_2(n_k)
    grid = (batch * seq,) if batch_fastest else (seq, batch)
    _variant_kernel[grid](
        q, k, cos, sin, batch, n_q, n_k, *R._bsh_strides(q, 1), *R._bsh_strides(k, 1),
        *cos.stride()[:2], HALF=head_dim // 2, BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        BLOCK_D=block_d, BACKWARD=backward, BATCH_FASTEST=batch_fastest, HALF_COS=half_cos,
        num_warps=R._num_warps(block_qh, block_kh, block_d),
    )  # fmt: skip


def inputs(batch: int, seq: int, n_q: int, n_kv: int, head_dim: int):
    torch.manual_seed(0)
    q = torch.randn(batch, seq, n_q, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seq, n_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    freqs = torch.outer(torch.arange(seq, device="cuda", dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return q.transpose(1, 2), k.transpose(1, 2), emb.cos().bfloat16(), emb.sin().bfloat16()


def check_variants(q, k, cos, sin) -> None:
    """Every variant's output bit-identical to the committed launcher's."""
    for backward in (False, True):
        ref = R._launch(q.clone(), k.clone(), cos, sin, 1, backward)
        for bf, hc in ((True, False), (False, True), (True, True)):
            q2, k2 = q.clone(), k.clone()
            variant(q2, k2, cos, sin, backward, bf, hc)
            assert torch.equal(q2, ref[0]) and torch.equal(k2, ref[1]), (backward, bf, hc)


def impls_for(q, k, cos, sin) -> dict[str, Callable[[bool], object]]:
    """{name: fn(backward)}, each rotating q and k in place."""
    impls = {
        "memplan": lambda bwd: R._launch(q, k, cos, sin, 1, bwd, in_place=True),
        "batch_fastest": lambda bwd: variant(q, k, cos, sin, bwd, True, False),
        "half_cos": lambda bwd: variant(q, k, cos, sin, bwd, False, True),
        "batch_fastest + half_cos": lambda bwd: variant(q, k, cos, sin, bwd, True, True),
    }
    try:
        from liger_kernel.ops.rope import rope_backward, rope_forward
    except ImportError:
        return impls
    impls["Liger"] = lambda bwd: (rope_backward if bwd else rope_forward)(q, k, cos, sin)
    return impls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", help="e.g. 4x4096x32x8x128,1x4096x32x8x128")
    args = parser.parse_args()
    sizes = SIZES
    if args.sizes:
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    timers = [(False, do_bench), (True, do_bench), (False, do_bench_cudagraph),
              (True, do_bench_cudagraph)]  # fmt: skip
    print("| size | impl | fwd cold us | bwd cold us | fwd warm us | bwd warm us |")
    print("|---|---|---:|---:|---:|---:|")
    for size in sizes:
        q, k, cos, sin = inputs(*size)
        check_variants(q, k, cos, sin)
        impls = impls_for(q, k, cos, sin)
        # Interleaved rounds: every implementation once per round, the median of each.
        times: dict[str, list[list[float]]] = {name: [[], [], [], []] for name in impls}
        for _ in range(5):
            for name, fn in impls.items():
                for col, (bwd, timer) in enumerate(timers):
                    kwargs = {"warmup": 10, "rep": 40} if timer is do_bench else {"rep": 40}
                    times[name][col].append(timer(partial(fn, bwd), **kwargs))
        label = "x".join(map(str, size))
        for name, cols in times.items():
            medians = [statistics.median(c) * 1e3 for c in cols]
            print(f"| {label} | {name} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
