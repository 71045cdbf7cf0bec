"""The estimator's attention memory in fp32: which SDPA kernel CUDA picks (math path with
grouped KV heads, memory-efficient otherwise or under a mask), and so whether the (heads x seq)
probabilities and their backward are held."""

from __future__ import annotations

from memplan.catalog import resolve_model, spec_from_config
from memplan.estimators.contracts import DtypePlan, layer_saved
from memplan.estimators.timeline import layer_contexts, step_sizes
from memplan.schema import TrainSetup

TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1000,
}


def _scores_backward(spec, setup) -> bool:
    """Whether some layer's attention backward walks the materialized scores' program."""
    return any(step_sizes(spec, setup, None, "cuda").attention_bwd_steps)


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
    assert _scores_backward(grouped, setup)
    assert not _scores_backward(plain, setup)
    # bf16 and eager are unchanged.
    assert "attn.probs" in _attention_saved(plain, setup.model_copy(update={"attn": "eager"}))
    assert "attn.probs" not in _attention_saved(
        grouped, setup.model_copy(update={"precision": "bf16"})
    )


def test_fp32_backward_holds_no_scores_when_every_layer_is_masked() -> None:
    """mistral-7b-v0.1 slides every layer: from seq 4096 on, each gets a mask and the
    memory-efficient kernel, which saves no probabilities, and its backward none either."""
    spec = resolve_model("mistral-7b-v0.1")
    below = TrainSetup(batch=1, seq=4095, precision="fp32")
    at = TrainSetup(batch=1, seq=4096, precision="fp32")
    assert _scores_backward(spec, below)
    assert "attn.probs" not in _attention_saved(spec, at)
    assert not _scores_backward(spec, at)
    # gemma-2 keeps full-attention layers on the math path: their backward is still counted,
    # and only theirs
    gemma2 = resolve_model("gemma-2-2b")
    steps = step_sizes(gemma2, at, None, "cuda").attention_bwd_steps
    assert [bool(s) for s in steps] == [i % 2 == 1 for i in range(gemma2.num_hidden_layers)]
