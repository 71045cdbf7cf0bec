"""memplan.kernels.embedding on a GPU at the training cases' sizes (8 x 2048 ids into a 128256-row
table) and with offsets past 2**31 elements, against an fp32 index_add reference."""

from __future__ import annotations

import pytest
import torch

from memplan.kernels.embedding import embedding, reference_embedding_backward

pytestmark = pytest.mark.gpu

VOCAB = 128256


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("width", [2048, 4096])
@pytest.mark.parametrize("kind", ["random", "one id", "half padding"])
def test_weight_gradient_at_training_sizes(dtype, tol, width, kind):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 2048), device="cuda")
    padding_idx = None
    if kind == "one id":
        ids.fill_(7)
    elif kind == "half padding":
        ids[:, 1024:] = 128001
        padding_idx = 128001
    weight = torch.randn(VOCAB, width, device="cuda", dtype=dtype, requires_grad=True)
    out = embedding(ids, weight, padding_idx)
    grad = torch.randn_like(out)
    (weight_grad,) = torch.autograd.grad(out, weight, grad)
    ref = reference_embedding_backward(ids, grad, VOCAB, padding_idx)
    assert rel(weight_grad, ref) <= tol
    again = torch.autograd.grad(embedding(ids, weight, padding_idx), weight, grad)[0]
    assert torch.equal(weight_grad, again)


def test_weight_gradient_past_int32_offsets():
    """A gradient of more than 2**31 elements; the last rows' ids are checked."""
    width = 4096
    n_tokens = (2**31 + 2**20) // width
    ids = torch.randint(0, 1000, (n_tokens,), device="cuda")
    ids[-8:] = torch.arange(1000, 1008, device="cuda")  # ids used only by the last rows
    weight = torch.zeros(1008, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n_tokens, width, device="cuda", dtype=torch.bfloat16)
    (weight_grad,) = torch.autograd.grad(embedding(ids, weight), weight, grad)
    assert torch.equal(weight_grad[1000:], grad[-8:])
