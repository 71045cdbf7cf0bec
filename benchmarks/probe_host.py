"""Probe: where the host time of a small RMSNorm call goes (us per call, no GPU wait).

At 256 x 1024 the GPU work is ~1 us, so calls queued back to back measure the host: Python,
autograd, allocations and Triton's launch path. Compared with Liger-Kernel's RMSNorm and with a
launch of the compiled kernel that skips Triton's argument binding. Cited in
docs/bench_kernels.md.

    python benchmarks/probe_host.py           # RMSNorm's host path, step by step
    python benchmarks/probe_host.py --ops     # fwd+bwd per op and implementation, interleaved
    python benchmarks/probe_host.py --args    # a launch's cost per kernel argument, and with
                                              # memplan's fast_launch (memplan.kernels._launch)

--ops times bench_kernels.py's own cases at sizes where the GPU work is a few us, in rounds that
rotate the implementations (the host's speed drifts), and prints the median and range of the
per-call host time: the cost every call pays before its kernels run. memplan as applied is timed
twice: with its fast launch, and with every launch through Triton's own path.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from memplan.kernels import _launch
from memplan.kernels import rms_norm as mp
from memplan.kernels._launch import FastKernel
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
    args = (x, weight, y, rstd, HIDDEN, HIDDEN, ROWS, HIDDEN, EPS, 0.0, x, y, HIDDEN)
    args += (False, block_n, rows, False)  # constexprs GEMMA, BLOCK_N, ROWS, ADD
    options = dict(GEMMA=False, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)

    def triton_launch():
        mp._rms_norm_forward_kernel[grid](*args[:13], **options)

    def triton_launch_on_device():
        with on_device(x):
            triton_launch()

    compiled = mp._rms_norm_forward_kernel.run(*args[:13], **options, grid=grid, warmup=False)
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


TINY = {"rms_norm": (256, 1024), "layer_norm": (256, 1024), "rope": (1, 128, 32, 8, 128),
        "swiglu": (256, 1024), "geglu": (256, 1024)}  # fmt: skip


@triton.jit
def _args_kernel(out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                 a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29):  # fmt: skip
    tl.store(out_ptr, a0 + a29)


@triton.jit
def _one_arg_kernel(out_ptr, a0):
    tl.store(out_ptr, a0)


def launch_cost_per_argument() -> None:
    """Host us per launch of a kernel with 2 arguments and of one with 31 (30 integers, with
    two sets of values): what an extra stride argument costs."""
    out = torch.empty(1, device="cuda", dtype=torch.int64)
    values = [4096 * (i + 3) for i in range(30)]  # divisible by 16 and not 1, as strides are
    _args_kernel[(1,)](out, *values)
    zeros = [0] * 30
    _one_arg_kernel[(1,)](out, values[0])
    print("| launch | host us |")
    print("|---|---:|")
    one = host_us(lambda: _one_arg_kernel[(1,)](out, values[0]), calls=2000)
    print(f"| 2 arguments | {one:.1f} |")
    print(f"| 31 arguments | {host_us(lambda: _args_kernel[(1,)](out, *values), calls=2000):.1f} |")
    print(f"| 31 arguments, other values | "
          f"{host_us(lambda: _args_kernel[(1,)](out, *zeros), calls=2000):.1f} |")  # fmt: skip
    one_fast, args_fast = FastKernel(_one_arg_kernel), FastKernel(_args_kernel)
    one_fast[(1,)](out, values[0])
    args_fast[(1,)](out, *values)
    print(f"| 2 arguments, memplan's fast_launch | "
          f"{host_us(lambda: one_fast[(1,)](out, values[0]), calls=2000):.1f} |")  # fmt: skip
    print(f"| 31 arguments, memplan's fast_launch | "
          f"{host_us(lambda: args_fast[(1,)](out, *values), calls=2000):.1f} |")  # fmt: skip


def per_op(rounds: int = 15) -> None:
    import bench_kernels as bk

    print("| op, size | implementation | host us per fwd+bwd, median | range over rounds |")
    print("|---|---|---:|---:|")
    for op, size in TINY.items():
        cases = {impl: factory() for impl, factory in bk.CASES[op](*size).items()}
        # memplan as applied, launched through Triton's own path (memplan.kernels._launch)
        deployed = bk.DEPLOYED.get(op, "memplan")
        cases[f"{deployed}, Triton launch"] = bk.CASES[op](*size)[deployed]()
        times: dict[str, list[float]] = {impl: [] for impl in cases}
        for impl in bk.rotations(list(cases), rounds):
            case = cases[impl]
            _launch.ENABLED = not impl.endswith("Triton launch")
            times[impl].append(host_us(lambda case=case: bk.fwd_bwd(case), calls=200))
            _launch.ENABLED = True
        for impl, us in times.items():
            print(f"| {op} {'x'.join(map(str, size))} | {impl} | {statistics.median(us):.1f} "
                  f"| {min(us):.1f}-{max(us):.1f} |")  # fmt: skip


if __name__ == "__main__":
    if "--ops" in sys.argv:
        import bench_kernels

        print(bench_kernels.pin_to_one_core())
        with torch.cuda.stream(torch.cuda.Stream()):  # as bench_kernels.py runs its cases
            per_op()
    elif "--args" in sys.argv:
        launch_cost_per_argument()
    else:
        main()
