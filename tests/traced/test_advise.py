"""`memplan advise` on model types without a family entry: the traced estimate, the largest batch
from the affine stream, forcing a method, and bad input as one Error line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memplan import advisor
from memplan.errors import MemplanError, UsageError
from memplan.schema import Gpu, TrainSetup
from memplan.traced import trace_config
from memplan.traced.batch import AffineStream, largest_traced_batch
from tests.traced.tiny import tiny

GPU = Gpu(name="test", memory_bytes=2**30, capacity_bytes=2**30)


def write_config(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def memplan(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    prefix = [sys.executable, "-c", code] if code else [sys.executable, "-m", "memplan"]
    return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=300)


def test_unknown_model_type_is_traced_and_says_so(tmp_path) -> None:
    advice = advisor.advise(write_config(tmp_path, tiny("gpt2")), 2, 32, gpu=GPU)
    assert advice.estimate.method == "traced"
    assert "has no family entry" in advice.warnings[0]
    assert advice.plan.kernels == () and advice.fits
    # the largest batch: its own trace fits, the next one's does not
    largest = advice.max_batch
    assert largest and largest > 2

    def peak(batch: int) -> int:
        return trace_config(tiny("gpt2"), TrainSetup(batch=batch, seq=32), GPU).estimate.peak_bytes

    # the allocated bound: reserved memory is at least the allocated peak
    assert peak(largest) <= GPU.capacity < peak(largest + 1)
    assert advice.estimate.reserved.runs and advice.estimate.reserved.reserved_bytes <= GPU.capacity


def test_affine_stream_predicts_a_third_batch() -> None:
    """Sizes from batches 2 and 3 give the trace at batch 7 exactly (MoE routing included)."""
    config = tiny("olmoe")
    at = {b: trace_config(config, TrainSetup(batch=b, seq=16)) for b in (2, 3, 7)}
    stream = AffineStream.of(at[2], 2, at[3])
    assert stream is not None
    assert stream.peak(7) == at[7].estimate.peak_bytes
    assert stream.peak(2) == at[2].estimate.peak_bytes


def test_largest_batch_when_even_one_does_not_fit() -> None:
    setup = TrainSetup(batch=1, seq=16)
    traced = trace_config(tiny("gpt2"), setup)

    def trace(s):
        return trace_config(tiny("gpt2"), s)

    assert largest_traced_batch(trace, setup, traced, limit_bytes=2**20) == (0, None)


def test_method_forces_either_path(tmp_path) -> None:
    path = write_config(tmp_path, tiny("gpt2"))
    with pytest.raises(MemplanError, match="is not supported"):
        advisor.advise(path, 2, 32, gpu=GPU, method="analytic")
    registry = write_config(tmp_path, tiny("llama"))
    analytic = advisor.advise(registry, 2, 32, gpu=GPU, kernels="none")
    traced = advisor.advise(registry, 2, 32, gpu=GPU, kernels="none", method="traced")
    assert analytic.estimate.method == "analytic" and traced.estimate.method == "traced"
    assert "--method traced" in traced.warnings[0]
    # a registry family's tiny step (test_compare.py checks real sizes)
    assert abs(traced.peak_bytes - analytic.peak_bytes) < 0.01 * analytic.peak_bytes


def test_kernels_do_not_apply(tmp_path) -> None:
    with pytest.raises(UsageError, match="no memplan kernel applies to gpt2"):
        advisor.advise(write_config(tmp_path, tiny("gpt2")), 2, 32, gpu=GPU, kernels="rms_norm")


def test_lora_targets_default_to_peft_s_and_bad_ones_are_named(tmp_path) -> None:
    path = write_config(tmp_path, tiny("gpt2"))
    advice = advisor.advise(path, 2, 32, gpu=GPU, lora_rank=4)
    assert advice.setup.lora_targets == ("c_attn",)
    with pytest.raises(MemplanError, match="its linear layers: .*c_attn"):
        advisor.advise(path, 2, 32, gpu=GPU, lora_rank=4, lora_targets="q_proj")


# Each case starts a process that imports transformers (about 5 s): the unknown model_type by
# default, the other two under `-m slow`.
@pytest.mark.parametrize(
    "config,message",
    [
        ({"model_type": "not-a-model", "hidden_size": 8}, "is not known to the installed"),
        pytest.param(
            {"model_type": "not-a-model", "auto_map": {"AutoConfig": "x.Config"}},
            "runs only with --trust-remote-code",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {**tiny("gpt2"), "n_embd": 66},
            "transformers could not build gpt2 from this config",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, config: dict, message: str) -> None:
    run = memplan("advise", "--model", write_config(tmp_path, config), "--batch", "1", "--seq", "8")
    assert run.returncode == 1
    assert run.stderr.startswith("Error:") and len(run.stderr.splitlines()) == 1
    assert message in run.stderr


# a process that imports transformers (about 5 s); test_bad_input_is_one_error_line's default
# case checks the traced path's one Error line
@pytest.mark.slow
def test_code_that_reads_tensor_values_is_one_error_line(tmp_path) -> None:
    """A model whose forward branches on a tensor's value cannot run on meta tensors."""
    code = (
        "import sys, torch, transformers.models.gpt2.modeling_gpt2 as m\n"
        "forward = m.GPT2Block.forward\n"
        "def reads(self, hidden, *a, **k):\n"
        "    if hidden.sum() > 0: pass\n"
        "    return forward(self, hidden, *a, **k)\n"
        "m.GPT2Block.forward = reads\n"
        "from memplan.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    path = write_config(tmp_path, tiny("gpt2"))
    run = memplan("advise", "--model", path, "--batch", "1", "--seq", "8", code=code)
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
    assert "could not run on meta tensors" in run.stderr and "reads a value" in run.stderr


def test_without_transformers_the_traced_path_says_so(tmp_path) -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "from memplan.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    path = write_config(tmp_path, tiny("gpt2"))
    run = memplan("advise", "--model", path, "--batch", "1", "--seq", "8", code=code)
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
    assert "needs torch and transformers" in run.stderr
    # the analytic path does not need them
    run = memplan("advise", "--model", "llama-3.2-1b", "--batch", "1", "--seq", "8", code=code)
    assert run.returncode == 0, run.stderr


# a process that imports transformers; test_unknown_model_type_is_traced_and_says_so checks the
# same traced advice in this one
@pytest.mark.slow
def test_cli_prints_the_traced_plan(tmp_path) -> None:
    run = memplan(
        "advise",
        "--model",
        write_config(tmp_path, tiny("falcon")),
        "--batch",
        "2",
        "--seq",
        "32",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    advice = json.loads(run.stdout)
    assert advice["estimate"]["method"] == "traced" and advice["max_batch"] > 2
