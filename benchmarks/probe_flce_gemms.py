"""Probe: the rate of each GEMM fused linear cross entropy runs, at the end-to-end shapes.

Per chunk of rows FLCE runs logits = x @ W^T, dX = G @ W and dW (+)= G^T @ x, plus the
cross-entropy kernel over the chunk's logits. This times each alone (triton do_bench, median),
with the dW GEMM written three ways (bf16 out, fp32 accumulator as memplan runs it, and the
transposed product), under the BLAS library given (--blas cublas | cublaslt), beside a square
8192^3 GEMM: how far the compute floor of docs/bench_loss.md is from what cuBLAS gives on
these shapes. Cited in docs/profile_e2e.md.

    python benchmarks/probe_flce_gemms.py [--blas cublaslt] [--chunks 4096 8192 16384]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from memplan.kernels.cross_entropy import launch_cross_entropy_forward

VOCAB = 128256


def tflops(ms: float, m: int, n: int, k: int) -> float:
    return 2 * m * n * k / ms / 1e9


def median_ms(fn) -> float:
    return do_bench(fn, return_mode="median")


def report_chunk(weight: torch.Tensor, chunk: int) -> None:
    """Time the cross-entropy kernel and each GEMM for one chunk of rows."""
    vocab, hidden = weight.shape
    bf16, f32 = torch.bfloat16, torch.float32
    x = torch.randn(chunk, hidden, device="cuda", dtype=bf16)
    logits = torch.empty(chunk, vocab, device="cuda", dtype=bf16)
    acc = torch.zeros(vocab, hidden, device="cuda", dtype=f32)
    acc_t = torch.zeros(hidden, vocab, device="cuda", dtype=f32)
    dw = torch.empty(vocab, hidden, device="cuda", dtype=bf16)
    dx = torch.empty(chunk, hidden, device="cuda", dtype=bf16)
    target = torch.randint(0, vocab, (chunk,), device="cuda")
    loss = torch.zeros(chunk, device="cuda", dtype=f32)
    scale = torch.tensor(1.0 / chunk, device="cuda")
    ce_ms = median_ms(
        lambda: launch_cross_entropy_forward(
            logits, logits, target, loss, None, None, scale,
            ignore_index=-100, label_smoothing=0.0, softcap=0.0, z_loss_scale=0.0,
        )
    )  # fmt: skip
    print(f"hidden {hidden}, chunk {chunk}: cross-entropy kernel {ce_ms:.3f} ms")
    gemms = {  # name: (call, M, N, K)
        "logits = x @ W^T": (lambda: torch.mm(x, weight.t(), out=logits), chunk, vocab, hidden),
        "dX = G @ W": (lambda: torch.mm(logits, weight, out=dx), chunk, hidden, vocab),
        "dW = G^T @ x, bf16": (lambda: torch.mm(logits.t(), x, out=dw), vocab, hidden, chunk),
        "dW += G^T @ x, fp32 acc": (
            lambda: torch.addmm(acc, logits.t(), x, out_dtype=f32, out=acc),
            vocab,
            hidden,
            chunk,
        ),
        "dW^T += x^T @ G, fp32 acc": (
            lambda: torch.addmm(acc_t, x.t(), logits, out_dtype=f32, out=acc_t),
            hidden,
            vocab,
            chunk,
        ),
    }
    for name, (call, m, n, k) in gemms.items():
        ms = median_ms(call)
        print(f"  {name:26s} {ms:7.3f} ms {tflops(ms, m, n, k):5.0f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default=None)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192, 16384])
    args = parser.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"BLAS library: {torch.backends.cuda.preferred_blas_library()}")
    torch.manual_seed(0)
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: square @ square)
    print(f"8192^3 GEMM: {ms:.3f} ms, {tflops(ms, 8192, 8192, 8192):.0f} TFLOP/s")
    for hidden in (2048, 4096):
        weight = torch.randn(VOCAB, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        for chunk in args.chunks:
            report_chunk(weight, chunk)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
