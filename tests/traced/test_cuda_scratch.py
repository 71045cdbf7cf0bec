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

from memplan.catalog import resolve_gpu, spec_from_config
from memplan.schema import Measurement
from memplan.traced.cuda_scratch import (
    cub_sort_pairs_bytes,
    embedding_backward_blocks,
    reduction_cast_blocks,
    sort_scratch_blocks,
)
from memplan.traced.verdict import traced_reserved

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
    assert reserved.reserved_bytes == (m.reserved_bytes if reserved.runs else peak)
