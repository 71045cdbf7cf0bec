"""The advisor's decisions follow from the estimator's predictions."""

from __future__ import annotations

import pytest

from memplan.advisor import (
    advise,
    choose_flce_chunk,
    largest_batch,
    parse_kernels,
    supported_kernels,
    usable_bytes,
)
from memplan.catalog import resolve_gpu, resolve_model
from memplan.errors import UsageError
from memplan.estimators import estimate
from memplan.estimators.kernel_contracts import flce_default_chunk
from memplan.schema import TrainSetup


def test_gemma_7b_b8_s4096_does_not_fit_an_h100_and_says_what_does() -> None:
    advice = advise("gemma-7b", 8, 4096)
    limit = usable_bytes(advice.gpu)
    assert not advice.fits
    assert advice.headroom_bytes == limit - advice.peak_bytes < 0
    assert advice.suggestions and advice.suggestions[0].peak_bytes <= limit
    for suggestion in advice.suggestions:
        assert estimate(resolve_model("gemma-7b"), suggestion.setup, advice.gpu).peak_bytes == (
            suggestion.peak_bytes
        )


def test_peak_bytes_is_the_requested_setup() -> None:
    advice = advise("llama-3.2-1b", 4, 1024, kernels="none")
    assert advice.setup.kernels == ()
    assert advice.peak_bytes == estimate(resolve_model("llama-3.2-1b"), advice.setup).peak_bytes


def test_auto_picks_the_lowest_peak_and_flce_over_cross_entropy() -> None:
    advice = advise("qwen2.5-1.5b", 4, 2048)
    assert advice.plan.kernels == ("rms_norm", "rope", "swiglu", "flce")
    best = min(advice.kernel_options, key=lambda o: o.peak_bytes)
    assert best.kernels == advice.plan.kernels
    # The chunk is then raised into the headroom (larger GEMMs), never past it.
    assert best.peak_bytes <= advice.peak_bytes <= usable_bytes(advice.gpu)


def test_kernel_parsing() -> None:
    gemma = resolve_model("gemma-2-2b")
    assert parse_kernels("auto", gemma) is None
    assert parse_kernels("none", gemma) == ()
    assert parse_kernels("all", gemma) == ("rms_norm", "rope", "geglu", "flce")
    # The original Gemma's "gelu" (exact GELU in transformers 5.17) gets geglu's exact variant.
    assert "geglu" in supported_kernels(resolve_model("gemma-7b"))
    assert parse_kernels("flce,rms_norm", gemma) == ("rms_norm", "flce")
    with pytest.raises(UsageError, match="unknown kernel"):
        parse_kernels("rmsnorm", gemma)
    with pytest.raises(UsageError, match="does not apply"):
        parse_kernels("swiglu", gemma)
    assert "swiglu" not in supported_kernels(resolve_model("mixtral-8x7b"))


def test_flce_chunk_grows_with_headroom_and_shrinks_only_to_fit() -> None:
    spec = resolve_model("llama-3.2-1b")
    setup = TrainSetup(batch=8, seq=2048, kernels=("rms_norm", "flce"))
    formula = flce_default_chunk(8 * 2048, spec.hidden_size, spec.vocab_size)
    roomy = choose_flce_chunk(spec, setup, resolve_gpu("h200"))
    assert roomy >= formula
    tight = choose_flce_chunk(spec, setup, resolve_gpu(memory="27GiB"))
    assert tight <= roomy


def test_largest_batch_is_the_boundary() -> None:
    spec, gpu = resolve_model("qwen2.5-0.5b"), resolve_gpu("l4")
    setup = TrainSetup(batch=1, seq=2048)
    best = largest_batch(spec, setup, gpu)
    assert best > 0
    assert estimate(spec, setup.model_copy(update={"batch": best}), gpu).peak_bytes <= (
        usable_bytes(gpu)
    )
    assert estimate(spec, setup.model_copy(update={"batch": best + 1}), gpu).peak_bytes > (
        usable_bytes(gpu)
    )


def test_long_sequence_is_a_warning() -> None:
    advice = advise("gemma-2b", 1, 16384)
    assert any("max_position_embeddings" in w for w in advice.warnings)


@pytest.mark.parametrize("batch,seq", [(0, 10), (1, -3)])
def test_bad_numbers(batch, seq) -> None:
    with pytest.raises(UsageError):
        advise("gemma-2b", batch, seq)
