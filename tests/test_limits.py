"""memplan.limits: every count and model size has a bound with a reason; past it one clear error
(Python names from the API, flags from the command line); advise on the largest accepted input
answers within seconds; the advisor's searches (bisection) give what a one-by-one search gave."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from memplan.advisor import (
    FLCE_CHUNK_CAP,
    advise,
    choose_flce_chunk,
    largest_batch,
    largest_running,
    lightest_flce,
    runs,
)
from memplan.catalog import resolve_gpu, resolve_model
from memplan.errors import MemplanError, UsageError
from memplan.estimators import kernel_contracts as kc
from memplan.limits import MAX_BATCH, MAX_GRAD_ACCUM, MAX_SEQ, MIN_FLCE_CHUNK, SPEC_BOUNDS
from memplan.schema import TrainSetup


def memplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"batch": 10**23}, "batch is the micro-batch (sequences per forward) and may be at most"),
        ({"seq": MAX_SEQ + 1}, "seq may be at most 16,777,216 tokens"),
        ({"grad_accum": MAX_GRAD_ACCUM + 1}, "grad_accum may be at most 1,048,576"),
        ({"flce_chunk": 1}, "flce_chunk must be at least 64 rows, got 1"),
        ({"lora_rank": 100_000}, "lora_rank 100,000 is more than v_proj's smaller side"),
        ({"batch": -3}, "batch must be a positive integer, got -3"),
    ],
)
def test_counts_past_their_bound_are_errors_in_python_names(options, message) -> None:
    args = {"batch": 1, "seq": 512, **options}
    with pytest.raises(UsageError) as caught:
        advise("llama-3.2-1b", args.pop("batch"), args.pop("seq"), **args)
    assert str(caught.value).startswith(message)
    assert "--" not in str(caught.value).split(",")[0]  # no flag in the Python API's message


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "100000000000000000000000"], "Error: --batch is the micro-batch"),
        (["--lora-rank", "100000"], "Error: --lora-rank 100,000 is more than v_proj's"),
        (["--flce-chunk", "1"], "Error: --flce-chunk must be at least 64 rows"),
        (["--grad-accum", str(MAX_GRAD_ACCUM + 1)], "Error: --grad-accum may be at most"),
    ],
)
def test_counts_past_their_bound_are_one_line_with_flags(args, message) -> None:
    base = {"--batch": "1", "--seq": "512"}
    options = dict(base, **dict(zip(args[::2], args[1::2], strict=True)))
    run = memplan("advise", "--model", "llama-3.2-1b", *itertools.chain(*options.items()))
    assert run.returncode == 2
    assert run.stderr.startswith(message) and run.stderr.count("\n") == 1
    assert run.stdout == ""


def test_the_lora_rank_bound_is_the_smaller_side_of_the_adapted_linears() -> None:
    # llama-3.2-1b: k_proj and v_proj are 2048 -> 512 (8 KV heads of 64)
    advise("llama-3.2-1b", 1, 64, lora_rank=512)
    advise("llama-3.2-1b", 1, 64, lora_rank=2048, lora_targets=["q_proj", "o_proj"])
    with pytest.raises(UsageError, match="at most 512"):
        advise("llama-3.2-1b", 1, 64, lora_rank=513)


def test_a_model_past_a_size_bound_is_one_line(tmp_path) -> None:
    """A config with 100,000 layers took 154 s to advise; it is now refused at once."""
    config = {"model_type": "llama", "num_hidden_layers": 100_000, "hidden_size": 64}
    config.update(intermediate_size=128, num_attention_heads=4, vocab_size=256)
    with pytest.raises(MemplanError, match=r"num_hidden_layers is 100,000; memplan takes at most"):
        advise(config, 1, 64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    started = time.perf_counter()
    run = memplan("advise", "--model", str(path), "--batch", "1", "--seq", "64")
    assert time.perf_counter() - started < 60
    assert run.returncode == 1
    assert run.stderr.startswith("Error: the model's num_hidden_layers is 100,000; memplan takes")
    assert "126 layers of Llama 3.1 405B" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.parametrize("field", sorted(SPEC_BOUNDS))
def test_every_size_bound_is_enforced(field) -> None:
    spec = resolve_model("qwen3-30b-a3b")
    too_big = spec.model_copy(update={field: SPEC_BOUNDS[field].most + 1})
    with pytest.raises(MemplanError, match=f"the model's {field} is"):
        advise(too_big, 1, 64)


def _largest_model() -> dict:
    """A config at every size bound (an MoE, so that the expert bounds count too)."""
    most = {field: bound.most for field, bound in SPEC_BOUNDS.items()}
    return {
        "model_type": "qwen3_moe",
        **{k: most[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
        **{k: most[k] for k in ("intermediate_size", "moe_intermediate_size", "num_experts")},
        "num_attention_heads": most["num_attention_heads"],
        "num_key_value_heads": most["num_key_value_heads"],
        "head_dim": most["head_dim"],
        "num_experts_per_tok": 8,
    }


def _deepest_narrow_model() -> dict:
    """The most layers, each tiny: on an 80 GB GPU the batch searches go deepest (measured the
    slowest input of those tried)."""
    layers = SPEC_BOUNDS["num_hidden_layers"].most
    return {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": 64}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, seq, gpu",
    [(_largest_model(), MAX_SEQ, "h100"), (_deepest_narrow_model(), 64, "h100")],
    ids=["largest", "deepest"],
)
def test_advise_on_the_largest_accepted_input_answers_within_minutes(model, seq, gpu) -> None:
    """The deepest accepted model (512 layers) at the largest batch: each allocator replay near
    its boundaries walks every layer (about 2 s each), and the searches make some 30."""
    model = {"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256, **model}
    started = time.perf_counter()
    advice = advise(model, MAX_BATCH, seq, gpu=gpu, grad_accum=MAX_GRAD_ACCUM)
    seconds = time.perf_counter() - started
    print(f"advise took {seconds:.1f} s")
    assert seconds < 180
    assert advice.peak_bytes > 0 and not advice.fits


def _chunk_one_by_one(spec, setup, gpu) -> int:
    """choose_flce_chunk as a plain scan: halving the chunk one power of two at a time."""
    tokens = setup.batch * setup.seq
    formula = kc.flce_default_chunk(tokens, spec.hidden_size, spec.vocab_size)
    top = max(formula, min(FLCE_CHUNK_CAP, 1 << max(0, (tokens - 1).bit_length())))

    def fits_with(chunk: int) -> bool:
        return runs(spec, setup.model_copy(update={"flce_chunk": chunk}), gpu)

    chunk = top
    while chunk > formula and not fits_with(chunk):
        chunk //= 2
    smallest = chunk
    while smallest > MIN_FLCE_CHUNK and not fits_with(smallest):
        smallest //= 2
    return smallest if fits_with(smallest) else chunk


def test_largest_running_is_the_last_that_runs_under_the_allocated_bound() -> None:
    """The allocated bound (cheap) caps the answer; replays (dear) find it below the bound."""
    for ceiling in (1, 2, 3, 7, 40):
        for bound in range(ceiling + 1):
            for last in range(bound + 1):
                calls: list[int] = []

                def replay(n: int, last: int = last, calls: list[int] = calls) -> bool:
                    calls.append(n)
                    return n <= last

                assert largest_running(lambda n, b=bound: n <= b, replay, ceiling) == last
                assert len(calls) <= 2 * max(1, bound).bit_length() + 4


@pytest.mark.parametrize(
    "model,gpu,seq", [("smollm2-135m", "t4", 4096), ("llama-3.2-1b", "l4", 2048)]
)
def test_the_searches_find_what_plain_scans_find(model, gpu, seq) -> None:
    """The FLCE chunk and the largest batch, found by bisection, against plain scans with the
    same replayed verdict."""
    spec, device = resolve_model(model), resolve_gpu(gpu)
    setup = TrainSetup(batch=4, seq=seq, kernels=("rms_norm", "flce"))
    assert choose_flce_chunk(spec, setup, device) == _chunk_one_by_one(spec, setup, device)
    setup = TrainSetup(batch=1, seq=seq, kernels=("flce",))
    best = largest_batch(spec, setup, device)
    assert best > 0
    for batch, expected in ((best, True), (best + 1, False)):
        trial = lightest_flce(spec, setup.model_copy(update={"batch": batch}))
        assert runs(spec, trial, device) is expected
