"""prefetch_targets: FLCE reads its per-chunk target flags and the range check from a copy issued
ahead of the call and passed to it, only while the copy still describes the target it is called
with."""

import pytest
import torch

import memplan.kernels.fused_linear_cross_entropy as flce_module
from memplan.errors import UsageError
from memplan.kernels.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    prefetch_targets,
)

ROWS, HIDDEN, VOCAB, CHUNK = 24, 16, 40, 8


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """One entry per copy of a target's flags to the host."""
    made: list[int] = []
    to_host = flce_module._targets_to_host

    def counting(target, ignore_index, vocab):
        made.append(ignore_index)
        return to_host(target, ignore_index, vocab)

    monkeypatch.setattr(flce_module, "_targets_to_host", counting)
    return made


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).to(device).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=g).to(device).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS,), generator=g).to(device)
    target[CHUNK : 2 * CHUNK] = -100  # a chunk without targets: its GEMMs are skipped
    return hidden, weight, target


def loss_and_grads(hidden, weight, target, **options):
    hidden.grad = weight.grad = None
    loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=CHUNK, **options)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def test_a_prefetched_copy_is_used_and_gives_the_same_result(copies, device) -> None:
    hidden, weight, target = inputs(device)
    expected = loss_and_grads(hidden, weight, target.clone())
    assert len(copies) == 1  # made at the call
    prefetched = prefetch_targets(target, -100, VOCAB)
    got = loss_and_grads(hidden, weight, target, prefetched=prefetched)
    assert len(copies) == 2  # the prefetch only
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_stale_copy_is_not_used(copies, device) -> None:
    hidden, weight, target = inputs(device)
    prefetched = prefetch_targets(target, -100, VOCAB)
    target[:CHUNK] = -100  # in place: the copy no longer describes it
    expected = loss_and_grads(hidden, weight, target.clone())
    got = loss_and_grads(hidden, weight, target, prefetched=prefetched)
    assert len(copies) == 3
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert got[1][:CHUNK].abs().max() == 0
    # for another ignore_index: copied again at the call
    prefetched = prefetch_targets(target, -1, VOCAB)
    loss_and_grads(hidden, weight, target, prefetched=prefetched)
    assert copies[-2:] == [-1, -100]


def test_the_range_check_holds_with_a_prefetched_copy(device) -> None:
    hidden, weight, target = inputs(device)
    target[0] = VOCAB
    prefetched = prefetch_targets(target, -100, VOCAB)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        fused_linear_cross_entropy(hidden, weight, target, chunk_size=CHUNK, prefetched=prefetched)


def test_a_copy_of_another_tensor_is_not_used(copies, device) -> None:
    """The copy belongs to the tensor it was made from: an equal tensor is copied again."""
    hidden, weight, target = inputs(device)
    prefetched = prefetch_targets(target.clone(), -100, VOCAB)
    loss_and_grads(hidden, weight, target, prefetched=prefetched)
    assert len(copies) == 2
