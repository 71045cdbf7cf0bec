"""Probe: two fusions around the layer GEMMs that memplan could add, timed at end-to-end shapes.

1. Projections sharing an input (q/k/v, gate/up): autograd sums their input gradients with a
   separate add kernel; an autograd.Function can instead accumulate them inside the GEMMs
   (dX = dq @ Wq, then dX += dk @ Wk with addmm_'s beta=1).
2. The residual add after o_proj and down_proj, folded into the GEMM's epilogue
   (torch.addmm(residual, a, W^T) instead of residual + a @ W^T).

Each is timed against what transformers runs (CUDA events, median of 30 after 5 warm-ups).
Cited in docs/profile_e2e.md.

    python benchmarks/probe_fusions.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (name, tokens, hidden, intermediate, kv width, layers): llama-3.2-1b and llama-3-8b at batch
# 8 x 2048, as in bench_e2e.py (the 8b case keeps 4 layers).
CASES = [
    ("llama-3.2-1b", 16384, 2048, 8192, 512, 16),
    ("llama-3-8b-l4", 16384, 4096, 14336, 1024, 4),
]


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


class SharedInputLinears(torch.autograd.Function):
    """y_i = x @ W_i^T; backward accumulates dX over the projections inside the GEMMs."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return tuple(x @ w.t() for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        dx = torch.mm(grads[0], weights[0])
        for grad, weight in zip(grads[1:], weights[1:]):
            dx.addmm_(grad, weight)
        return (dx, *(grad.t() @ x for grad in grads))


def shared_input_saving_ms(tokens: int, hidden: int, widths: list[int]) -> tuple[float, float]:
    """(ms saved per layer, relative difference of dX) for projections of these widths."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [
        (torch.randn(w, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        for w in widths
    ]
    grads = [torch.randn(tokens, w, device="cuda", dtype=torch.bfloat16) for w in widths]

    def autograd_sum():
        return torch.autograd.grad([F.linear(x, w) for w in weights], [x, *weights], grads)

    def in_gemm():
        return torch.autograd.grad(SharedInputLinears.apply(x, *weights), [x, *weights], grads)

    diff = (autograd_sum()[0].float() - in_gemm()[0].float()).norm() / autograd_sum()[0].norm()
    return median_ms(autograd_sum) - median_ms(in_gemm), diff.item()


def residual_saving_ms(tokens: int, k: int, n: int) -> float:
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    residual = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    separate = median_ms(lambda: residual + F.linear(a, weight))
    return separate - median_ms(lambda: torch.addmm(residual, a, weight.t()))


def main() -> None:
    torch.manual_seed(0)
    print("| case | q/k/v dX in GEMM | gate/up dX in GEMM | o_proj + residual | down + residual "
          "| per layer | x layers |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, tokens, hidden, inter, kv, layers in CASES:
        qkv, qkv_diff = shared_input_saving_ms(tokens, hidden, [hidden, kv, kv])
        gate_up, _ = shared_input_saving_ms(tokens, hidden, [inter, inter])
        o_res = residual_saving_ms(tokens, hidden, hidden)
        down_res = residual_saving_ms(tokens, inter, hidden)
        layer = qkv + gate_up + o_res + down_res
        print(
            f"| {name} | {1e3 * qkv:.0f} us | {1e3 * gate_up:.0f} us | {1e3 * o_res:.0f} us | "
            f"{1e3 * down_res:.0f} us | {1e3 * layer:.0f} us | {layers * layer:.2f} ms |"
        )
        print(f"  (q/k/v dX relative difference, bf16 sum order: {qkv_diff:.1e})")
    print("Positive: the fusion saves that much GPU time per training step.")


if __name__ == "__main__":
    main()
