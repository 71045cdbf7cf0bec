"""Probe: where the host time of a small RMSNorm call goes (us per call, no GPU wait).

At 256 x 1024 the GPU work is ~1 us, so calls queued back to back measure the host: Python,
autograd, allocations and Triton's launch path. Compared with Liger-Kernel's RMSNorm and with a
launch of the compiled kernel that skips Triton's argument binding. Cited in
docs/bench_kernels.md.

    python benchmarks/probe_host.py
"""

from __future__ import annotations

import time

import torch
from triton.runtime import driver

from memplan.kernels import rms_norm as mp
from memplan.kernels._utils import cdiv, norm_forward_config, on_device

ROWS, HIDDEN, EPS = 256, 1024, 1e-6


def host_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main() -> None:
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(ROWS, device="cuda", dtype=torch.float32)
    block_n, rows, num_warps = norm_forward_config(HIDDEN)
    grid = (cdiv(ROWS, rows),)
    # the kernel's arguments in signature order, constexprs included
    args = (x, weight, y, rstd, HIDDEN, HIDDEN, ROWS, HIDDEN, EPS, 0.0, False, block_n, rows)
    options = dict(GEMMA=False, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)

    def triton_launch():
        mp._rms_norm_forward_kernel[grid](*args[:10], **options)

    def triton_launch_on_device():
        with on_device(x):
            triton_launch()

    compiled = mp._rms_norm_forward_kernel.run(*args[:10], **options, grid=grid, warmup=False)
    compiled._init_handles()

    def compiled_launch():
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        compiled.run(
            grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
            None, None, None, *args,
        )  # fmt: skip

    reference = y.clone()
    y.zero_()
    compiled_launch()
    torch.cuda.synchronize()
    assert torch.equal(reference, y), "the direct launch must compute the same output"

    x_grad = x.clone().requires_grad_()
    w_grad = weight.clone().requires_grad_()
    dy = torch.randn_like(x)

    def memplan_fwd_bwd():
        out = mp.rms_norm(x_grad, w_grad, EPS)
        torch.autograd.grad(out, (x_grad, w_grad), dy.clone())

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def python_function_fwd_bwd():
        torch.autograd.grad(Identity.apply(x_grad), x_grad, dy)

    def torch_op_fwd_bwd():
        torch.autograd.grad(x_grad * 2, x_grad, dy)

    rows_ = {
        "one torch op (x + x)": lambda: x + x,
        "dy.clone() (in each fwd+bwd below)": dy.clone,
        "Triton launch, tensors preallocated": triton_launch,
        "Triton launch inside on_device": triton_launch_on_device,
        "compiled kernel launched directly": compiled_launch,
        "memplan rms_norm_forward (allocates y, rstd)": lambda: mp.rms_norm_forward(
            x, weight, EPS, 0.0, False
        ),
        "memplan rms_norm, no grad": lambda: mp.rms_norm(x, weight, EPS),
        "memplan rms_norm, autograd forward": lambda: mp.rms_norm(x_grad, w_grad, EPS),
        "autograd.grad through one torch op (x * 2)": torch_op_fwd_bwd,
        "autograd.grad through an identity autograd.Function": python_function_fwd_bwd,
        "memplan rms_norm forward+backward": memplan_fwd_bwd,
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        def liger_fwd_bwd():
            out = LigerRMSNormFunction.apply(x_grad, w_grad, EPS)
            torch.autograd.grad(out, (x_grad, w_grad), dy.clone())

        rows_["Liger rms_norm, autograd forward"] = lambda: LigerRMSNormFunction.apply(
            x_grad, w_grad, EPS
        )
        rows_["Liger rms_norm forward+backward"] = liger_fwd_bwd
    except ImportError:
        print("liger-kernel not installed: its rows are left out")
    print(f"| RMSNorm {ROWS} x {HIDDEN}, host time per call | us |")
    print("|---|---:|")
    for name, fn in rows_.items():
        print(f"| {name} | {host_us(fn):.1f} |")


if __name__ == "__main__":
    main()
