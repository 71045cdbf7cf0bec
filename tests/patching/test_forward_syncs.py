"""The host synchronizations a patched causal LM's training forward avoids.

- It hands its base model a StatelessCache where transformers' packed-sequence check cannot find
  anything (no position ids, attention mask or cache given): the check and its synchronization
  are skipped, and the loss and gradients stay those of unpatched HF. Where the caller gives
  position ids (packed rows), a mask, a cache or use_cache=True, transformers' own path runs.
- It copies FLCE's target flags to the host at its start (prefetch_targets), once per forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers.masking_utils as masking_utils

import memplan.kernels.fused_linear_cross_entropy as flce_module
import memplan.patching as mp
from memplan.patching.stateless_cache import StatelessCache
from tests.traced.tiny import tiny

from .tiny_models import FAMILIES, assert_grads_close, pair, rel_err


@pytest.fixture
def packed_checks(monkeypatch) -> list[int]:
    """One entry per call of transformers' packed-sequence check."""
    calls: list[int] = []
    check = masking_utils.find_packed_sequence_indices

    def counting(position_ids):
        calls.append(1)
        return check(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    return calls


def ids_and_labels(seed: int = 0, b: int = 2, t: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (b, t), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels}


def compare(reference, patched, inputs: dict, tol: float = 1e-5) -> None:
    out_ref, out_pat = reference(**inputs), patched(**inputs)
    out_ref.loss.backward()
    out_pat.loss.backward()
    assert rel_err(out_pat.loss, out_ref.loss) <= tol
    assert_grads_close(reference, patched, tol)


@pytest.fixture(
    params=["llama", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != "llama")]
)
def family(request) -> str:
    """The families here: what transformers does is the same for all of them; llama by
    default, the rest under `-m slow`."""
    return request.param


def test_no_mask_no_positions_skips_the_check_and_matches_hf(family, packed_checks) -> None:
    reference, patched = pair(family)
    mp.apply(patched)
    inputs = ids_and_labels()
    patched(**inputs).loss.backward()
    assert packed_checks == []
    patched.zero_grad(set_to_none=True)
    compare(reference, patched, inputs)


def test_packed_position_ids_take_transformers_path(packed_checks) -> None:
    """Two sequences packed in each row (positions restart at 5): HF masks across them, and so
    does the patched model. (HF looks for packing only without a cache: use_cache=False.)"""
    reference, patched = pair("llama")
    mp.apply(patched)
    inputs = ids_and_labels()
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    inputs.update(position_ids=positions.expand(2, -1), use_cache=False)
    patched(**inputs)
    assert len(packed_checks) == 1
    compare(reference, patched, inputs)
    unpacked = {**inputs, "position_ids": torch.arange(12).expand(2, -1)}
    assert rel_err(patched(**unpacked).loss, patched(**inputs).loss) > 1e-4  # the mask matters


def test_mask_or_cache_requests_keep_transformers_path(monkeypatch) -> None:
    seen: list[object] = []
    reference, patched = pair("llama")
    mp.apply(patched)
    base_forward = patched.model.forward

    def recording(*args, **kwargs):
        # transformers 5.2x names it cache
        seen.append(kwargs.get("past_key_values", kwargs.get("cache")))
        return base_forward(*args, **kwargs)

    monkeypatch.setattr(patched.model, "forward", recording)
    inputs = ids_and_labels()
    patched(**inputs)
    patched(**inputs, attention_mask=torch.ones(2, 12, dtype=torch.long))
    patched(**inputs, use_cache=True)
    assert isinstance(seen[0], StatelessCache)
    assert seen[1:] == [None, None]


def test_no_cache_is_returned() -> None:
    reference, patched = pair("llama")
    mp.apply(patched)
    inputs = ids_and_labels()
    assert patched(**inputs).past_key_values is None
    as_tuple = patched(**inputs, return_dict=False)
    assert as_tuple[1] is None and as_tuple[2] is None  # logits, then the cache's slot


def test_gradient_checkpointing_gets_no_cache(family) -> None:
    """Checkpointed layers drop a cache with a warning: none is passed to them."""
    reference, patched = pair(family)
    for model in (reference, patched):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    mp.apply(patched)
    inputs = ids_and_labels()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare(reference, patched, {**inputs, "use_cache": False})


def test_stateless_cache_hands_states_back() -> None:
    cache = StatelessCache()
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out_k, out_v = cache.update(k, v, 0)
    assert out_k is k and out_v is v
    assert cache.get_seq_length() == 0


def test_stateless_cache_keeps_no_deltanet_state() -> None:
    """A gated DeltaNet layer's conv input and final state come back as they went in, and the
    cache holds neither (kept, they would be alive through the loss)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**tiny("qwen3_5_text"))
    cache = StatelessCache(config=config)
    layer = config.layer_types.index("linear_attention")
    conv, state = torch.randn(2, 96, 16), torch.randn(2, 4, 16, 16)
    assert cache.update_conv_state(conv, layer, conv_kernel_size=4) is conv
    assert cache.update_recurrent_state(state, layer) is state
    assert not cache.has_previous_state(layer)
    held = [t for t in vars(cache.layers[layer]).values() if isinstance(t, torch.Tensor)]
    held += [
        t
        for v in vars(cache.layers[layer]).values()
        if isinstance(v, (list, dict))
        for t in (v.values() if isinstance(v, dict) else v)
        if isinstance(t, torch.Tensor)
    ]
    assert not held


def test_flce_targets_are_copied_once_at_the_start(monkeypatch) -> None:
    made: list[int] = []
    to_host = flce_module._targets_to_host

    def counting(target, ignore_index, vocab):
        made.append(target.numel())
        return to_host(target, ignore_index, vocab)

    monkeypatch.setattr(flce_module, "_targets_to_host", counting)
    model = pair("llama")[1]
    mp.apply(model)
    model(**ids_and_labels()).loss.backward()
    assert made == [24]
