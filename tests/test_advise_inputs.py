"""Defects found by the ninth review (advisor, estimator, catalog, CLI); each test failed before
its fix."""

from __future__ import annotations

import pytest

from memplan.advisor import advise
from memplan.catalog import resolve_model, spec_from_config
from memplan.errors import UsageError
from memplan.estimators.contracts import DtypePlan, layer_saved
from memplan.estimators.timeline import attention_scores_backward_bytes, layer_contexts
from memplan.schema import TrainSetup

TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1000,
}


def _attention_saved(spec, setup):
    ctx = layer_contexts(spec, setup, DtypePlan.of(setup.precision), "cuda")[-1]
    return layer_saved(ctx).per_token


def test_fp32_sdpa_without_grouped_heads_keeps_no_probabilities() -> None:
    """transformers passes enable_gqa only with grouped KV heads, and only then does CUDA SDPA
    in fp32 fall back to the math path (flash attention takes no fp32; the memory-efficient
    kernel takes fp32 but not enable_gqa). llama-2-7b fp32 b1 s4096 was predicted 185.4 GiB,
    of which 59.9 GiB were (heads x seq) probabilities and their backward that this kernel
    never materializes."""
    setup = TrainSetup(batch=1, seq=1024, precision="fp32")
    grouped = spec_from_config({**TINY, "num_key_value_heads": 2})
    plain = spec_from_config({**TINY, "num_key_value_heads": 4})
    assert "attn.probs" in _attention_saved(grouped, setup)
    saved = _attention_saved(plain, setup)
    assert "attn.probs" not in saved
    # q, k and v, and the memory-efficient kernel's logsumexp (padded to 32 positions).
    assert saved["attn.qkv"] == 3 * 4 * 256 and saved["attn.lse"] == 4 * 4
    dtypes = DtypePlan.of("fp32")
    assert attention_scores_backward_bytes(grouped, setup, dtypes, "cuda") > 0
    assert attention_scores_backward_bytes(plain, setup, dtypes, "cuda") == 0
    # bf16 and eager are unchanged.
    assert "attn.probs" in _attention_saved(plain, setup.model_copy(update={"attn": "eager"}))
    assert "attn.probs" not in _attention_saved(
        grouped, setup.model_copy(update={"precision": "bf16"})
    )


def test_fp32_backward_holds_no_scores_when_every_layer_is_masked() -> None:
    """mistral-7b-v0.1 slides every layer: from seq 4096 on, each gets a mask and the
    memory-efficient kernel, which saves no probabilities, and its backward none either."""
    spec = resolve_model("mistral-7b-v0.1")
    dtypes = DtypePlan.of("fp32")
    below = TrainSetup(batch=1, seq=4095, precision="fp32")
    at = TrainSetup(batch=1, seq=4096, precision="fp32")
    assert attention_scores_backward_bytes(spec, below, dtypes, "cuda") > 0
    assert "attn.probs" not in _attention_saved(spec, at)
    assert attention_scores_backward_bytes(spec, at, dtypes, "cuda") == 0
    # gemma-2 keeps full-attention layers on the math path: their backward is still counted.
    gemma2 = resolve_model("gemma-2-2b")
    assert attention_scores_backward_bytes(gemma2, at, dtypes, "cuda") > 0


@pytest.mark.parametrize("option", ["lora_rank", "flce_chunk"])
@pytest.mark.parametrize("value", [True, 2.0])
def test_counts_of_the_python_api_are_positive_integers_not_bools(option, value) -> None:
    """lora_rank=True planned a rank-1 LoRA and flce_chunk=True a 1-row chunk; 2.0 was taken
    as 2, where batch=2.0 is refused."""
    with pytest.raises(UsageError, match="positive integer"):
        advise("llama-3.2-1b", 2, 64, **{option: value})


def test_lora_targets_may_be_a_comma_separated_string() -> None:
    """A string was split into characters: "llama has no LoRA target q, _, p, r, o, j"."""
    advice = advise("llama-3.2-1b", 2, 64, lora_rank=8, lora_targets="q_proj, k_proj")
    assert advice.setup.lora_targets == ("q_proj", "k_proj")


def test_suggestions_that_drop_the_users_flce_chunk_say_so() -> None:
    """With --flce-chunk 32768 the first suggestion read 'kernels rms_norm, rope, swiglu, flce',
    the user's own kernels, while what made it fit was memplan's FLCE setting in place of the
    chunk: re-running with those kernels and the chunk still did not fit."""
    chunk = 32768
    advice = advise("llama-3.2-1b", 16, 4096, gpu="h100", flce_chunk=chunk)
    assert not advice.fits and advice.suggestions
    for suggestion in advice.suggestions:
        st = suggestion.setup
        kept = st.flce_chunk == chunk
        assert kept or f"memplan's FLCE setting instead of your chunk of {chunk} rows" in (
            suggestion.description
        )
        rerun = advise(
            "llama-3.2-1b",
            st.batch,
            st.seq,
            gpu="h100",
            grad_checkpointing=st.grad_checkpointing,
            lora_rank=st.lora_rank,
            lora_targets=st.lora_targets if st.lora_rank else None,
            grad_accum=st.grad_accum,
            kernels=list(st.kernels),
            flce_chunk=chunk if kept else None,
        )
        assert rerun.peak_bytes == suggestion.peak_bytes and rerun.fits and suggestion.fits


def _rendered(advice) -> str:
    import io

    from rich.console import Console

    from memplan.render import print_advice

    out = io.StringIO()
    print_advice(advice, Console(file=out, width=300))
    return out.getvalue()


@pytest.mark.parametrize("lora_rank", [None, 8])
def test_why_names_the_weights_when_they_alone_do_not_fit(lora_rank) -> None:
    """llama-3-70b on an L4: 131 GiB of bf16 weights. The Why line advised LoRA, with LoRA
    already on, and without it LoRA could not help either."""
    advice = advise("llama-3-70b", 1, 512, gpu="l4", lora_rank=lora_rank)
    weights = advice.estimate.breakdown["weights"]
    assert not advice.fits and weights > advice.gpu.capacity
    why = next(line for line in _rendered(advice).splitlines() if line.startswith("Why:"))
    assert "weights alone" in why and "LoRA" not in why and "FSDP" in why


def test_why_does_not_advise_lora_when_lora_is_on() -> None:
    """The optimizer step does not fit but the weights do: LoRA is suggested only without it."""
    for lora_rank, gpu_mem in ((None, "8GiB"), (8, "3.2GiB")):
        advice = advise("llama-3.2-1b", 1, 512, gpu_mem=gpu_mem, lora_rank=lora_rank)
        step = [p for p in advice.estimate.timeline if p.phase == "optimizer"][-1]
        limit = advice.gpu.capacity
        assert advice.estimate.breakdown["weights"] <= limit < step.allocated_bytes
        why = next(line for line in _rendered(advice).splitlines() if line.startswith("Why:"))
        assert "optimizer step alone" in why
        assert ("LoRA" in why) == (lora_rank is None)


def test_models_json_has_what_the_table_shows() -> None:
    """`memplan models --json` gave only the configs: no hub id, no parameter count."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "memplan", "models", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    listing = json.loads(run.stdout)
    entry = listing["llama-3.2-1b"]
    assert entry["hf_id"] == "meta-llama/Llama-3.2-1B"
    assert entry["params"] == 1_235_814_400
    assert entry["config"]["hidden_size"] == 2048


def test_a_name_replaced_by_a_catalog_entry_is_a_warning() -> None:
    """microsoft/Phi-3-mini-128k-instruct was silently predicted as the catalog's 4k model
    (another sliding window and max_position_embeddings), with nothing saying so."""
    advice = advise("microsoft/Phi-3-mini-128k-instruct", 1, 512)
    assert advice.model == "phi-3-mini"
    assert any("microsoft/Phi-3-mini-4k-instruct" in w for w in advice.warnings)
    for exact in ("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", " PHI-3-MINI "):
        assert not any("catalog" in w for w in advise(exact, 1, 512).warnings)


def test_small_trainable_counts_are_not_printed_as_zero() -> None:
    """smollm2-135m with LoRA r=8 on q and v trains 460,800 parameters, printed '0.000B'."""
    advice = advise("smollm2-135m", 1, 64, lora_rank=8)
    assert advice.estimate.trainable_params == 460_800
    setup_line = next(line for line in _rendered(advice).splitlines() if line.startswith("Setup:"))
    assert "(461K trainable)" in setup_line
