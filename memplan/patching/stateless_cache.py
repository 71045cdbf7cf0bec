"""A key/value cache that stores nothing, for the training forward of a patched causal LM.

transformers (5.x) looks for packed sequences in the position ids whenever a forward gets no
attention mask and no cache: `find_packed_sequence_indices` ends in `bool(tensor.all())`, a host
synchronization at the start of every step, after which the GPU idles while the host launches the
first layer's small kernels (docs/patching.md). With a cache the check is skipped, but
transformers' own DynamicCache copies every layer's keys and values (torch.cat onto an empty
tensor).

This cache answers the mask's questions as an empty DynamicCache does (no tokens seen: key length
= query length, offset 0, the config's sliding layers, no previous linear-attention state) and
hands keys and values, conv inputs and recurrent states back untouched, keeping none. memplan
passes it only where the check cannot find anything: the caller gave no position ids
(transformers then numbers each row 0..n-1, one sequence per row), no attention mask and no
cache, and asked for none."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache


class StatelessCache(DynamicCache):
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    # A gated DeltaNet layer (Qwen3.5, Qwen3-Next) hands its conv input and its final recurrent
    # state to the cache; kept, they would stay alive through the loss.
    def update_conv_state(
        self, conv_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return conv_states

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return recurrent_states


def skips_packed_check(kwargs: dict[str, Any], base_model: Any) -> bool:
    """Whether the base model's forward with `kwargs` may take a StatelessCache: no position ids,
    attention mask or cache given, none asked for (use_cache), and no gradient checkpointing
    (whose layers drop a cache, with a warning)."""
    return (
        kwargs.get("position_ids") is None
        and kwargs.get("attention_mask") is None
        and kwargs.get("past_key_values") is None
        and kwargs.get("cache") is None
        and kwargs.get("cache_position") is None
        and not kwargs.get("use_cache")
        and not getattr(base_model, "gradient_checkpointing", False)
    )
