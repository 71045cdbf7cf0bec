"""What CUDA ops allocate beside their outputs (memplan/traced/cuda_scratch.py), against the
blocks recorded on H100s and H200s (tests/data/allocator_traces, allocator_traces_edge: runs at
the edge of memory, two of them out of memory), and the out-of-memory verdict those blocks
decide."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest
import torch

import memplan.traced.cuda_scratch as cuda_scratch
from memplan.catalog import resolve_gpu, spec_from_config
from memplan.schema import Measurement
from memplan.traced.cuda_reduce import CudaDevice, reduction_staging_blocks
from memplan.traced.cuda_scratch import (
    cub_sort_pairs_bytes,
    embedding_backward_blocks,
    reduction_cast_blocks,
    sort_scratch_blocks,
)
from memplan.traced.estimate import event_log
from memplan.traced.model import hf_config
from memplan.traced.step import trace_steps
from memplan.traced.tracker import Recorder, allocate_scratch
from memplan.traced.verdict import traced_reserved
from memplan.versions import installed_versions

DATA = Path(__file__).parents[1] / "data"
EDGE = sorted((DATA / "allocator_traces_edge").glob("*.json.gz"))
KERNELS_TRACE = "llama-3.2-1b_b4_s2048_bf16_rms-rope-swiglu-flce-emb_budget1504MiB"


def recorded(path: Path) -> Measurement:
    return Measurement.model_validate_json(gzip.open(path, "rt").read())


def allocated_sizes(m: Measurement) -> Counter:
    return Counter(size for action, _, size in m.allocator_trace if action == "alloc")


@pytest.mark.parametrize(
    "path",
    [DATA / "allocator_traces" / f"{KERNELS_TRACE}.json.gz", *EDGE],
    ids=lambda p: p.name.split("_s")[0],
)
def test_the_embedding_kernel_s_sort_allocates_cub_s_storage_once_a_step(path: Path) -> None:
    """memplan's embedding backward sorts the step's ids (int64): cub's storage is one block of
    exactly cub_sort_pairs_bytes, once per step, at 8192 to 129,024 ids."""
    m = recorded(path)
    ids = m.setup.batch * m.setup.seq
    keys = torch.empty(ids, dtype=torch.int64, device="meta")
    iota, storage = sort_scratch_blocks(keys, -1)
    assert iota == ids * 8 and storage == cub_sort_pairs_bytes(ids)
    # the out-of-memory runs failed in their last step's backward, before the embedding's
    steps = m.steps if m.status == "ok" else m.steps - 1
    assert allocated_sizes(m)[storage] == steps


def test_small_and_other_sorts_have_no_modelled_scratch() -> None:
    assert sort_scratch_blocks(torch.empty(4096, dtype=torch.int64, device="meta"), -1) == []
    assert sort_scratch_blocks(torch.empty(8192, dtype=torch.int32, device="meta"), -1) == []
    assert sort_scratch_blocks(torch.empty(4, 8192, dtype=torch.int64, device="meta"), -1) == []


@pytest.mark.parametrize("name", ["llama-3.2-1b_b4_s2048_bf16_hf", "qwen2.5-1.5b_b4_s2048_bf16_hf"])
def test_the_dense_embedding_backward_holds_its_partial_sums(name: str) -> None:
    """Hugging Face's embedding backward on CUDA: partial sums of n / 10 + n segments of the
    hidden size in fp32, and their offsets, once per step."""
    m = recorded(DATA / "allocator_traces" / f"{name}.json.gz")
    ids = torch.empty(m.setup.batch * m.setup.seq, dtype=torch.int64, device="meta")
    grad = torch.empty(ids.numel(), m.hf_config["hidden_size"], dtype=torch.bfloat16, device="meta")
    blocks = embedding_backward_blocks(grad, ids, m.hf_config["vocab_size"])
    sizes = allocated_sizes(m)
    assert sizes[blocks[-1]] == m.steps and sizes[blocks[-2]] == m.steps
    few = torch.empty(3072, dtype=torch.int64, device="meta")
    assert embedding_backward_blocks(grad[:3072], few, 128) == []  # summed directly


def test_a_reduction_casts_its_input_where_its_output_dtype_differs() -> None:
    flags = torch.empty(81920, dtype=torch.bool, device="meta")
    assert reduction_cast_blocks(flags, torch.int64) == [81920 * 8]
    halves = torch.empty(1024, dtype=torch.bfloat16, device="meta")
    assert reduction_cast_blocks(halves, torch.float32) == []  # read as they are
    assert reduction_cast_blocks(halves, torch.bfloat16) == []


@pytest.mark.parametrize("path", EDGE, ids=lambda p: p.name.split("_s2048")[0])
def test_the_traced_step_decides_the_edge_as_the_gpu_did(path: Path) -> None:
    """Runs within 1.1 GB of the capacity: qwen3-0.6b with fused AdamW and the plan ran out of
    memory in step 3 on an H100 (batch 35) and an H200 (batch 63), asking for cuDNN's
    attention-backward workspace; llama-3.2-1b under amp at batch 40 ran on an H200 with
    0.34 GB to spare, after releasing its cache (autocast's weight copies made before the
    inputs' decide which blocks fit). The traced step gives each verdict at the recorded
    reserved bytes."""
    m = recorded(path)
    gpu = resolve_gpu("h200" if m.env["gpu"].endswith("H200") else "h100")
    spec = spec_from_config(dict(m.hf_config, model_type=m.model_type), m.model)
    reserved = traced_reserved(spec, m.setup, gpu)
    assert reserved.runs == (m.status == "ok")
    held = peak = 0
    for action, _, size in m.allocator_trace:
        held += {"segment_alloc": size, "segment_free": -size}.get(action, 0)
        peak = max(peak, held)
    recorded_reserved = m.reserved_bytes if reserved.runs else peak
    if installed_versions()["transformers"] == m.env["transformers"]:
        assert reserved.reserved_bytes == recorded_reserved
    else:  # another release's model code allocates a little differently
        assert reserved.reserved_bytes == pytest.approx(recorded_reserved, rel=2e-3)


def kernel_pairs(m: Measurement) -> Counter:
    """(first, second) sizes of each recorded pair of blocks allocated one after the other and
    freed at once in reverse: a kernel's scratch, like a reduction's buffer and semaphores."""
    rows = [(a, address, size) for a, address, size in m.allocator_trace if a != "segment_alloc"]
    return pairs_of([(a == "alloc", address, size) for a, address, size in rows])


def pairs_of(events: list[tuple[bool, int, int]]) -> Counter:
    """(allocation?, block, size) events: the sizes of each alloc, alloc, free, free of two
    blocks, the second freed first."""
    pairs: Counter = Counter()
    for a, b, c, d in zip(events, events[1:], events[2:], events[3:], strict=False):
        if a[0] and b[0] and not c[0] and not d[0] and c[1] == b[1] and d[1] == a[1]:
            pairs[(a[2], b[2])] += 1
    return pairs


def staging(shape: tuple[int, ...], dims: list[int], dtype: torch.dtype = torch.bfloat16) -> list:
    x = torch.empty(shape, dtype=dtype, device="meta")
    return reduction_staging_blocks("sum", x, x.sum(dims), dims, CudaDevice())


def test_a_norm_weight_gradient_s_sum_over_the_tokens_stages_in_global_memory() -> None:
    """Hugging Face's RMSNorm weight gradient sums (grad * normed) over all tokens: CUDA splits
    each hidden unit's tokens across CTAs, with a staging buffer then semaphores, twice a layer
    and once for the final norm each step."""
    m = recorded(DATA / "allocator_traces" / "llama-3.2-1b_b4_s2048_bf16_hf.json.gz")
    c, s = m.hf_config, m.setup
    blocks = staging((s.batch, s.seq, c["hidden_size"]), [0, 1])
    assert kernel_pairs(m)[tuple(blocks)] == m.steps * (2 * c["num_hidden_layers"] + 1)


def test_qwen3_s_head_norms_and_qwen2_s_biases_stage_their_sums() -> None:
    """The per-head norms (tokens * heads rows of head_dim) and the k and v biases' gradients
    (tokens rows of kv_heads * head_dim), once a layer each step."""
    m = recorded(DATA / "allocator_traces" / "qwen3-0.6b_b4_s1024_bf16_sgd_hf.json.gz")
    c, s = m.hf_config, m.setup
    pairs = kernel_pairs(m)
    for heads in (c["num_attention_heads"], c["num_key_value_heads"]):
        blocks = staging((s.batch, s.seq, heads, c["head_dim"]), [0, 1, 2])
        assert pairs[tuple(blocks)] == m.steps * c["num_hidden_layers"]
    m = recorded(DATA / "allocator_traces" / "qwen2.5-1.5b_b4_s2048_bf16_hf.json.gz")
    c, s = m.hf_config, m.setup
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    blocks = staging((s.batch * s.seq, kv), [0])
    assert kernel_pairs(m)[tuple(blocks)] == m.steps * c["num_hidden_layers"] * 2  # k and v


STAGED_TRACES = [
    "gemma-2-2b-l6_b2_s2048_bf16_eager_hf",
    "gemma-3-1b_b2_s2048_amp-bf16_hf",
    "llama-3.2-1b_b4_s2048_bf16_hf",
    "mixtral-8x7b-l2_b2_s1024_bf16_hf",
    "qwen2.5-0.5b_b4_s2048_amp-bf16_hf",
    "qwen2.5-1.5b_b4_s2048_bf16_hf",
    "qwen3-0.6b_b2_s1024_fp32_hf",
    "qwen3-0.6b_b4_s1024_bf16_sgd_hf",
]


@pytest.mark.parametrize("name", STAGED_TRACES)
def test_the_traced_step_stages_the_recorded_reductions(name: str, monkeypatch) -> None:
    """Every staging buffer and semaphores pair the traced step allocates is recorded as often
    on the H100, and every recorded pair of a block over 1 MiB and at most 4 KiB of semaphores
    is one the traced step stages (bf16, amp, fp32; norms, biases, head norms)."""
    m = recorded(DATA / "allocator_traces" / f"{name}.json.gz")
    staged: Counter = Counter()

    def spy(*args, **kwargs) -> list:
        blocks = reduction_staging_blocks(*args, **kwargs)
        staged.update([tuple(blocks)] if blocks else [])
        return blocks

    monkeypatch.setattr(cuda_scratch, "reduction_staging_blocks", spy)
    fields = dict(m.hf_config, model_type=m.model_type)
    config = hf_config(fields, name=m.model, trust_remote_code=False)
    run = trace_steps(config, m.setup, resolve_gpu("h100"), steps=m.steps)
    traced = pairs_of([(e.action == "alloc", e.tensor, e.nbytes) for e in event_log(run).events])
    pairs = kernel_pairs(m)
    assert staged and {p: traced[p] for p in staged} == {p: pairs[p] for p in staged}
    assert {p: pairs[p] for p in staged} == dict(staged)
    large = {p: n for p, n in pairs.items() if p[0] > 2**20 and p[1] <= 4096}
    assert large == {p: n for p, n in traced.items() if p[0] > 2**20 and p[1] <= 4096}


def test_one_cta_per_output_needs_no_staging() -> None:
    """RMSNorm's mean over each row (the fastest dimension, many outputs) and a sum over a few
    values per output reduce within a block."""
    assert staging((8192, 2048), [1], torch.float32) == []
    assert staging((2, 8192, 1024), [0]) == []


def test_the_split_follows_the_gpu_s_sms_and_32bit_indexing() -> None:
    """Fewer SMs, fewer CTAs per output where the grid binds (H100 PCIe: 114 SMs); an input
    past 2**31 bytes is reduced in 32-bit halves, each with its own staging, freed before the
    next (bf16 outputs accumulate in an fp32 buffer held across them): equal halves stage equal
    blocks, listed once, so that even 2**32 rows list a few."""
    x = torch.empty(65536, 2048, dtype=torch.bfloat16, device="meta")  # 16 blocks of outputs
    h100 = reduction_staging_blocks("sum", x, x.sum(0), [0], CudaDevice(132, 2048))
    pcie = reduction_staging_blocks("sum", x, x.sum(0), [0], CudaDevice(114, 2048))
    assert h100 == [4 * 2048 * 132 * 128, 64] and pcie == [4 * 2048 * 114 * 128, 64]
    big = torch.empty(2**20, 1280, dtype=torch.bfloat16, device="meta")
    blocks = reduction_staging_blocks("sum", big, big.sum(0), [0], CudaDevice())
    assert blocks[0] == 1280 * 4 and len(blocks) == 2
    recorder = Recorder()
    allocate_scratch(recorder, blocks)
    order = [(r.action, r.nbytes) for r in recorder.records]
    buffer, semaphores = blocks[1]
    sub = [("alloc", buffer), ("alloc", semaphores), ("free", semaphores), ("free", buffer)]
    assert order == [("alloc", 1280 * 4), *sub, ("free", 1280 * 4)]
    huge = torch.empty(2**32, 3072, dtype=torch.bfloat16, device="meta")
    assert len(reduction_staging_blocks("sum", huge, huge.sum(0), [0], CudaDevice())) <= 4
