"""Probe: where a norm forward's time goes under triton.testing.do_bench, which zeroes a 256 MB
buffer before every call to flush the L2 (RMSNorm 16384x4096 read 77% of the copy bandwidth
there and 98% replayed from a CUDA graph; docs/bench_kernels.md, session 12).

Per implementation (the norm modules as bench_kernels.py builds them, and a device-to-device
copy of the same bytes), in us per call:
- do_bench: bench_kernels.py's figure (median, L2 flushed, the host launching as it goes);
- queued, dirty L2: the same loop (zero the buffer, start event, call, end event), enqueued
  while a sleep kernel holds the GPU, so the host is never the bottleneck: the GPU's time
  after a flush, the flush's dirty lines still in the L2;
- queued, clean L2: as above, with a 256 MB read between the flush and the start event, which
  writes the dirty lines back before the timed call;
- queued, no flush: back-to-back calls, nothing between them;
- CUDA graph: bench_kernels.py's graph_ms (calls replayed back to back);
- host: wall time per call on the host while the GPU is held by a sleep kernel.

    python benchmarks/probe_dobench_flush.py [--sizes 16384x4096,65536x4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_kernels import (
    DTYPE,
    bench_ms,
    copy_bandwidth_gbs,
    graph_ms,
    pin_to_one_core,
    rms_norm_cases,
)

FLUSH_BYTES = 256_000_000  # triton.testing's cache buffer (256e6 bytes of int32)
SLEEP_CYCLES = 100_000_000  # ~60 ms at the H200's clocks: longer than enqueuing N calls
N_CALLS = 40


def queued_us(fn: Callable[[], object], mode: str) -> float:
    """Median GPU time per call with every call enqueued before the GPU reaches it."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    clean = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(N_CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(N_CALLS)]
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for start, end in zip(starts, ends, strict=True):
        if mode != "no flush":
            flush.zero_()
        if mode == "clean":
            clean.amax()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def host_us(fn: Callable[[], object]) -> float:
    """Host wall time per call, the GPU held by a sleep kernel so no launch waits on it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(N_CALLS):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / N_CALLS * 1e6


def forwards(rows: int, hidden: int) -> dict[str, Callable[[], object]]:
    fns = {name: factory().run for name, factory in rms_norm_cases(rows, hidden).items()
           if name != "HF eager"}  # fmt: skip
    src = torch.empty(rows * hidden, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    fns["copy, same bytes"] = lambda: dst.copy_(src)
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16384x4096,65536x4096")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(pin_to_one_core(), torch.cuda.get_device_name())
    with torch.cuda.stream(torch.cuda.Stream()):
        copy_gbs = copy_bandwidth_gbs()
        print(f"copy bandwidth (512 MiB, do_bench): {copy_gbs:.0f} GB/s")
        columns = ["do_bench", "queued, dirty L2", "queued, clean L2", "queued, no flush",
                   "CUDA graph", "host"]  # fmt: skip
        print("| size | impl | " + " | ".join(f"{c} us" for c in columns) + " | do_bench % copy |")
        print("|---|---|" + "---:|" * (len(columns) + 1))
        for size in args.sizes.split(","):
            rows, hidden = (int(v) for v in size.split("x"))
            fns = forwards(rows, hidden)
            samples: dict[str, list[list[float]]] = {n: [[] for _ in columns] for n in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    cols = samples[name]
                    cols[0].append(bench_ms(fn) * 1e3)
                    cols[1].append(queued_us(fn, "dirty"))
                    cols[2].append(queued_us(fn, "clean"))
                    cols[3].append(queued_us(fn, "no flush"))
                    cols[4].append(graph_ms(fn) * 1e3)
                    cols[5].append(host_us(fn))
            traffic = 2 * rows * hidden * 2  # read x + write y, bf16
            for name, cols in samples.items():
                medians = [statistics.median(c) for c in cols]
                share = traffic / (medians[0] * 1e-6) / 1e9 / copy_gbs
                print(f"| {size} | {name} | " + " | ".join(f"{m:.1f}" for m in medians)
                      + f" | {100 * share:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
