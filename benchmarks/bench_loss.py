"""Loss benchmarks on one GPU: (1) cross entropy on given logits, (2) fused linear cross entropy.

Prints the tables and writes them as markdown (default docs/bench_loss.md):

    python benchmarks/bench_loss.py [--out docs/bench_loss.md] [--sweep] [--time-limit 250]

Cross-entropy times are medians of triton.testing.do_bench (calls queued back to back, as the
kernels issue measures); FLCE times, calls of 10-300 ms, are medians of CUDA-event-timed calls
after a warm-up call. Memory is the peak allocated above what existed before the call (the
inputs), gradients included. The copy bandwidth (bytes read + written by a 1 GiB device copy) and
the bf16 matmul rate (8192^3 torch.mm) are measured in the same run. Needs liger-kernel and
cut-cross-entropy for their rows (skipped if missing)."""

import argparse
import datetime
import gc
import importlib.metadata
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

from memplan.estimators.kernel_contracts import flce_chunk_for_budget, flce_default_chunk
from memplan.kernels import cross_entropy as ce_module
from memplan.kernels.cross_entropy import cross_entropy
from memplan.kernels.fused_linear_cross_entropy import (
    flce_schedule,
    fused_linear_cross_entropy,
)

MIB, GIB = 1 << 20, 1 << 30
CE_SIZES = [(8192, 128256), (16384, 32000), (4096, 256000)]
FLCE_ROWS = [4096, 16384, 32768]
FLCE_HV = [(2048, 128256), (3072, 256000), (4096, 128256), (4096, 151936)]
BUDGETS = {"memplan 2 GiB": 2 * GIB, "memplan 4 GiB": 4 * GIB}


def median_ms(fn, target_ms: float = 250.0, min_reps: int = 2, max_reps: int = 40) -> float:
    """Median of CUDA-event-timed calls, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    reps = max_reps
    for i in range(max_reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if i == 0:
            reps = int(min(max_reps, max(min_reps, target_ms / max(times[0], 1e-3))))
        if len(times) >= reps:
            break
    return statistics.median(times)


def do_bench_ms(fn) -> float:
    """Median of triton.testing.do_bench (calls queued back to back, L2 flushed between them),
    the kernels issue's measure; the host's launch latency is hidden as in training."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def peak_above(fn, clear) -> int:
    """Peak allocated bytes during fn() above what is allocated once `clear()` has run."""
    clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_gbps() -> float:
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), target_ms=200, min_reps=10)
    return 2 * GIB / ms / 1e6


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.mm(a, b), target_ms=300, min_reps=20)
    return 2 * 8192**3 / ms / 1e9


def failure(exc: Exception) -> str:
    """A table cell for a run that raised: OOM, or the exception's type and first line."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    print(f"  failed: {type(exc).__name__}: {exc}".splitlines()[0][:300], flush=True)
    return f"error: {type(exc).__name__}"


def write(lines: list[str], path: str) -> None:
    """The markdown so far (rewritten after every section, so a cut-off run keeps its rows)."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --- (1) cross entropy on given logits ------------------------------------------------------


def ce_methods():
    def hf_eager(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=-100)

    methods = {
        "HF eager (fp32 upcast)": hf_eager,
        "torch.compile": torch.compile(hf_eager),
    }
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        methods["Liger"] = LigerCrossEntropyLoss()
    except ImportError:
        pass
    methods["memplan (in place)"] = lambda x, t: cross_entropy(x, t, inplace_grad=True)
    methods["memplan (new grad)"] = lambda x, t: cross_entropy(x, t)
    return methods


def measure_cross_entropy(method, n_rows: int, vocab: int) -> tuple[float, float, int]:
    """(forward ms, forward+backward ms, peak bytes of forward+backward)."""
    # Logits as a model makes them (not a leaf): the in-place gradient is not written over leaves.
    x = (torch.randn(n_rows, vocab, device="cuda") * 2).to(torch.bfloat16).requires_grad_() * 1
    t = torch.randint(0, vocab, (n_rows,), device="cuda")
    t[::100] = -100
    grads = []

    def forward_backward():
        grads.append(torch.autograd.grad(method(x, t), x)[0])

    def timed_forward_backward():
        grads.clear()
        forward_backward()

    fwd = do_bench_ms(lambda: method(x, t))
    both = do_bench_ms(timed_forward_backward)
    return fwd, both, peak_above(forward_backward, grads.clear)


def measure_loss_only_forward(n_rows: int, vocab: int) -> float:
    """memplan's forward on logits that need no gradient (evaluation): one read of the logits."""
    x = (torch.randn(n_rows, vocab, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n_rows,), device="cuda")
    t[::100] = -100
    return do_bench_ms(lambda: cross_entropy(x, t))


def cross_entropy_goals(results: dict, copy_bw: float, lines: list[str]) -> None:
    """memplan (in place) against Liger and torch.compile; forward share of copy bandwidth."""
    lines += [
        "",
        "### Goals: memplan (in place) fwd+bwd <= Liger's and torch.compile's; forward >= 80% "
        "of the copy bandwidth",
        "",
        "| rows x vocab | fwd+bwd / Liger | fwd+bwd / torch.compile | fwd / Liger "
        "| fwd with gradient, % copy (read + write) | loss-only fwd ms | % copy (read) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (n_rows, vocab), by_method in results.items():
        ours = by_method.get("memplan (in place)")
        liger, comp = by_method.get("Liger"), by_method.get("torch.compile")
        if not all(isinstance(r, tuple) for r in (ours, liger, comp)):
            lines.append(f"| {n_rows} x {vocab} | incomplete | | | | | |")
            continue
        logits_bytes = n_rows * vocab * 2
        fwd_gbps = 2 * logits_bytes / ours[0] / 1e6
        loss_only = measure_loss_only_forward(n_rows, vocab)
        free_memory()
        lines.append(
            f"| {n_rows} x {vocab} | {ours[1] / liger[1]:.2f} | {ours[1] / comp[1]:.2f} | "
            f"{ours[0] / liger[0]:.2f} | {100 * fwd_gbps / copy_bw:.0f}% | {loss_only:.3f} | "
            f"{100 * logits_bytes / loss_only / 1e6 / copy_bw:.0f}% |"
        )
    lines.append("")


def bench_cross_entropy(copy_bw: float, lines: list[str]) -> None:
    header = (
        "| rows x vocab | method | fwd ms | fwd GB/s | fwd % copy | fwd+bwd ms | fwd+bwd GB/s "
        "| fwd+bwd % copy | peak MiB |"
    )
    lines += [
        "## Cross entropy on given logits (bf16 logits, mean, 1% of targets ignored)",
        "",
        "Bytes counted: forward reads the logits (N x V x 2), and also writes the gradient when it "
        "computes it in the forward (Liger, memplan); forward+backward reads the logits and "
        "writes their gradient (2 x N x V x 2). The backward returns the gradient for the logits "
        "(torch.autograd.grad), as the lm_head's backward would consume it. Peak: above the "
        "logits and targets. In-place methods run repeatedly on the same (overwritten) logits.",
        "",
        header,
        "|" + "---|" * 9,
    ]
    print("\n" + header)
    results = {}
    for n_rows, vocab in CE_SIZES:
        for name, method in ce_methods().items():
            try:
                fwd, both, peak = measure_cross_entropy(method, n_rows, vocab)
            except Exception as exc:  # one failing baseline must not end the run
                row = f"| {n_rows} x {vocab} | {name} | {failure(exc)} | | | | | | |"
            else:
                results.setdefault((n_rows, vocab), {})[name] = (fwd, both)
                logits_bytes = n_rows * vocab * 2
                fwd_bytes = logits_bytes * (2 if name.startswith(("Liger", "memplan")) else 1)
                fwd_gbps = fwd_bytes / fwd / 1e6
                both_gbps = 2 * logits_bytes / both / 1e6
                row = (
                    f"| {n_rows} x {vocab} | {name} | {fwd:.3f} | {fwd_gbps:.0f} | "
                    f"{100 * fwd_gbps / copy_bw:.0f}% | {both:.3f} | {both_gbps:.0f} | "
                    f"{100 * both_gbps / copy_bw:.0f}% | {peak / MIB:.0f} |"
                )
            print(row, flush=True)
            lines.append(row)
            free_memory()
    cross_entropy_goals(results, copy_bw, lines)


def time_cross_entropy_config(
    n_rows: int, vocab: int, block: int, warps: int, with_grad: bool
) -> float:
    x = torch.randn(n_rows, vocab, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, vocab, (n_rows,), device="cuda")
    t[::100] = -100
    loss = torch.empty(n_rows, device="cuda")
    scale = torch.ones(1, device="cuda")

    def run():
        ce_module.launch_cross_entropy_forward(
            x,
            x if with_grad else None,
            t,
            loss,
            None,
            None,
            scale,
            ignore_index=-100,
            label_smoothing=0.0,
            softcap=0.0,
            z_loss_scale=0.0,
            block=block,
            num_warps=warps,
        )

    return do_bench_ms(run)


CE_CONFIGS = [(4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]


def sweep_cross_entropy_configs(copy_bw: float, lines: list[str]) -> None:
    """Forward kernel time per (BLOCK, num_warps): with the gradient written in place (read +
    write counted) and loss only (read counted)."""
    lines += [
        "## Cross-entropy kernel launch configurations (kernel alone, do_bench)",
        "",
        "One program per row; a row longer than BLOCK is streamed twice (online max/sum, then "
        "the gradient), a row within BLOCK is held in registers. % copy counts the logits read "
        "and, with the gradient, written once.",
        "",
        "| rows x vocab | BLOCK | one block | num_warps | with gradient ms | % copy "
        "| loss only ms | % copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n_rows, vocab in CE_SIZES:
        logits_bytes = n_rows * vocab * 2
        for block, warps in CE_CONFIGS:
            cells = []
            for with_grad in (True, False):
                ms = time_cross_entropy_config(n_rows, vocab, block, warps, with_grad)
                gbps = logits_bytes * (2 if with_grad else 1) / ms / 1e6
                cells += [f"{ms:.3f}", f"{100 * gbps / copy_bw:.0f}%"]
            row = f"| {n_rows} x {vocab} | {block} | {block >= vocab} | {warps} | "
            row += " | ".join(cells) + " |"
            print(row, flush=True)
            lines.append(row)
            free_memory()
    lines.append("")


# --- (2) fused linear cross entropy ---------------------------------------------------------


def flce_methods(compiled):
    def eager(x, w, t):
        return F.cross_entropy((x @ w.t()).float(), t)

    methods = {}
    for name, budget in BUDGETS.items():
        methods[name] = lambda x, w, t, b=budget: fused_linear_cross_entropy(
            x, w, t, memory_budget=b
        )
    methods["memplan formula"] = lambda x, w, t: fused_linear_cross_entropy(x, w, t)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        methods["Liger"] = lambda x, w, t: liger(w, x, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        methods["Cut Cross-Entropy"] = lambda x, w, t: linear_cross_entropy(x, w, t)
    except ImportError:
        pass
    methods["torch.compile"] = compiled
    methods["torch eager"] = eager
    return methods


def memplan_chunk(name: str, n_rows: int, hidden: int, vocab: int) -> tuple[int, str]:
    budget = BUDGETS.get(name)
    if budget is None:
        chunk = flce_default_chunk(n_rows, hidden, vocab)
    else:
        chunk = flce_chunk_for_budget(n_rows, hidden, vocab, 2, budget)
    chunk = min(chunk, n_rows)
    schedule = flce_schedule(
        n_rows,
        hidden,
        vocab,
        2,
        chunk,
        weight_requires_grad=True,
        budget_bytes=budget,
        has_bias=False,
    )
    return chunk, schedule


def measure_flce(method, x, w, t) -> tuple[float, int]:
    """(forward+backward ms, peak bytes above the inputs)."""

    def clear():
        x.grad = w.grad = None

    def run():
        clear()
        method(x, w, t).backward()

    return median_ms(run), peak_above(lambda: method(x, w, t).backward(), clear)


SCHEDULES_TEXT = (
    "memplan's FLCE (memplan/kernels/fused_linear_cross_entropy.py) never accumulates dW in "
    "bf16. 'one_pass': three GEMMs per chunk when nothing needs low-precision accumulation "
    "(a single chunk, an fp32 weight). 'one_pass_fp32_acc': three GEMMs per chunk with dW "
    "accumulated by cuBLAS in an fp32 (V x H) buffer, chosen only when a memory_budget holds "
    "it. 'two_pass' (the default otherwise): pass 1 computes logits, loss, the per-row "
    "log-sum-exp and dX per row chunk; pass 2 recomputes the logits per vocabulary slice and "
    "writes dW[slice] with one GEMM over all rows: exact and lean, at a fourth GEMM. Liger "
    "0.8.5 accumulates dW in bf16 by default; Cut Cross-Entropy skips gradient blocks below "
    "a threshold (filter_eps='high', its default)."
)
HEADROOM = "memplan 4 GiB"


def flce_goals(points: dict, tflops: float, lines: list[str]) -> None:
    """Per point: the headroom run's time against Liger and CCE, the formula run's memory."""
    lines += [
        "",
        f"### Goals per point (headroom run: {HEADROOM!r}; lean run: 'memplan formula')",
        "",
        "| BT x H x V | headroom / Liger time (<= 0.8) | headroom / CCE time (<= 1.0) "
        "| Liger % of floor | 0.8 x Liger as % of floor | formula peak / bound (<= 1.1) "
        "| formula peak / Liger peak (<= 1.0) | formula - Liger peak |",
        "|" + "---|" * 8,
    ]
    for (n_rows, hidden, vocab), results in points.items():
        floor_ms = 3 * 2 * n_rows * hidden * vocab / (tflops * 1e9)
        head, lean = results.get(HEADROOM), results.get("memplan formula")
        liger, cce = results.get("Liger"), results.get("Cut Cross-Entropy")
        if not all(isinstance(r, tuple) for r in (head, lean, liger, cce)):
            lines.append(f"| {n_rows} x {hidden} x {vocab} | incomplete | | | | | | |")
            continue
        chunk, _ = memplan_chunk("memplan formula", n_rows, hidden, vocab)
        bound = (n_rows * hidden + vocab * hidden + chunk * vocab) * 2
        lines.append(
            f"| {n_rows} x {hidden} x {vocab} | {head[0] / liger[0]:.2f} | "
            f"{head[0] / cce[0]:.2f} | {100 * floor_ms / liger[0]:.0f}% | "
            f"{100 * floor_ms / (0.8 * liger[0]):.0f}% | {lean[1] / bound:.3f} | "
            f"{lean[1] / liger[1]:.4f} | {(lean[1] - liger[1]) / MIB:+.2f} MiB |"
        )
    lines.append("")


def bench_flce(tflops: float, deadline: float, lines: list[str], out: str) -> None:
    compiled = torch.compile(lambda x, w, t: F.cross_entropy((x @ w.t()).float(), t), dynamic=True)
    header = (
        "| BT x H x V | method | chunk, schedule | fwd+bwd ms | % of floor | peak MiB "
        "| peak / (dX+dW+chunk) | vs Liger time | vs CCE time | vs Liger peak |"
    )
    lines += [
        "## Fused linear cross entropy (bf16 x, W; int64 targets; mean; 1% ignored), "
        "forward + backward",
        "",
        f"Compute floor: 3 GEMMs of 2*BT*H*V FLOP at the measured {tflops:.0f} TFLOP/s. Peak: "
        "allocated above the inputs (x, W, targets), dX and dW included. The bound is "
        "dX + dW + one chunk's logits (bf16) at that run's chunk; the goal is <= 1.1. "
        "memplan rows: 'formula' is the default chunk 2^ceil(log2(BT / ceil(V/H))), "
        "'2 GiB' / '4 GiB' pass memory_budget (the advisor's headroom) and the kernel picks "
        "the chunk and schedule.",
        "",
        SCHEDULES_TEXT,
        "",
        header,
        "|" + "---|" * 10,
    ]
    print("\n" + header)
    points = {}
    for n_rows in FLCE_ROWS:
        for hidden, vocab in FLCE_HV:
            if time.monotonic() > deadline:
                row = f"| {n_rows} x {hidden} x {vocab} | skipped: benchmark time limit |"
                print(row)
                lines.append(row)
                continue
            floor_ms = 3 * 2 * n_rows * hidden * vocab / (tflops * 1e9)
            results = points[n_rows, hidden, vocab] = {}
            x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16)
            x.requires_grad_()
            w.requires_grad_()
            t = torch.randint(0, vocab, (n_rows,), device="cuda")
            t[::100] = -100

            for name, method in flce_methods(compiled).items():
                try:
                    results[name] = measure_flce(method, x, w, t)
                except Exception as exc:  # one failing baseline must not end the run
                    results[name] = failure(exc)
                x.grad = w.grad = None
                free_memory()

            liger, cce = results.get("Liger"), results.get("Cut Cross-Entropy")
            liger = liger if isinstance(liger, tuple) else None
            cce = cce if isinstance(cce, tuple) else None
            for name, result in results.items():
                label = f"{n_rows} x {hidden} x {vocab}"
                if isinstance(result, str):
                    row = f"| {label} | {name} | | {result} | | | | | | |"
                    print(row, flush=True)
                    lines.append(row)
                    continue
                ms, peak = result
                chunk_text, bound_text = "", ""
                if name.startswith("memplan"):
                    chunk, schedule = memplan_chunk(name, n_rows, hidden, vocab)
                    chunk_text = f"{chunk}, {schedule}"
                    bound = (n_rows * hidden + vocab * hidden + chunk * vocab) * 2
                    bound_text = f"{peak / bound:.2f}"
                vs_liger = f"{ms / liger[0]:.2f}" if liger else ""
                vs_cce = f"{ms / cce[0]:.2f}" if cce else ""
                vs_liger_peak = f"{peak / liger[1]:.2f}" if liger else ""
                row = (
                    f"| {label} | {name} | {chunk_text} | {ms:.1f} | "
                    f"{100 * floor_ms / ms:.0f}% | {peak / MIB:.0f} | {bound_text} | "
                    f"{vs_liger} | {vs_cce} | {vs_liger_peak} |"
                )
                print(row, flush=True)
                lines.append(row)
            del x, w, t
            free_memory()
            write(lines, out)
    flce_goals(points, tflops, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench_loss.md")
    parser.add_argument("--sweep", action="store_true", help="also time CE launch configs")
    parser.add_argument("--time-limit", type=float, default=250.0, help="seconds for FLCE")
    parser.add_argument("--skip-ce", action="store_true")
    parser.add_argument("--skip-flce", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_loss.py needs a CUDA GPU")
    started = time.monotonic()
    copy_bw, tflops = copy_gbps(), matmul_tflops()
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# Loss kernels: benchmark",
        "",
        f"Generated by `python benchmarks/bench_loss.py` on {datetime.date.today()}: "
        f"{props.name} ({props.total_memory / GIB:.0f} GiB), torch {torch.__version__}, "
        f"triton {version('triton')}, liger-kernel {version('liger-kernel')}, "
        f"cut-cross-entropy {version('cut-cross-entropy')}.",
        "",
        f"Measured in this run: device copy {copy_bw:.0f} GB/s (read + write), bf16 torch.mm "
        f"8192^3 {tflops:.0f} TFLOP/s.",
        "",
    ]
    print("\n".join(lines))
    if not args.skip_ce:
        bench_cross_entropy(copy_bw, lines)
        write(lines, args.out)
    if args.sweep:
        sweep_cross_entropy_configs(copy_bw, lines)
        write(lines, args.out)
    if not args.skip_flce:
        bench_flce(tflops, started + args.time_limit, lines, args.out)
    lines.append(f"Total benchmark time: {time.monotonic() - started:.0f} s.")
    write(lines, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
