"""Probe: does the RMSNorm backward gain from cheaper address arithmetic?

memplan's norm kernels form int64 offsets per element (rows[:, None] * stride + cols). The
variant here advances a scalar int64 base pointer per row tile and keeps in-tile offsets int32,
as Liger-Kernel's kernels do. Both hold the weight in registers (WEIGHT_FROM_CACHE=False) and
run the committed launch configuration otherwise; the outputs must be bit-identical and the
times (CUDA graph, median) are compared. Cited in docs/bench_kernels.md.

    python benchmarks/probe_addressing.py
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from memplan.kernels import rms_norm as R
from memplan.kernels._partials import new_partials, partial_layout, store_partial, sum_partials
from memplan.kernels._utils import norm_backward_config


@triton.jit
def bwd_scalar_base(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    offset,
    GEMMA: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    r = tl.arange(0, ROWS)
    dy_offs = r[:, None] * dy_row_stride.to(tl.int32) + cols[None, :]
    x_offs = r[:, None] * x_row_stride.to(tl.int32) + cols[None, :]
    dx_offs = r[:, None] * dx_row_stride.to(tl.int32) + cols[None, :]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(row_start, row_end, ROWS):
        row_mask = (start + r) < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(dy_ptr + start * dy_row_stride + dy_offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + start * x_row_stride + x_offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + start + r, mask=row_mask, other=0.0)
        normed = x * rstd[:, None]
        m = dy * w[None, :]
        mean_mn = tl.sum(m * normed, axis=1) / n_cols
        dx = (m - normed * mean_mn[:, None]) * rstd[:, None]
        tl.store(
            dx_ptr + start * dx_row_stride + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask
        )
        if COMPUTE_DW:
            if not GEMMA:
                normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            dw_acc += dy * normed
    if COMPUTE_DW:
        store_partial(dw_partial_ptr, pid, n_cols, cols, tl.sum(dw_acc, axis=0), col_mask, PAIRED)


def launch(kernel, dy, x, w, rstd, dx, extra=(), **constexprs):
    """extra: runtime arguments after the common ones (memplan's kernel takes the pointers and
    strides of its optional extra gradients; unused at N_DY=1 without ADD_RESIDUAL_GRAD)."""
    n_rows, n_cols = x.shape
    block_n, rows, warps, n_programs, rpp, _ = norm_backward_config(
        n_rows, n_cols, x.device, "rms_norm"
    )
    part = new_partials(1, n_programs, n_cols, x.device)
    kernel[(n_programs,)](
        dy,
        x,
        w,
        rstd,
        dx,
        part,
        n_cols,
        n_cols,
        n_cols,
        n_rows,
        n_cols,
        rpp,
        0.0,
        *extra,
        GEMMA=False,
        COMPUTE_DW=True,
        PAIRED=partial_layout(n_programs, x.device)[1],
        BLOCK_N=block_n,
        ROWS=rows,
        num_warps=warps,
        **constexprs,
    )
    return sum_partials(part, w.dtype)[0]


def main() -> None:
    print("| rows x hidden | int64 offsets us | scalar base us | ratio | identical |")
    print("|---|---:|---:|---:|---|")
    for n_rows, n_cols in [(16384, 16384), (16384, 4096), (65536, 4096), (32768, 2048)]:
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(n_cols, device="cuda", dtype=torch.bfloat16) + 0.5
        dy = torch.randn_like(x)
        _, rstd = R.rms_norm_forward(x, w, 1e-6, 0.0, False)
        dx_int64, dx_scalar = torch.empty_like(x), torch.empty_like(x)
        current = partial(
            launch,
            R._rms_norm_backward_kernel,
            dy,
            x,
            w,
            rstd,
            dx_int64,
            extra=(dy, dy, dy, n_cols, n_cols, n_cols),
            WEIGHT_FROM_CACHE=False,
        )
        variant = partial(launch, bwd_scalar_base, dy, x, w, rstd, dx_scalar)
        same = torch.equal(current(), variant()) and torch.equal(dx_int64, dx_scalar)
        t_int64 = do_bench_cudagraph(current, return_mode="median")
        t_scalar = do_bench_cudagraph(variant, return_mode="median")
        print(
            f"| {n_rows} x {n_cols} | {1e3 * t_int64:.1f} | {1e3 * t_scalar:.1f} | "
            f"{t_scalar / t_int64:.3f} | {same} |"
        )


if __name__ == "__main__":
    main()
