"""The model of PyTorch's caching allocator (memplan.estimators.allocator): its rules on crafted
streams, and its replay of allocation traces recorded on an H100 (torch 2.11,
torch.cuda.memory._record_memory_history; benchmarks/record_allocator_traces.py)."""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from memplan.advisor import judge
from memplan.catalog import resolve_gpu
from memplan.errors import UsageError
from memplan.estimators import predict_reserved
from memplan.estimators.allocator import (
    AllocatorOutOfMemory,
    AllocatorSettings,
    CachingAllocator,
    parse_alloc_conf,
    replay,
    round_size,
    segment_size,
)
from memplan.estimators.events import Event
from memplan.estimators.timeline import step_sizes, walk_run
from memplan.schema import Measurement
from memplan.verify.predict import measured_gpu, ran_setup, spec_from_hf_config
from memplan.verify.report import load_reports

MIB = 2**20
TRACE_DIR = Path(__file__).parent / "data" / "allocator_traces"
TRACES = sorted(TRACE_DIR.glob("*.json.gz"))


def recorded_run(name: str) -> Measurement:
    """The recorded run of tests/data/allocator_traces/<name>.json.gz."""
    return Measurement.model_validate_json(gzip.open(TRACE_DIR / f"{name}.json.gz", "rt").read())


@cache
def measurements(path: Path) -> list[Measurement]:
    return load_reports([path]).measurements


def trace_events(measurement: Measurement) -> list[Event]:
    """The recorded allocations and completed frees as an event stream (addresses -> ids)."""
    ids: dict[int, int] = {}
    events = []
    for action, address, size in measurement.allocator_trace or ():
        if action == "alloc":
            ids[address] = len(ids) + len(events)
            events.append(Event("alloc", ids[address], size, "", "", ""))
        elif action == "free_completed":
            events.append(Event("free", ids.pop(address), size, "", "", ""))
    return events


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".json")[0] for p in TRACES])
def test_replay_reproduces_the_measured_reserved_and_allocated_peaks(path: Path) -> None:
    m = Measurement.model_validate_json(gzip.open(path, "rt").read())
    events = trace_events(m)
    settings = AllocatorSettings(expandable_segments=m.setup.expandable_segments)
    result = replay(events, settings)
    assert result.oom_index is None
    # Exact on all but two traces, where 4 and 21 MiB more are reserved: which of two cached
    # blocks of one size the GPU's addresses made the allocator take (the model hands out
    # segment addresses top-down, as the driver mostly does).
    assert result.peak_reserved == pytest.approx(m.reserved_bytes, rel=2.5e-3)
    assert result.peak_allocated == pytest.approx(m.peak_bytes, rel=2e-4)
    # With exactly the reserved peak as capacity the run completes; below the allocated peak
    # it cannot.
    exact = AllocatorSettings(
        capacity=m.reserved_bytes, expandable_segments=settings.expandable_segments
    )
    assert replay(events, exact).oom_index is None or result.peak_reserved > m.reserved_bytes
    short = AllocatorSettings(
        capacity=m.peak_bytes - MIB, expandable_segments=settings.expandable_segments
    )
    assert replay(events, short).oom_index is not None


# Recorded runs whose analytic stream missed the reserved peak by 6-26% where it got the
# build of a tied model, the tied gradients' sum, the checkpointed forward, the autograd
# thread's cuBLAS workspace or checkpointed autocast's weight copies wrong; and LoRA runs it
# missed by 7-10% without the adapters' forward temporaries and the frozen MLP's product
# (estimators/adapters.py), which leave the holes the autograd thread's workspace takes; a
# checkpointed LoRA run missed by 2.6% without its first forward's adapter temporaries; an fp32
# LoRA run missed by 7% without SDPA's math path's scores and bool mask (scores_programs.py).
ANALYTIC_TRACES = [
    "qwen3-0.6b_b2_s4096_bf16_gc_hf",
    "llama-3.2-1b_b8_s2048_bf16_gc_hf",
    "qwen2.5-1.5b_b2_s4096_bf16_gc_hf",
    "qwen3-0.6b_b4_s1024_bf16_sgd_hf",
    "llama-3.2-1b_b2_s2048_amp-bf16_gc_hf",
    "llama-3.2-1b_b2_s2048_amp-bf16_gc_rms-rope-swiglu-flce_chunk4096",
    "qwen3-0.6b_b2_s1024_bf16_gc_lora16-q_proj-v_proj_acc2_rms-rope-swiglu-flce_chunk2048",
    "llama-3.2-1b_b2_s1024_bf16_lora16-gate_proj-up_proj-down_proj_rms-rope-swiglu-flce_chunk2048",
    "llama-3.2-1b_b4_s1024_bf16_lora16-q_proj-k_proj-v_proj-o_proj_acc2_rms-rope-swiglu-flce_chunk4096",
    "gemma-2-2b_b2_s1024_bf16_lora16-q_proj-v_proj_rms-rope-geglu-flce_chunk2048",
    "llama-3.2-1b_b4_s2048_bf16_gc_lora16-q_proj-v_proj_hf",
    "qwen2.5-1.5b_b2_s1024_fp32_lora16-q_proj-v_proj_rms-rope-swiglu-flce_chunk2048",
]


@pytest.mark.parametrize("name", ANALYTIC_TRACES)
def test_the_analytic_stream_reserves_what_the_recorded_run_reserved(name: str) -> None:
    """The walk's own event stream (estimators/timeline.py), replayed through the allocator
    model, against max_memory_reserved() of the run recorded on an H100: within 2.5%."""
    m = recorded_run(name)
    spec = spec_from_hf_config(m.hf_config, m.model)
    gpu = measured_gpu(m, resolve_gpu("H100"))
    assert gpu is not None
    predicted = predict_reserved(spec, ran_setup(m), gpu)
    assert predicted.runs
    assert predicted.reserved_bytes == pytest.approx(m.reserved_bytes, rel=0.025)


def judged_measurement(path: Path, index: int, gpu_name: str) -> tuple[Measurement, Any]:
    """A measured case that ran and the walk's judged estimate of it on the GPU it ran on."""
    m = measurements(path)[index]
    assert m.status == "ok" and m.reserved_bytes
    gpu = measured_gpu(m, resolve_gpu(gpu_name))
    assert gpu is not None
    return m, judge(spec_from_hf_config(m.hf_config, m.model), ran_setup(m), gpu)


# Qwen3.5-0.8B at batch 4 x 2048 in bf16, measured on an H200 (plain, LoRA on q and v) and,
# with the plan's kernels (its gated RMSNorm included), on an H100. Without the final norm's
# fp32 product (a freed 32 MiB block) the autograd thread's cuBLAS workspace split a
# logits-sized segment, which the optimizer's states then kept, and the steady step reserved a
# fourth (+11.6% plain, +13.8% under LoRA). The H200 file's plan case ran before the gated
# RMSNorm was patched.
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
QWEN3_5_CASES = [
    ("results_families_h200.json", 0, "H200"),
    ("results_families_h200.json", 2, "H200"),
    ("results_families_gated_norm_h100.json", 0, "H100"),
]


@pytest.mark.parametrize("name,index,gpu_name", QWEN3_5_CASES)
def test_the_analytic_stream_reserves_what_qwen3_5_reserved(
    name: str, index: int, gpu_name: str
) -> None:
    """The walk's stream of Qwen3.5-0.8B's three measured cases (plain, the plan, LoRA q and v)
    against max_memory_reserved(): within 1%."""
    m, predicted = judged_measurement(BENCHMARKS / name, index, gpu_name)
    assert m.model == "qwen3.5-0.8b"
    assert predicted.reserved is not None
    assert predicted.reserved.reserved_bytes == pytest.approx(m.reserved_bytes, rel=0.01)


# Recorded allocator traces the walk's stream was fixed on, with the GPU each ran on; within
# 0.2% of max_memory_reserved():
# - checkpointed full fine-tunes: without the first forward's tensors (checkpoint's hooks keep
#   none, but the ops make the MLP's gate, act, up and product) the walk made their segments
#   only in backward and reserved 1.9% and 1.8% less;
# - Phi-3-mini cut to four layers with the plan's kernels: its one qkv_proj output (q, k and v
#   are views of it) lives until attention's output is made, and cuDNN's backward takes one
#   fp32 block of q's size where the KV heads are as many as the query heads; with three
#   separate q, k and v and two blocks the walk reserved 2.0% more.
FIXED_ON_TRACES = {
    "llama-3.2-1b_b8_s2048_bf16_gc_hf": "H100",
    "qwen2.5-1.5b_b2_s4096_bf16_gc_hf": "H100",
    "phi-3-mini-l4_b2_s1024_bf16_rms-rope-swiglu-flce_chunk2048": "H200",
}


@pytest.mark.parametrize("name", FIXED_ON_TRACES)
def test_the_analytic_stream_makes_the_segments_of_the_traces_it_was_fixed_on(name: str) -> None:
    m = recorded_run(name)
    gpu = measured_gpu(m, resolve_gpu(FIXED_ON_TRACES[name]))
    assert gpu is not None
    predicted = predict_reserved(spec_from_hf_config(m.hf_config, m.model), ran_setup(m), gpu)
    assert predicted.reserved_bytes == pytest.approx(m.reserved_bytes, rel=0.002)


# Measured runs the walk's stream was fixed on, (file, case, GPU, tolerance), with what it missed
# before each fix:
FIXED_ON_RUNS = [
    # Seed-OSS-36B cut to 4 layers, Hugging Face as it is: where the walk made a dense MLP's
    # three weight gradients at once before freeing what it saved (the traced step makes each
    # after its matmul), the embedding's gradient and AdamW's first states took other blocks
    # and step 2 reserved one bf16 logits segment less (-4.50%).
    (
        "benchmarks/results_families_h100.json",
        "seed-oss-36b-instruct-l4_b4_s2048_bf16_hf",
        "H100",
        0.01,
    ),
    # Eager attention, checkpointed: without the first forward's scores segments +6.30%.
    (
        "tests/data/measurements_h200.json",
        "llama-3.2-1b_b2_s2048_bf16_gc_eager_rms+rope+swiglu+flce_chunk4096",
        "H200",
        0.002,
    ),
    # Rank 0 of FSDP2 x4 under amp, checkpointed, the plan's kernels (a fake process group): the
    # first forward of memplan's GLU kernel makes gate, up and their product; without them
    # -9.53%.
    (
        "benchmarks/results_distributed_amp_checkpointed_h200.json",
        "qwen2.5-1.5b_b8_s2048_amp-bf16_gc_fsdp2x4_rms+rope+swiglu+flce+emb_budget1633MiB",
        "H200",
        0.01,
    ),
    # GLM-4.5-Air cut to two layers, the plan's kernels: its experts' backward starts with
    # three gradients of the routed rows in fp32 (1 GiB each here); as one block of their sum
    # the walk made a 3 GiB segment the GPU never did (+7.81%).
    (
        "benchmarks/results_families_h100.json",
        "glm-4.5-air-l2_b4_s2048_bf16_rms+rope+swiglu+flce+emb_budget2369MiB",
        "H100",
        0.01,
    ),
    # Llama 4 Scout cut to one layer, Hugging Face as it is: where the walk freed each expert
    # weight's gradient at the end of the MoE block's backward and made it again (the traced
    # step keeps it where its matmul makes it), AdamW's foreach temporaries took a logits
    # segment and step 2 reserved two more (+16.25%).
    (
        "benchmarks/results_families_h100.json",
        "llama-4-scout-17b-16e-l1_b4_s2048_bf16_hf",
        "H100",
        0.02,
    ),
]


@pytest.mark.parametrize(
    "name,case,gpu_name,tolerance", FIXED_ON_RUNS, ids=[row[1] for row in FIXED_ON_RUNS]
)
def test_the_analytic_stream_reserves_what_the_runs_it_was_fixed_on_reserved(
    name: str, case: str, gpu_name: str, tolerance: float
) -> None:
    path = Path(__file__).parents[1] / name
    index = next(i for i, m in enumerate(measurements(path)) if m.case == case)
    m, predicted = judged_measurement(path, index, gpu_name)
    assert predicted.reserved is not None
    assert predicted.reserved.reserved_bytes == pytest.approx(m.reserved_bytes, rel=tolerance)


# Six cases away from the edge, measured on an H100 after their predictions were committed
# (benchmarks/measure_families.py --setups held-out): none of the walk's per-op temporaries was
# found on them.
# And eight on an H200 (--setups held-out-2), after the walk's checkpointed first forward and
# the MoE and attention blocks of docs/fit_verdict.md (first predictions: within 0.006% and
# 3.72%).
HELD_OUT = [(BENCHMARKS / "results_held_out_h100.json", i, "H100") for i in range(6)]
HELD_OUT += [(BENCHMARKS / "results_families_held_out_2_h200.json", i, "H200") for i in range(8)]


@pytest.mark.parametrize("path,index,gpu_name", HELD_OUT)
def test_the_analytic_stream_holds_out_of_sample(path: Path, index: int, gpu_name: str) -> None:
    """The walk's allocated and reserved peaks of cases it was not written on: allocated within
    0.1%, reserved within the issue's 4% (first predictions: 0.00% and at most 2.04% on the
    H100's)."""
    m, predicted = judged_measurement(path, index, gpu_name)
    assert predicted.peak_bytes == pytest.approx(m.peak_bytes, rel=0.001)
    assert predicted.reserved is not None
    assert predicted.reserved.reserved_bytes == pytest.approx(m.reserved_bytes, rel=0.04)


# Recorded runs and blocks only CUDA kernels' scratch makes there (sizes no tensor of the step
# shares): reductions' semaphores (RMSNorm weight and bias gradients), the dense embedding
# backward's partial sums, memplan's embedding kernel's cub sort storage.
SCRATCH_TRACES = {
    "llama-3.2-1b_b4_s2048_bf16_hf": (64, 73818112),
    "gemma-2-2b-l6_b2_s2048_bf16_eager_hf": (72, 41518080),
    "gemma-3-1b_b2_s2048_amp-bf16_hf": (36, 20759040),
    "qwen2.5-1.5b_b4_s2048_bf16_hf": (48, 55363584),
    "qwen3-0.6b_b2_s4096_bf16_gc_hf": (32, 36909056),
    "mixtral-8x7b-l2_b2_s1024_bf16_hf": (128,),
    "llama-3.2-1b_b4_s2048_bf16_rms-rope-swiglu-flce-emb_budget1504MiB": (150015,),
    "llama-3.2-3b_b2_s4096_bf16_rms-rope-swiglu-flce_budget1754MiB": (110727168,),
}


@pytest.mark.parametrize("name", SCRATCH_TRACES)
def test_the_analytic_stream_allocates_the_recorded_kernels_scratch(name: str) -> None:
    """The walk's stream over the recorded run's steps allocates each of these scratch blocks as
    many times as the run did (estimators/kernel_scratch.py, shared with the traced step)."""
    m = recorded_run(name)
    spec = spec_from_hf_config(m.hf_config, m.model)
    setup = ran_setup(m)
    sizes = step_sizes(spec, setup, measured_gpu(m, resolve_gpu("H100")), "cuda")
    _, log = walk_run(spec, setup, sizes, steady_steps=m.steps - 1)
    for size in SCRATCH_TRACES[name]:
        recorded = sum(1 for row in m.allocator_trace if row[0] == "alloc" and row[2] == size)
        walked = sum(1 for e in log.events if e.action == "alloc" and e.nbytes == size)
        assert walked == recorded > 0, size


def test_rounding_and_segment_sizes() -> None:
    assert [round_size(n) for n in (1, 512, 513, 3 * MIB + 1)] == [512, 512, 1024, 3 * MIB + 512]
    assert segment_size(MIB) == 2 * MIB  # small pool
    assert segment_size(MIB + 512) == 20 * MIB  # shares a 20 MiB segment
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB + 1) == 12 * MIB  # its own, rounded to 2 MiB


def test_small_requests_share_two_mib_segments_and_large_ones_split_twenty() -> None:
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(MIB // 2)
    assert allocator.reserved == 2 * MIB
    allocator.malloc(3 * MIB)
    allocator.malloc(3 * MIB)  # the rest of the first 20 MiB segment
    assert allocator.reserved == 22 * MIB


def test_a_block_is_split_only_when_more_than_a_mib_would_remain() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(12 * MIB)
    allocator.free(block)
    whole = allocator.malloc(11 * MIB + MIB // 2)  # 0.5 MiB would remain: given whole
    assert whole.size == 12 * MIB and allocator.allocated == 12 * MIB
    allocator.free(whole)
    part = allocator.malloc(10 * MIB)  # 2 MiB remain: split
    assert part.size == 10 * MIB and allocator.reserved == 12 * MIB


def test_freed_neighbours_merge_and_best_fit_takes_the_smallest_block() -> None:
    allocator = CachingAllocator()
    a, b = allocator.malloc(30 * MIB), allocator.malloc(40 * MIB)
    a_address = a.ptr
    allocator.free(a)
    allocator.free(b)
    c = allocator.malloc(25 * MIB)
    assert c.ptr == a_address  # the 30 MiB block, not the 40 MiB one
    allocator.free(c)  # merges with the 5 MiB rest: 30 MiB again
    assert allocator.malloc(29 * MIB).ptr == a_address
    assert allocator.reserved == 70 * MIB


def test_a_block_freed_on_one_stream_serves_only_that_stream() -> None:
    """FSDP2's all-gather buffers come from a stream of their own: the default stream's
    requests reserve new segments beside them, and the cache release before out of memory
    frees any stream's wholly free segments."""
    allocator = CachingAllocator(AllocatorSettings(capacity=100 * MIB))
    gathered = allocator.malloc(30 * MIB, stream=1)
    allocator.free(gathered)
    on_default = allocator.malloc(30 * MIB)
    assert on_default.ptr != gathered.ptr and allocator.reserved == 60 * MIB
    assert allocator.malloc(30 * MIB, stream=1).ptr == gathered.ptr
    allocator.free(on_default)
    allocator.malloc(60 * MIB, stream=2)  # only fits once the default stream's cache goes
    assert allocator.reserved == 90 * MIB


def test_out_of_memory_releases_the_cache_first() -> None:
    allocator = CachingAllocator(AllocatorSettings(capacity=40 * MIB))
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(34 * MIB)  # does not fit beside the cached 30 MiB segment: it is released
    assert allocator.reserved == 34 * MIB


def test_fragmentation_runs_out_of_memory_where_expandable_segments_do_not() -> None:
    """Two 40 MiB blocks; the first freed and 16 MiB of it taken again: 56 MiB are allocated,
    yet 30 MiB more need a new segment that a 100 MiB capacity cannot hold beside the two, and
    no cached segment is wholly free to release. With expandable segments the allocator unmaps
    the free page inside the first block's range and maps two more at the end."""

    def run(expandable: bool) -> None:
        allocator = CachingAllocator(
            AllocatorSettings(capacity=100 * MIB, expandable_segments=expandable)
        )
        first = allocator.malloc(40 * MIB)
        allocator.malloc(40 * MIB)
        allocator.free(first)
        allocator.malloc(16 * MIB)
        allocator.malloc(30 * MIB)
        assert allocator.reserved <= 100 * MIB

    with pytest.raises(AllocatorOutOfMemory):
        run(expandable=False)
    run(expandable=True)


def test_expandable_segments_map_twenty_mib_pages() -> None:
    allocator = CachingAllocator(AllocatorSettings(expandable_segments=True))
    allocator.malloc(30 * MIB)
    assert allocator.reserved == 40 * MIB
    allocator.malloc(5 * MIB)  # inside the second page
    assert allocator.reserved == 40 * MIB


@pytest.mark.parametrize(
    "text,expandable",
    [("", False), ("expandable_segments:True", True), ("expandable_segments:False", False)],
)
def test_alloc_conf(text: str, expandable: bool) -> None:
    assert parse_alloc_conf(text) is expandable


@pytest.mark.parametrize("text", ["max_split_size_mb:128", "backend:cudaMallocAsync", "nonsense"])
def test_alloc_conf_that_is_not_modelled_is_refused(text: str) -> None:
    with pytest.raises(UsageError, match="not modelled"):
        parse_alloc_conf(text)
