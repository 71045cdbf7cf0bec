"""The second stage of the norms' dW (and dB) reduction, shared by RMSNorm and LayerNorm.

Each backward program sums its own contiguous range of rows into an fp32 partial. Programs
2p and 2p+1 add their partials into one zeroed row p with atomics when there are more
programs than SMs: two additions onto 0.0 give the same bits in either order (0 + a + b and
0 + b + a: IEEE addition is commutative), so the result stays deterministic while the scratch
is at most SMs x hidden fp32, Liger-Kernel's size, with 2 programs per SM. A Triton kernel then
sums the partial rows column by column, in order, and writes the weight's dtype: no staging
buffer of torch's split reduction, no separate cast."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memplan.kernels._launch import fast_launch
from memplan.kernels._utils import cdiv, next_power_of_2, on_device


def partial_layout(n_programs: int, sms: int) -> tuple[int, bool]:
    """(partial rows, paired): pairs of programs share a row when programs outnumber the `sms`
    SMs."""
    if n_programs > sms:
        return cdiv(n_programs, 2), True
    return n_programs, False


def new_partials(
    n_sums: int, n_programs: int, n_cols: int, device: torch.device, sms: int
) -> torch.Tensor:
    """(n_sums, partial rows, n_cols) fp32 scratch; zeroed when paired programs add into it."""
    rows, paired = partial_layout(n_programs, sms)
    alloc = torch.zeros if paired else torch.empty
    return alloc((n_sums, rows, n_cols), dtype=torch.float32, device=device)


@triton.jit
def store_partial(partial_ptr, pid, n_cols, cols, value, mask, PAIRED: tl.constexpr):
    """Program `pid`'s fp32 partial (one row of n_cols) into the scratch of new_partials."""
    if PAIRED:
        tl.atomic_add(partial_ptr + (pid // 2) * n_cols + cols, value, mask=mask, sem="relaxed")
    else:
        tl.store(partial_ptr + pid * n_cols + cols, value, mask=mask)


@fast_launch
@triton.jit
def _sum_partials_kernel(
    partial_ptr, out_ptr, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[s, c] = sum over r of partial[s, r, c], for s = program_id(1)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    base = partial_ptr + tl.program_id(1).to(tl.int64) * n_rows * n_cols
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(0, n_rows, ROWS):
        rows = start + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    out = out_ptr + tl.program_id(1) * n_cols + cols
    tl.store(out, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


# (ROWS, BLOCK) tile of the column sums: narrow column blocks, so that even hidden 1K gets 32
# programs (the partial rows, 1-2 x SMs of them, are few); chosen by `bench_kernels.py --tune`.
SUM_TILE = (32, 32)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n_sums, rows, n_cols) fp32 -> (n_sums, n_cols) in `dtype`."""
    n_sums, n_rows, n_cols = partials.shape
    out = torch.empty((n_sums, n_cols), dtype=dtype, device=partials.device)
    if out.numel() == 0:
        return out
    rows, block = SUM_TILE
    block = min(next_power_of_2(n_cols), block)
    with on_device(partials):
        _sum_partials_kernel[(cdiv(n_cols, block), n_sums)](
            partials, out, n_rows, n_cols, ROWS=rows, BLOCK=block, num_warps=4
        )
    return out
