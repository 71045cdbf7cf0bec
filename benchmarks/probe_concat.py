"""Probe: would one GEMM over concatenated weights (q|k|v, gate|up) beat the separate projections
of a decoder layer, forward+backward through autograd, at the two llama anchors' shapes?

    python benchmarks/probe_concat.py

Separate: q, k, v = x Wq^T, x Wk^T, x Wv^T (autograd sums the three input gradients). Concat:
W = cat(Wq, Wk, Wv) on every call (the parameters stay separate, as in the model), one GEMM, its
output split; backward is one dX GEMM, one dW GEMM whose rows are the three weight gradients, and
the cat of dq, dk, dv that split's backward makes. Same for gate and up. Also timed: the
residual add (x + y) that a fused add + RMSNorm would fold into the norm. GPU time per call from
CUDA events over back-to-back calls, median of 5 rounds."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

SHAPES = {
    "llama-3.2-1b": dict(tokens=16384, hidden=2048, q=2048, kv=512, inter=8192, layers=16),
    "llama-3-8b": dict(tokens=16384, hidden=4096, q=4096, kv=1024, inter=14336, layers=4),
}


def gpu_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def projections(x, weights, grads, concat: bool):
    def run():
        if concat:
            outs = F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        else:
            outs = [F.linear(x, w) for w in weights]
        torch.autograd.backward(outs, grads)
        x.grad = None
        for w in weights:
            w.grad = None

    return run


def main() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | block | separate ms | concat ms | saved per layer ms | saved per step ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, s in SHAPES.items():
        t, h = s["tokens"], s["hidden"]
        x = torch.randn(t, h, device=dev, dtype=dt, requires_grad=True)
        blocks = {
            "q|k|v": (s["q"], s["kv"], s["kv"]),
            "gate|up": (s["inter"], s["inter"]),
        }
        for block, outs in blocks.items():
            weights = [
                (torch.randn(o, h, device=dev, dtype=dt) * h**-0.5).requires_grad_() for o in outs
            ]
            grads = [torch.randn(t, o, device=dev, dtype=dt) for o in outs]
            sep = gpu_ms(projections(x, weights, grads, concat=False))
            cat = gpu_ms(projections(x, weights, grads, concat=True))
            saved = sep - cat
            print(
                f"| {name} | {block} | {sep:.3f} | {cat:.3f} | {saved:+.3f} "
                f"| {saved * s['layers']:+.2f} |"
            )
        a = torch.randn(t, h, device=dev, dtype=dt)
        b = torch.randn(t, h, device=dev, dtype=dt)
        add = gpu_ms(lambda a=a, b=b: a + b)
        # Folded into the norms, an add costs one extra read instead of 3 passes: 1/3 of an
        # add saved in the post-attention norm's forward (the input norm's add ends the
        # previous layer), 2/3 in each norm's backward (the residual's gradient sum).
        fused = 5 / 3 * add
        print(
            f"| {name} | residual add + RMSNorm, fused | {add:.3f} per add | | {fused:+.3f} "
            f"| {fused * s['layers']:+.2f} |"
        )


if __name__ == "__main__":
    main()
