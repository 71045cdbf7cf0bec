"""The real child process on a GPU (run on the device machine: pytest -m gpu tests/verify).
Small cases: a 2-layer cut of qwen3-0.6b (the real vocabulary, so the loss dominates the
peak), a few seconds each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.schema import GIB
from memplan.verify.cases import plan_cases
from memplan.verify.runner import run_case

pytestmark = pytest.mark.gpu


def _case(**options):
    (item,) = plan_cases("qwen3-0.6b", layers=2, **{"batch": 4, "seq": 1024, **options})
    return item


def test_protocol_figures_and_timeline():
    item = _case(kernels="none", timeline=True)
    m = run_case(item.case, spec=item.spec, timeout_s=300)
    assert m.status == "ok", m.error
    # weights alone after the build: bf16, 2 bytes per parameter (+ the allocator's rounding)
    assert m.after_model_bytes == pytest.approx(2 * m.n_params, rel=0.01)
    assert m.after_model_bytes <= m.peak_step1_bytes <= m.peak_bytes <= m.reserved_bytes
    # AdamW's two states appear after step 1: the steady peak is higher by about 4 bytes/param
    assert m.peak_bytes - m.peak_step1_bytes >= 0.9 * 4 * m.n_trainable
    assert m.tokens_per_s > 0 and 5 < m.loss < 20
    # the recorded extra step peaks where the measured steady steps did
    events = m.timeline_measured
    assert events, "no timeline recorded"
    phases = list(dict.fromkeys(e.phase for e in events))
    assert phases[:4] == ["forward", "backward", "optimizer", "zero_grad"]
    top = max(e.allocated_bytes for e in events)
    assert top == pytest.approx(m.peak_bytes, rel=0.03)
    assert m.predicted is not None and m.predicted.timeline
    # the prediction is for the GPU measured: its compute capability and memory are recorded
    major, minor = (int(v) for v in m.env["compute_capability"].split("."))
    assert major >= 7 and int(m.env["gpu_total_bytes"]) > 10 * GIB
    assert "warnings" not in m.env


def test_timeline_of_many_micro_batches():
    # 5 micro-batches: 13 phase markers
    item = _case(batch=1, seq=256, grad_accum=5, kernels="none", timeline=True)
    m = run_case(item.case, spec=item.spec, timeout_s=300)
    assert m.status == "ok", m.error
    assert "warnings" not in m.env, m.env["warnings"]
    phases = list(dict.fromkeys(e.phase for e in m.timeline_measured))
    assert phases[:2] == ["forward 1", "backward 1"] and "backward 5" in phases


def test_patched_case_applies_the_kernels():
    item = _case(kernels="auto")
    m = run_case(item.case, spec=item.spec, timeout_s=300)
    assert m.status == "ok", m.error
    assert m.applied["kernels"] == list(item.case.setup.kernels)
    assert "flce" in m.applied["kernels"]


def test_out_of_memory_is_reported():
    # logits alone: 64 x 8192 x 151936 x 2 bytes = 148 GiB, more than any single GPU here
    item = _case(batch=64, seq=8192, kernels="none")
    m = run_case(item.case, spec=item.spec, timeout_s=300)
    assert m.status == "oom", m.error
    assert 0 < m.oom_above_bytes < 150 * GIB
    assert m.error.startswith("out of memory in step 1 above ")


def test_profile_finds_the_loss_and_norm_ops():
    item = _case(kernels="auto")
    m = run_case(item.case, spec=item.spec, profile=True, timeout_s=300)
    assert m.status == "ok", m.error
    assert m.profile_error is None
    without, with_patch = m.profile["without_patch"], m.profile["with_patch"]
    assert without.ops and without.kernels and with_patch.ops
    names = " ".join(op.name for op in without.ops)
    assert "aten::" in names


def _track_own_loop() -> dict:
    """memplan.track around a plain loop (model built and patched here, not by verify): 3 AdamW
    steps of a 2-layer qwen3-0.6b with the advised kernels, against the advice's prediction."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import memplan

    item = _case(kernels="auto")
    advice = memplan.advise(item.spec, batch=4, seq=1024, gpu="h200")
    config = dict(item.case.hf_config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.train()
    memplan.apply(model, advice.plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (4, 1024), device="cuda")
    with memplan.track(advice, quiet=True) as tracked:
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "measured": tracked.measured_peak_bytes,
        "error_pct": tracked.error_pct,
        "summary": tracked.summary(),
    }


def test_track_measures_the_users_own_loop():
    """_track_own_loop in a fresh process, as the protocol measures: tensors that earlier tests
    left alive in this one (compiled graphs' caches, ...) would count in its peak."""
    code = (
        "import json, runpy; "
        f"loop = runpy.run_path({str(Path(__file__))!r})['_track_own_loop']; "
        "print(json.dumps(loop()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["measured"] is not None
    assert abs(result["error_pct"]) <= 4.0, result["summary"]
