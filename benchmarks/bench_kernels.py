"""Elementwise kernels on one GPU: RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU, gated RMSNorm.

For each op and size: forward and forward+backward median time (triton.testing.do_bench), the
forward+backward replayed from a CUDA graph (the GPU's time without the host's per-call cost,
which dominates at small sizes), GB/s and share of the device-to-device
copy bandwidth measured in the same run, and the peak memory of one forward+backward above its
inputs, for HF eager, torch.compile of the eager code, Liger-Kernel and memplan. Gradients are
taken with torch.autograd.grad (no .grad accumulation), as inside a model where the inputs are
activations, not leaves.

Bytes counted (the minimum any implementation must move): RMSNorm/LayerNorm forward = read x +
write y, backward = read x, read dy, write dx; RoPE forward = read + write q and k, backward the
same for their gradients; SwiGLU/GeGLU forward = read gate, up + write out, backward = read dout,
gate, up + write dgate, dup; gated RMSNorm forward = read x, gate + write y, backward = read x,
gate, dy + write dx, dgate. Weights, cos/sin and per-row statistics are not counted. Liger-Kernel
has no gated RMSNorm: that op is judged against torch.compile alone.

    python benchmarks/bench_kernels.py                # all ops, writes docs/bench_kernels.md
    python benchmarks/bench_kernels.py --ops rms_norm --tune   # launch-parameter sweep only
    python benchmarks/bench_kernels.py --profile rope:4,4096,32,8,128   # GPU time per kernel
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from memplan.kernels import _glu as mp_glu
from memplan.kernels import gated_rms_norm as mp_gated_rms_norm
from memplan.kernels import geglu as mp_geglu
from memplan.kernels import layer_norm as mp_layer_norm
from memplan.kernels import rms_norm as mp_rms_norm
from memplan.kernels import rope as mp_rope
from memplan.kernels import swiglu as mp_swiglu
from memplan.kernels._utils import NormBackwardConfig, norm_backward_config, num_sms

DTYPE = torch.bfloat16
EL = 2  # bytes per bf16 element
# Short do_bench calls in many interleaved rounds: the host's speed drifts within seconds, and
# host-bound cells compare only what was timed close together (measure_rounds).
WARMUP_MS, REP_MS = 5, 15

SIZES = {
    # rows x hidden; the two goal sizes first (docs/methodology.md)
    "rms_norm": [(16384, 4096), (65536, 4096), (4096, 1024), (4096, 8192), (16384, 1024),
                 (16384, 16384), (32768, 2048), (65536, 8192)],
    "layer_norm": [(16384, 4096), (65536, 4096), (4096, 1024), (16384, 16384), (32768, 2048)],
    # batch, seq, q heads, kv heads, head_dim (tokens = batch * seq)
    "rope": [(1, 4096, 32, 8, 128), (4, 4096, 32, 8, 128), (8, 8192, 32, 8, 128),
             (4, 4096, 32, 8, 64), (16, 4096, 16, 16, 128)],
    # rows x intermediate size
    "swiglu": [(4096, 1024), (4096, 14336), (16384, 8192), (16384, 14336), (65536, 4096)],
    "geglu": [(4096, 1024), (4096, 16384), (16384, 8192), (65536, 4096)],
    # rows (tokens x value heads) x value head dim: Qwen3.5-0.8B and -9B at 4 x 2048 tokens
    "gated_rms_norm": [(131072, 128), (262144, 128), (16384, 128)],
}  # fmt: skip


@dataclass
class Case:
    """One implementation at one size: `run()` is the forward, returning outputs; `grad_of`
    the tensors to differentiate; `grads_out` the output gradients."""

    run: Callable[[], tuple[torch.Tensor, ...]]
    grad_of: list[torch.Tensor]
    grads_out: tuple[torch.Tensor, ...]


@dataclass
class Row:
    op: str
    size: str
    impl: str
    fwd_ms: float
    fwdbwd_ms: float
    fwd_bytes: int
    fwdbwd_bytes: int
    peak_mib: float
    max_rel_err: float = float("nan")
    graph_ms: float = float("nan")  # fwd+bwd replayed from a CUDA graph: GPU time, no host
    fwd_graph_ms: float = float("nan")  # the forward alone, replayed likewise
    extra: dict = field(default_factory=dict)


# --- measurement ------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def pin_to_one_core() -> str:
    """Keep the process on one CPU core. On the benchmark host (a VM with 16 vCPUs), the host
    time of a small forward+backward halved once pinned and its spread over rounds narrowed:
    Liger's RoPE at 1x128 tokens 216-230 us against 414-579 us unpinned
    (probe_host.py --ops, H200 host, 2026-11-22)."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"pinned to CPU core {core}"


def copy_bandwidth_gbs() -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def fwd_bwd(case: Case) -> tuple[torch.Tensor, ...]:
    outs = case.run()
    return torch.autograd.grad(outs, case.grad_of, case.grads_out)


def peak_mib(step: Callable[[], object]) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


def graph_ms(fn: Callable[[], object], retries: int = 10) -> float:
    """Median time of `fn` replayed from a CUDA graph: the GPU's time alone, which the host's
    per-call cost (Python, autograd, launches) hides at small sizes; NaN if it cannot be
    captured. do_bench_cudagraph's method (calls unrolled in one graph for REP_MS, replayed
    `retries` times), but captured on the current stream, where main() runs everything: the
    inputs' autograd nodes were recorded on it, and the backward of a graph captured on any
    other stream would make their stream wait on the capturing one, which invalidates the
    capture (cudaErrorStreamCaptureImplicit on the legacy stream)."""
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():
        raise RuntimeError("graph_ms needs a side stream: the legacy stream cannot capture")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        fn()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        n_repeat = max(1, int(REP_MS / max(start.elapsed_time(end) / 5, 1e-3)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n_repeat):
                fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(retries):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / n_repeat)
        del graph
        return statistics.median(times)
    except Exception as exc:  # a capture failure only costs the column
        print(f"  no CUDA graph: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def measure_rounds(cases: dict[str, Case], rounds: int) -> dict[str, tuple[list, list]]:
    """do_bench forward and forward+backward times of every implementation, `rounds` times,
    each round taking the implementations in a rotated order: the host's speed drifts by up to
    2x over minutes (bench_kernels.md), and host-bound sizes measure the host, so only times
    taken side by side compare. Returns {impl: (forward ms per round, fwd+bwd ms per round)}."""
    times: dict[str, tuple[list, list]] = {impl: ([], []) for impl in cases}
    gc.collect()
    gc.disable()  # a collection inside a timed loop shows up as host time at small sizes
    try:
        for impl in rotations(list(cases), rounds):
            case = cases[impl]
            times[impl][0].append(bench_ms(case.run))
            times[impl][1].append(bench_ms(lambda case=case: fwd_bwd(case)))
    finally:
        gc.enable()
    return times


def rotated(names: list[str], round_index: int) -> list[str]:
    """The names in round `round_index`'s order: rotated by one more each round."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def rotations(names: list[str], rounds: int) -> Iterator[str]:
    """Every name once per round, the order rotated by one each round."""
    for r in range(rounds):
        yield from rotated(names, r)


def peak_and_graphs(case: Case) -> tuple[float, float, float]:
    """Peak MiB of one forward+backward, then its CUDA-graph time and the forward's."""
    peak = peak_mib(lambda: fwd_bwd(case))  # before the graphs and their private memory pools
    gc.disable()  # a collection during capture can run CUDA work that invalidates it
    try:
        return peak, graph_ms(lambda: fwd_bwd(case)), graph_ms(case.run)
    finally:
        gc.enable()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


# --- implementations per op -------------------------------------------------------------------


# Each *_cases(size) returns {impl: factory}; a factory builds that implementation's inputs
# afresh from the same seed, since in-place implementations overwrite theirs (Liger's RoPE
# rotates q/k in place; in-place backwards overwrite dy or the saved gate/up).


def _activation(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """An input that requires grad and is not a leaf, as a layer's activations are: the in-place
    options write over activations, never over leaves (parameters), which they leave alone."""
    leaf = (torch.randn(*shape, device="cuda") * scale).to(DTYPE).requires_grad_()
    return leaf * 1


def _norm_case(module: torch.nn.Module, rows: int, hidden: int) -> Case:
    torch.manual_seed(0)
    x = _activation(rows, hidden)
    dy = torch.randn_like(x)
    params = [p for p in module.parameters()]
    return Case(lambda: (module(x),), [x, *params], (dy,))


def rms_norm_cases(rows: int, hidden: int) -> dict[str, Callable[[], Case]]:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def make(kind: str) -> Callable[[], Case]:
        def factory() -> Case:
            if kind == "liger":
                m = LigerRMSNorm(hidden, eps=1e-6)
            elif kind == "memplan":
                m = mp_rms_norm.RMSNorm(hidden, eps=1e-6, in_place_backward=True)  # as apply
            else:
                m = LlamaRMSNorm(hidden, eps=1e-6)
            m = m.to("cuda", DTYPE)
            if kind == "compile":
                m = torch.compile(m, dynamic=False)
            return _norm_case(m, rows, hidden)

        return factory

    return {"HF eager": make("hf"), "torch.compile": make("compile"), "Liger": make("liger"),
            "memplan": make("memplan")}  # fmt: skip


def layer_norm_cases(rows: int, hidden: int) -> dict[str, Callable[[], Case]]:
    from liger_kernel.transformers.layer_norm import LigerLayerNorm

    def make(kind: str) -> Callable[[], Case]:
        def factory() -> Case:
            if kind == "liger":
                m = LigerLayerNorm(hidden, eps=1e-5, bias=True)
                torch.nn.init.zeros_(m.bias)
            elif kind == "memplan":
                m = mp_layer_norm.LayerNorm(hidden, eps=1e-5)
            else:
                m = torch.nn.LayerNorm(hidden, eps=1e-5)
            m = m.to("cuda", DTYPE)
            if kind == "compile":
                m = torch.compile(m, dynamic=False)
            return _norm_case(m, rows, hidden)

        return factory

    return {"HF eager": make("hf"), "torch.compile": make("compile"), "Liger": make("liger"),
            "memplan": make("memplan")}  # fmt: skip


def rope_cases(
    batch: int, seq: int, n_q: int, n_kv: int, head_dim: int
) -> dict[str, Callable[[], Case]]:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def make(fn: Callable) -> Callable[[], Case]:
        def factory() -> Case:
            torch.manual_seed(0)
            # As in the attention layer: projections (B, S, heads * D) seen as (B, heads, S, D).
            q_proj = _activation(batch, seq, n_q * head_dim)
            k_proj = _activation(batch, seq, n_kv * head_dim)
            inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
            freqs = torch.outer(torch.arange(seq, device="cuda", dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)[None]
            cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
            # Gradients in q and k's layout, as attention's backward returns them (its dq is
            # empty_like(q): (B, S, heads, D) memory seen as (B, heads, S, D)).
            dq = torch.randn(batch, seq, n_q, head_dim, device="cuda", dtype=DTYPE).transpose(1, 2)
            dk = torch.randn(batch, seq, n_kv, head_dim, device="cuda", dtype=DTYPE).transpose(1, 2)

            def run() -> tuple[torch.Tensor, ...]:
                q = q_proj.view(batch, seq, n_q, head_dim).transpose(1, 2)
                k = k_proj.view(batch, seq, n_kv, head_dim).transpose(1, 2)
                return tuple(fn(q, k, cos, sin))

            return Case(run, [q_proj, k_proj], (dq, dk))

        return factory

    return {
        "HF eager": make(apply_rotary_pos_emb),
        "torch.compile": make(torch.compile(apply_rotary_pos_emb, dynamic=False)),
        "Liger": make(liger_rotary_pos_emb),
        "memplan": make(mp_rope.rope),
        "memplan in place": make(lambda q, k, c, s: mp_rope.rope(q, k, c, s, in_place=True)),
    }


def _glu_cases(
    rows: int, cols: int, eager: Callable, liger_fn: Callable, ours: Callable
) -> dict[str, Callable[[], Case]]:
    def make(fn: Callable) -> Callable[[], Case]:
        def factory() -> Case:
            torch.manual_seed(0)
            gate, up = _activation(rows, cols, scale=2.0), _activation(rows, cols)
            dout = torch.randn_like(gate)
            return Case(lambda: (fn(gate, up),), [gate, up], (dout,))

        return factory

    return {
        "HF eager": make(eager),
        "torch.compile": make(torch.compile(eager, dynamic=False)),
        "Liger": make(liger_fn),
        "memplan": make(ours),
        "memplan in-place bwd": make(lambda g, u: ours(g, u, in_place_backward=True)),
    }


def swiglu_cases(rows: int, cols: int) -> dict[str, Callable[[], Case]]:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    return _glu_cases(rows, cols, eager, LigerSiLUMulFunction.apply, mp_swiglu.swiglu)


def geglu_cases(rows: int, cols: int) -> dict[str, Callable[[], Case]]:
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    def eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.gelu(g, approximate="tanh") * u

    return _glu_cases(rows, cols, eager, LigerGELUMulFunction.apply, mp_geglu.geglu)


def gated_rms_norm_cases(rows: int, width: int) -> dict[str, Callable[[], Case]]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    class MemplanGated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(width))

        def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return mp_gated_rms_norm.gated_rms_norm(x, gate, self.weight, 1e-6)

    def make(kind: str) -> Callable[[], Case]:
        def factory() -> Case:
            m = MemplanGated() if kind == "memplan" else Qwen3_5RMSNormGated(width, eps=1e-6)
            m = m.to("cuda", DTYPE)
            if kind == "compile":
                m = torch.compile(m, dynamic=False)
            torch.manual_seed(0)
            x, gate = _activation(rows, width), _activation(rows, width, scale=2.0)
            dy = torch.randn_like(x)
            return Case(lambda: (m(x, gate),), [x, gate, *m.parameters()], (dy,))

        return factory

    return {"HF eager": make("hf"), "torch.compile": make("compile"), "memplan": make("memplan")}


def traffic(op: str, size: tuple[int, ...]) -> tuple[int, int]:
    """(forward bytes, forward+backward bytes) per the module docstring."""
    if op == "rope":
        b, s, n_q, n_kv, d = size
        qk = b * s * (n_q + n_kv) * d * EL
        return 2 * qk, 4 * qk
    rows, cols = size
    t = rows * cols * EL
    if op in ("swiglu", "geglu", "gated_rms_norm"):
        return 3 * t, 8 * t
    return 2 * t, 5 * t


# The variant memplan.apply runs (memplan/patching): RoPE in place and the GLU backward written
# over gate and up, as Liger does; the functional defaults allocate new tensors instead.
DEPLOYED = {"rope": "memplan in place", "swiglu": "memplan in-place bwd",
            "geglu": "memplan in-place bwd"}  # fmt: skip


CASES = {
    "rms_norm": rms_norm_cases,
    "layer_norm": layer_norm_cases,
    "rope": rope_cases,
    "swiglu": swiglu_cases,
    "geglu": geglu_cases,
    "gated_rms_norm": gated_rms_norm_cases,
}


def run_op(op: str, size: tuple[int, ...], rounds: int) -> list[Row]:
    factories = CASES[op](*size)
    ref_outs = [o.detach() for o in factories["HF eager"]().run()]
    fwd_bytes, both_bytes = traffic(op, size)
    cases, errors = {}, {}
    for impl, factory in factories.items():
        cases[impl] = factory()
        # checked before timing: in-place implementations overwrite their inputs
        errors[impl] = max(rel_err(o, r) for o, r in zip(cases[impl].run(), ref_outs))
    times = measure_rounds(cases, rounds)
    rows = []
    for impl, case in cases.items():
        peak, graphed, fwd_graphed = peak_and_graphs(case)
        fwd, both = times[impl]
        rows.append(Row(op, "x".join(map(str, size)), impl, statistics.median(fwd),
                        statistics.median(both), fwd_bytes, both_bytes, peak, errors[impl],
                        graphed, fwd_graphed, {"fwdbwd_rounds": both}))  # fmt: skip
    del cases
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def round_ratios(ours: Row, theirs: Row) -> list[float]:
    """ours / theirs fwd+bwd per round, each pair timed in the same round."""
    return [a / b for a, b in zip(ours.extra["fwdbwd_rounds"], theirs.extra["fwdbwd_rounds"])]


def paired_ratio(ours: Row, theirs: Row) -> float:
    return statistics.median(round_ratios(ours, theirs))


# --- launch-parameter sweep (--tune) ------------------------------------------------------------


@contextlib.contextmanager
def patched(module: object, **attrs: object) -> Iterator[None]:
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _rows_config(r: int, warps: int) -> Callable[[int], tuple[int, int, int]]:
    return lambda n: (triton.next_power_of_2(n), r, warps)


def _backward_config(
    r: int, warps: int, per_sm: int, weight_from_cache: bool | None = None
) -> Callable[..., NormBackwardConfig]:
    def cfg(n_rows: int, n_cols: int, sms: int, op: str) -> NormBackwardConfig:
        n_programs = min(triton.cdiv(n_rows, r), sms * per_sm)
        rows_per_program = triton.cdiv(n_rows, n_programs)
        n_programs = triton.cdiv(n_rows, rows_per_program)
        default = norm_backward_config(n_rows, n_cols, sms, op).weight_from_cache
        return NormBackwardConfig(
            triton.next_power_of_2(n_cols),
            r,
            warps,
            n_programs,
            rows_per_program,
            default if weight_from_cache is None else weight_from_cache,
        )

    return cfg


def _tile_config(tile: int, warps: int) -> Callable[[int], tuple[int, int, int]]:
    def cfg(n: int) -> tuple[int, int, int]:
        block = min(triton.next_power_of_2(n), tile)
        return tile // block, block, warps

    return cfg


def _tune_rms_norm(rows: int, hidden: int, report: Callable) -> None:
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    w = torch.ones(hidden, device="cuda", dtype=DTYPE)
    dy = torch.randn_like(x)
    fwd_b, both_b = traffic("rms_norm", (rows, hidden))
    block = triton.next_power_of_2(hidden)
    name = f"rms_norm {rows}x{hidden}"
    for r in (1, 2, 4):
        for warps in (4, 8, 16, 32):
            if block * r > 32768 or block * r < 128 * warps:
                continue
            with patched(mp_rms_norm, norm_forward_config=_rows_config(r, warps)):
                ms = bench_ms(lambda: mp_rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, False))
            report(f"{name} fwd ROWS={r} warps={warps}", ms, fwd_b)
    _, rstd = mp_rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, False)
    for r in (1, 2, 4, 8):
        for warps in (4, 8, 16, 32):
            if block * r > 32768 or block * r < 128 * warps:
                continue
            for per_sm in (1, 2, 4, 8):
                cfg = _backward_config(r, warps, per_sm)
                with patched(mp_rms_norm, norm_backward_config=cfg):
                    ms = bench_ms(
                        lambda: mp_rms_norm.rms_norm_backward(dy, x, w, rstd, 0.0, False, True)
                    )
                report(f"{name} bwd ROWS={r} warps={warps} programs/SM={per_sm}", ms,
                       both_b - fwd_b)  # fmt: skip


def _tune_norm_rows(rows: int, hidden: int, report: Callable) -> None:
    """RMSNorm and LayerNorm at rows of 4K elements and wider, by warps, GPU time alone (CUDA
    graph): the forward (one row per program), and the backward at its default rows and
    programs per SM, for RMSNorm also with the weight reloaded per row
    (NormBackwardConfig.weight_from_cache). Source of memplan.kernels._utils.WIDE_ROW_BACKWARD
    and of the forward's warps at 8192-element rows."""
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    w = torch.ones(hidden, device="cuda", dtype=DTYPE)
    b = torch.zeros(hidden, device="cuda", dtype=DTYPE)
    dy = torch.randn_like(x)
    fwd_b, both_b = traffic("rms_norm", (rows, hidden))
    _, rstd = mp_rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, False)
    _, mean, ln_rstd = mp_layer_norm.layer_norm_forward(x, w, b, 1e-5)
    ops = {
        "rms_norm": (
            mp_rms_norm,
            lambda: mp_rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, False),
            lambda: mp_rms_norm.rms_norm_backward(dy, x, w, rstd, 0.0, False, True),
        ),
        "layer_norm": (
            mp_layer_norm,
            lambda: mp_layer_norm.layer_norm_forward(x, w, b, 1e-5),
            lambda: mp_layer_norm.layer_norm_backward(dy, x, w, mean, ln_rstd, True, True),
        ),
    }
    default = norm_backward_config(rows, hidden, num_sms(torch.device("cuda")), "rms_norm")
    per_sm = -(-default.n_programs // num_sms(torch.device("cuda")))
    for op, (module, forward, backward) in ops.items():
        for warps in (4, 8, 16, 32):
            with patched(module, norm_forward_config=_rows_config(1, warps)):
                ms = graph_ms(forward)
            report(f"{op} {rows}x{hidden} fwd warps={warps}", ms, fwd_b)
            for from_cache in (False, True) if op == "rms_norm" else (False,):
                config = _backward_config(default.rows, warps, per_sm, from_cache)
                with patched(module, norm_backward_config=config):
                    ms = graph_ms(backward)
                label = f"{op} {rows}x{hidden} bwd warps={warps} weight_from_cache={from_cache}"
                report(label, ms, both_b - fwd_b)


def _tune_swiglu(rows: int, cols: int, report: Callable) -> None:
    """GPU time alone (CUDA graph): the small sizes are host-bound under do_bench."""
    g = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
    u, do = torch.randn_like(g), torch.randn_like(g)
    fwd_b, both_b = traffic("swiglu", (rows, cols))
    for tile in (256, 512, 1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8, 16):
            if tile < 128 * warps or tile > 2048 * warps:
                continue
            with patched(mp_glu, elementwise_launch_config=_tile_config(tile, warps)):
                fwd = graph_ms(lambda: mp_swiglu.swiglu_forward(g, u))
                bwd = graph_ms(lambda: mp_swiglu.swiglu_backward(do, g, u))
                bwd_p = graph_ms(lambda: mp_swiglu.swiglu_backward(do, g, u, product=do))
            report(f"swiglu {rows}x{cols} fwd tile={tile} warps={warps}", fwd, fwd_b)
            report(f"swiglu {rows}x{cols} bwd tile={tile} warps={warps}", bwd, both_b - fwd_b)
            report(f"swiglu {rows}x{cols} bwd+product tile={tile} warps={warps}", bwd_p,
                   both_b - fwd_b + fwd_b // 3)  # fmt: skip


def _tune_rope(b: int, s: int, n_q: int, n_kv: int, d: int, report: Callable) -> None:
    """GPU time alone (CUDA graph), forward and the in-place backward."""
    q = torch.randn(b, s, n_q, d, device="cuda", dtype=DTYPE).transpose(1, 2)
    k = torch.randn(b, s, n_kv, d, device="cuda", dtype=DTYPE).transpose(1, 2)
    cos = torch.randn(1, s, d, device="cuda", dtype=DTYPE)
    fwd_b, _ = traffic("rope", (b, s, n_q, n_kv, d))
    for warps in (1, 2, 4, 8):
        with patched(mp_rope, _num_warps=lambda *_, warps=warps: warps):
            ms = graph_ms(lambda: mp_rope._launch(q, k, cos, cos, 1, False))
            ms_in_place = graph_ms(lambda: mp_rope._launch(q, k, cos, cos, 1, True, True))
        report(f"rope {b}x{s}x{n_q}x{n_kv}x{d} fwd warps={warps}", ms, fwd_b)
        report(f"rope {b}x{s}x{n_q}x{n_kv}x{d} bwd in place warps={warps}", ms_in_place, fwd_b)
    _liger_rope_reference(q, k, cos, fwd_b, f"rope {b}x{s}x{n_q}x{n_kv}x{d}", report)


def _liger_rope_reference(q, k, cos, nbytes: int, name: str, report: Callable) -> None:
    try:
        from liger_kernel.ops.rope import rope_forward
    except ImportError:
        return
    report(f"{name} Liger fwd (in place)", graph_ms(lambda: rope_forward(q, k, cos, cos)), nbytes)


def _tune_sum_partials(report: Callable) -> None:
    """The norms' second-stage dW sum over (partial rows x hidden) fp32."""
    from memplan.kernels import _norm_weight_grad

    for rows, hidden in ((264, 1024), (264, 2048), (264, 4096), (132, 16384)):
        partials = torch.randn(1, rows, hidden, device="cuda")
        for tile in ((8, 256), (32, 64), (32, 32), (16, 128), (64, 32)):
            with patched(_norm_weight_grad, SUM_TILE=tile):
                ms = bench_ms(lambda p=partials: _norm_weight_grad.sum_partials(p, DTYPE))
            report(f"sum_partials {rows}x{hidden} ROWS,BLOCK={tile}", ms, rows * hidden * 4)


def _host_overhead(report: Callable, rounds: int = 5) -> None:
    """fwd+bwd at a size too small to keep the GPU busy: the time is the host's per-call cost."""
    for op, size in (("rms_norm", (256, 1024)), ("swiglu", (256, 1024))):
        cases = {impl: factory() for impl, factory in CASES[op](*size).items()}
        for impl, (_, both) in measure_rounds(cases, rounds).items():
            ms = statistics.median(both)
            report(f"host-bound {op} fwd+bwd {size[0]}x{size[1]} {impl}", ms, 0)


def profile(spec: str, steps: int = 20) -> None:
    """GPU time per kernel of `steps` forward+backward calls, for Liger and memplan (as apply
    runs it), from torch.profiler: where a gap between the two comes from."""
    op, size_text = spec.split(":")
    size = tuple(int(v) for v in size_text.split(","))
    cases = CASES[op](*size)
    for impl in ("Liger", DEPLOYED.get(op, "memplan")):
        case = cases[impl]()
        for _ in range(3):
            fwd_bwd(case)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fwd_bwd(case)
            torch.cuda.synchronize()
        print(f"\n## {op} {size_text} {impl}: GPU time per call (us), {steps} calls")
        totals: dict[str, float] = {}
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.key] = event.device_time_total / steps
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"{us:9.1f}  {name[:110]}")
        print(f"{sum(totals.values()):9.1f}  total")


def tune(ops: list[str], copy_gbs: float) -> list[str]:
    """Time memplan's kernels under alternative launch parameters; prints and returns lines."""
    lines = ["## Launch-parameter sweep (memplan only)", ""]

    def report(label: str, ms: float, nbytes: int) -> None:
        gbs = nbytes / ms / 1e6
        line = f"- {label}: {ms * 1e3:.1f} us, {gbs:.0f} GB/s ({100 * gbs / copy_gbs:.0f}%)"
        print(line, flush=True)
        lines.append(line)

    if "rms_norm" in ops:
        _tune_sum_partials(report)
        _host_overhead(report)
        for size in [(65536, 4096), (16384, 1024), (16384, 16384)]:
            _tune_rms_norm(*size, report)
    if "rms_norm" in ops or "layer_norm" in ops:
        for size in [(16384, 16384), (4099, 16384), (65536, 8192), (65536, 4096), (16384, 4096)]:
            _tune_norm_rows(*size, report)
    if "swiglu" in ops:
        for size in [(4096, 1024), (16384, 1024), (4096, 14336)]:
            _tune_swiglu(*size, report)
    if "rope" in ops:
        for size in SIZES["rope"]:
            _tune_rope(*size, report)
    return lines


NOTES = """## How the goals are judged

- The judged row is memplan as `memplan.apply` runs it: RoPE in place and the GLU backward
  written over gate and up (Liger's modes, safe where the patcher uses them: the projections'
  outputs are read by nothing else; for phi3, whose q and k are slices of one fused qkv
  projection, RoPE stays out of place), the norms as they are. The functional defaults
  allocate new tensors (q and k, d_gate and d_up) and are reported in the last column.
- Timing: each size builds every implementation, then times them with do_bench in rounds,
  the order rotated each round; the time vs Liger or torch.compile is the median over rounds of
  the two times taken in the same round ("per round" gives their range). The host's speed
  drifts between minutes, so times taken one implementation after another do not compare at
  small sizes.
- Host-bound sizes: where the GPU work is shorter than the host's per-call cost (section above),
  each implementation's do_bench time is its Python/autograd/launch overhead, not its kernel
  ("do_bench / CUDA graph" well above 1). The CUDA-graph column gives the GPU time alone.
  memplan's eager path is an autograd.Function made from the same declaration as its
  torch.library custom op (memplan/kernels/_op.py), without the custom op's dispatch cost per
  call; the custom op is used under torch.compile and for fake/meta tensors.
- RMSNorm/LayerNorm memory: the backward's fp32 dW (and dB) partials are at most SMs x hidden
  (two programs per SM share a row through two atomic adds onto zero, deterministic), Liger's
  size; a Triton kernel sums them into the weight dtype without a staging buffer.""".splitlines()


# --- report -----------------------------------------------------------------------------------


def table(rows: list[Row], copy_gbs: float) -> list[str]:
    out = [
        "| size | impl | fwd ms | fwd GB/s (% copy) | fwd+bwd ms | fwd+bwd GB/s (% copy) "
        "| fwd ms, CUDA graph (% copy) | fwd+bwd ms, CUDA graph | peak MiB | fwd rel err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fg, bg = r.fwd_bytes / r.fwd_ms / 1e6, r.fwdbwd_bytes / r.fwdbwd_ms / 1e6
        gg = r.fwd_bytes / r.fwd_graph_ms / 1e6
        out.append(
            f"| {r.size} | {r.impl} | {r.fwd_ms:.3f} | {fg:.0f} ({100 * fg / copy_gbs:.0f}%) "
            f"| {r.fwdbwd_ms:.3f} | {bg:.0f} ({100 * bg / copy_gbs:.0f}%) "
            f"| {r.fwd_graph_ms:.3f} ({100 * gg / copy_gbs:.0f}%) | {r.graph_ms:.3f} "
            f"| {r.peak_mib:.1f} | {r.max_rel_err:.1e} |"
        )
    return out


def peak_ratio(ours: float, liger: float) -> float:
    """ours / liger, where a Liger peak of 0 (everything in place) is matched only by 0."""
    if liger == 0.0:
        return 1.0 if ours == 0.0 else math.inf
    return ours / liger


def goals(rows: list[Row], copy_gbs: float) -> list[str]:
    """memplan as apply runs it, against Liger and torch.compile: fwd+bwd time, peak memory
    vs Liger, RMSNorm forward >= 80% of copy bandwidth at >= 64M elements."""
    out = [
        "| op | size | judged | memplan/Liger fwd+bwd | per round | memplan/compile fwd+bwd "
        "| memplan/Liger peak | goals | do_bench / CUDA graph | GPU time alone (CUDA graph): "
        "memplan/Liger, memplan/compile | functional default (new tensors): time vs Liger, "
        "vs compile, peaks |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    by_key: dict[tuple[str, str], dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.op, r.size), {})[r.impl] = r
    for (op, size), impls in by_key.items():
        judged = DEPLOYED.get(op, "memplan")
        # without a Liger kernel (the gated RMSNorm) torch.compile stands in its columns
        ours, comp = impls[judged], impls["torch.compile"]
        liger = impls.get("Liger", comp)
        t_liger, t_comp = paired_ratio(ours, liger), paired_ratio(ours, comp)
        per_round = round_ratios(ours, liger)
        mem = peak_ratio(ours.peak_mib, liger.peak_mib)
        against = "Liger" if "Liger" in impls else "torch.compile"
        missed = []
        if t_liger > 1.0 and against == "Liger":
            missed.append("slower than Liger")
        if t_comp > 1.0:
            missed.append("slower than torch.compile")
        if mem > 1.0:
            missed.append(f"more memory than {against}")
        if op == "rms_norm":
            n_el = math.prod(int(v) for v in size.split("x"))
            fwd_share = ours.fwd_bytes / ours.fwd_ms / 1e6 / copy_gbs
            if n_el >= 64 * 2**20 and fwd_share < 0.8:
                gpu_share = ours.fwd_bytes / ours.fwd_graph_ms / 1e6 / copy_gbs
                missed.append(f"fwd {100 * fwd_share:.0f}% < 80% of copy (GPU time alone: "
                              f"{100 * gpu_share:.0f}%)")  # fmt: skip
        verdict = "met" if not missed else "MISSED: " + ", ".join(missed)
        graphed = f"{ours.graph_ms / liger.graph_ms:.2f}, {ours.graph_ms / comp.graph_ms:.2f}"
        default = ""
        if judged != "memplan":
            plain = impls["memplan"]
            default = (
                f"{paired_ratio(plain, liger):.2f} (graph "
                f"{plain.graph_ms / liger.graph_ms:.2f}), {paired_ratio(plain, comp):.3f}, "
                f"{plain.peak_mib:.0f} MiB vs {liger.peak_mib:.0f} MiB"
            )
        label = judged
        if against != "Liger":
            label += " (no Liger kernel: its columns are torch.compile's)"
        out.append(
            f"| {op} | {size} | {label} | {t_liger:.2f} | {min(per_round):.2f}-"
            f"{max(per_round):.2f} | {t_comp:.3f} | {mem:.2f} | {verdict} "
            f"| {ours.fwdbwd_ms / ours.graph_ms:.1f} | {graphed} | {default} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(SIZES), help="comma-separated subset")
    parser.add_argument("--tune", action="store_true", help="launch-parameter sweep only")
    parser.add_argument("--quick", action="store_true", help="first two sizes of each op")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved do_bench rounds")
    parser.add_argument("--no-pin", action="store_true", help="leave the process on all cores")
    parser.add_argument("--out", default="docs/bench_kernels.md")
    parser.add_argument("--profile", metavar="OP:SIZE", help="e.g. rope:4,4096,32,8,128")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("Error: this benchmark needs a CUDA GPU.", file=sys.stderr)
        return 1
    args.pinned = "not pinned" if args.no_pin else pin_to_one_core()
    with torch.cuda.stream(torch.cuda.Stream()):  # see graph_ms
        return run(args)


def run(args: argparse.Namespace) -> int:
    if args.profile:
        profile(args.profile)
        return 0
    ops = [o for o in args.ops.split(",") if o]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # one static compile per size, as a user compiling a fixed-shape training step gets
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):  # fmt: skip
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    copy_gbs = copy_bandwidth_gbs()
    import liger_kernel  # noqa: F401  (fail early when absent)
    import transformers

    props = torch.cuda.get_device_properties(0)
    header = [
        "# Elementwise kernels: memplan vs HF eager, torch.compile, Liger-Kernel",
        "",
        f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}, liger-kernel {_version('liger_kernel')}, python "
        f"{platform.python_version()}; bf16; median of triton.testing.do_bench over "
        f"{args.rounds} interleaved rounds, {args.pinned}; "
        f"{time.strftime('%Y-%m-%d')}. Generated by benchmarks/bench_kernels.py.",
        "",
        f"Device-to-device copy bandwidth measured in this run: {copy_gbs:.0f} GB/s (bytes read "
        "+ written). Bytes counted per op: see the script's docstring. Peak MiB = "
        "max_memory_allocated during one forward+backward (torch.autograd.grad) above the "
        "inputs. fwd rel err = ||out - HF eager|| / ||HF eager|| on the same bf16 inputs.",
        "",
    ]
    print("\n".join(header), flush=True)
    if args.tune:
        tune(ops, copy_gbs)
        return 0
    lines = list(header)
    all_rows: list[Row] = []
    for op in ops:
        op_rows = []
        for size in SIZES[op][: 2 if args.quick else None]:
            t0 = time.perf_counter()
            op_rows += run_op(op, size, args.rounds)
            print(f"[{op} {size}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
        section = [f"## {op}", "", *table(op_rows, copy_gbs), ""]
        print("\n".join(section), flush=True)
        lines += section
        all_rows += op_rows
        Path(args.out).write_text("\n".join(lines) + "\n")
    host = ["## Host cost per call", "",
            "forward+backward at 256 rows x 1024, where the GPU work is ~1 us: the time is the "
            "host's (Python, autograd, launches). Sizes whose GPU time is below this are "
            "host-bound for every implementation.", ""]  # fmt: skip
    _host_overhead(lambda label, ms, _: host.append(f"- {label}: {ms * 1e3:.0f} us"))
    print("\n".join(host), flush=True)
    lines += [*host, ""]
    summary = ["## Goals (ratios < 1 mean memplan is faster / smaller)", "",
               *goals(all_rows, copy_gbs), ""]  # fmt: skip
    print("\n".join(summary), flush=True)
    lines += [*summary, *NOTES]
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
