"""memplan.kernels.embedding: the lookup is torch's; the weight gradient against an fp32 index_add
reference, with runs of one id inside one chunk of sorted positions, across several and filling
the whole batch (chunks made small here so that the CPU interpreter's shapes cross them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memplan.kernels.embedding as module
from memplan.errors import UsageError
from memplan.kernels.embedding import embedding, reference_embedding_backward

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def id_batch(kind: str, device: str) -> torch.Tensor:
    torch.manual_seed(0)
    if kind == "random":
        return torch.randint(0, 40, (3, 37), device=device)
    if kind == "one id":
        return torch.full((3, 37), 5, device=device)
    # runs crossing chunk boundaries, a run exactly one chunk long, single ids between
    runs = [1] * 9 + [2] * 4 + [3] + [4] * 17 + [0] * 2 + [39] * 4
    return torch.tensor(runs, device=device)[torch.randperm(len(runs), device=device)][None]


@pytest.fixture(params=[4, 32])
def chunk(request, monkeypatch):
    monkeypatch.setattr(module, "CHUNK", request.param)
    return request.param


@pytest.mark.parametrize(
    "dtype, padding_idx",
    [
        (torch.float32, None),
        (torch.float32, 5),
        (torch.float32, -36),
        (torch.bfloat16, None),
        # the padding row in bf16 under `-m slow`
        pytest.param(torch.bfloat16, 5, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, -36, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("kind", ["random", "one id", "runs"])
def test_weight_gradient_matches_reference(device, chunk, dtype, kind, padding_idx):
    ids = id_batch(kind, device)
    weight = torch.randn(40, 77, device=device, dtype=dtype, requires_grad=True)
    out = embedding(ids, weight, padding_idx)
    assert torch.equal(out, F.embedding(ids, weight, padding_idx))
    grad = torch.randn_like(out)
    (weight_grad,) = torch.autograd.grad(out, weight, grad)
    positive = padding_idx % 40 if padding_idx is not None else None
    ref = reference_embedding_backward(ids, grad.float(), 40, positive)
    assert weight_grad.dtype == dtype
    assert rel(weight_grad, ref) <= TOL[dtype]
    if positive is not None:
        assert not weight_grad[positive].any()
    untouched = torch.ones(40, dtype=torch.bool, device=device)
    untouched[ids.flatten()] = False
    assert not weight_grad[untouched].any()


def test_gradient_is_deterministic_and_takes_int32_ids(device, chunk):
    ids = id_batch("runs", device).to(torch.int32)
    weight = torch.randn(40, 300, device=device, requires_grad=True)
    grad = torch.randn(*ids.shape, 300, device=device)
    first = torch.autograd.grad(embedding(ids, weight), weight, grad)[0]
    again = torch.autograd.grad(embedding(ids, weight), weight, grad)[0]
    assert torch.equal(first, again)
    assert rel(first, reference_embedding_backward(ids.long(), grad, 40, None)) <= 1e-6


def test_non_contiguous_output_gradient(device):
    ids = id_batch("random", device)
    weight = torch.randn(40, 64, device=device, requires_grad=True)
    out = embedding(ids, weight)
    grad = torch.randn(64, *ids.shape, device=device).movedim(0, -1)
    assert not grad.is_contiguous()
    (weight_grad,) = torch.autograd.grad(out, weight, grad)
    assert rel(weight_grad, reference_embedding_backward(ids, grad, 40, None)) <= 1e-6


def test_frozen_weight_and_meta_tensors_take_torchs_lookup(device):
    ids = id_batch("random", device)
    frozen = torch.randn(40, 8, device=device)
    assert embedding(ids, frozen).grad_fn is None
    meta = torch.empty(40, 8, device="meta", requires_grad=True)
    out = embedding(ids.to("meta"), meta)
    assert out.is_meta and out.shape == (*ids.shape, 8)


def test_bad_ids_raise_a_usage_error():
    with pytest.raises(UsageError, match="int32 or int64"):
        embedding(torch.zeros(3), torch.randn(4, 2, requires_grad=True))
