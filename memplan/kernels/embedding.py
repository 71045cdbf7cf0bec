"""Embedding lookup whose backward sums the gradient rows of each token id with bounded work per
program.

Forward is torch's gather (F.embedding). Backward: the ids are sorted (stable: each id's rows are
summed in the tokens' order, so the result is deterministic), then the sorted positions are cut
into chunks of CHUNK. One program per (chunk, column block) sums each run of equal ids inside its
chunk in fp32; a run that lies whole in the chunk is written, rounded once, to its weight-gradient
row; a run cut by the chunk's start or end leaves its fp32 piece in a small buffer (two slots per
chunk), and a second kernel adds the pieces of each such run in order and writes it. Rows of ids
that do not occur stay zero, as does padding_idx's row (torch's rule).

Chunks bound every program's work: with one program per run of equal ids, a batch of one
repeated id would be summed by a single program (docs/bench_kernels.md, embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memplan.errors import UsageError
from memplan.kernels._launch import fast_launch
from memplan.kernels._utils import as_rows, cdiv, first_order_only, next_power_of_2, on_device

# Columns per program: 512 bf16 columns are a 1 KiB row segment.
MAX_BLOCK = 512
# Sorted positions per program.
CHUNK = 32


def reference_embedding_backward(
    ids: torch.Tensor, grad: torch.Tensor, n_rows: int, padding_idx: int | None
) -> torch.Tensor:
    """Plain PyTorch: index_add of the gradient rows in fp32, one rounding at the end."""
    grad2 = grad.reshape(-1, grad.shape[-1]).float()
    weight_grad = torch.zeros(n_rows, grad.shape[-1], dtype=torch.float32, device=grad.device)
    weight_grad.index_add_(0, ids.reshape(-1), grad2)
    if padding_idx is not None:
        weight_grad[padding_idx] = 0
    return weight_grad.to(grad.dtype)


@fast_launch
@triton.jit
def _embedding_pieces_kernel(
    sorted_ids_ptr,
    order_ptr,
    grad_ptr,
    weight_grad_ptr,
    pieces_ptr,
    grad_row_stride,
    n_tokens,
    n_cols,
    padding_idx,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per chunk: runs whole in the chunk to weight_grad; the piece of a run that began in an
    earlier chunk to slot 0, the piece of a run that begins here and goes on to slot 1."""
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    first = chunk * CHUNK
    last = tl.minimum(first + CHUNK, n_tokens) - 1
    before = tl.load(sorted_ids_ptr + tl.maximum(first - 1, 0))
    from_before = (first > 0) & (before == tl.load(sorted_ids_ptr + first))
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(first, last + 1):
        token = tl.load(sorted_ids_ptr + p)
        row = tl.load(order_ptr + p)
        acc += tl.load(grad_ptr + row * grad_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        following = tl.load(sorted_ids_ptr + p + 1, mask=p + 1 < n_tokens, other=-1)
        run_ends = following != token
        if run_ends | (p == last):
            if from_before:
                tl.store(pieces_ptr + (2 * chunk) * n_cols + cols, acc, mask=mask)
            elif not run_ends:
                tl.store(pieces_ptr + (2 * chunk + 1) * n_cols + cols, acc, mask=mask)
            elif token != padding_idx:
                tl.store(
                    weight_grad_ptr + token * n_cols + cols,
                    acc.to(weight_grad_ptr.dtype.element_ty),
                    mask=mask,
                )
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            from_before = p < first  # False: later pieces began in this chunk


@fast_launch
@triton.jit
def _embedding_runs_kernel(
    sorted_ids_ptr,
    weight_grad_ptr,
    pieces_ptr,
    n_tokens,
    n_cols,
    padding_idx,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per chunk whose last run begins in it and goes on: that run's pieces, in order."""
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    first = chunk * CHUNK
    last = tl.minimum(first + CHUNK, n_tokens) - 1
    token = tl.load(sorted_ids_ptr + last)
    next_first = first + CHUNK
    goes_on = tl.load(sorted_ids_ptr + next_first, mask=next_first < n_tokens, other=-1) == token
    before = tl.load(sorted_ids_ptr + tl.maximum(first - 1, 0))
    began_here = (first == 0) | (before != token) | (tl.load(sorted_ids_ptr + first) != token)
    if goes_on & began_here & (token != padding_idx):
        acc = tl.load(pieces_ptr + (2 * chunk + 1) * n_cols + cols, mask=mask, other=0.0)
        k = chunk + 1
        going = goes_on
        while going:
            acc += tl.load(pieces_ptr + (2 * k) * n_cols + cols, mask=mask, other=0.0)
            k_next = (k + 1) * CHUNK
            going = tl.load(sorted_ids_ptr + k_next, mask=k_next < n_tokens, other=-1) == token
            k += 1
        tl.store(
            weight_grad_ptr + token * n_cols + cols,
            acc.to(weight_grad_ptr.dtype.element_ty),
            mask=mask,
        )


def embedding_backward(
    ids: torch.Tensor, grad: torch.Tensor, n_rows: int, padding_idx: int | None
) -> torch.Tensor:
    """The (n_rows, width) weight gradient of an embedding lookup of `ids` given the output
    gradient `grad` (ids.shape + (width,)), in grad's dtype."""
    width = grad.shape[-1]
    grad2 = as_rows(grad)
    weight_grad = torch.zeros(n_rows, width, dtype=grad.dtype, device=grad.device)
    n_tokens = ids.numel()
    if n_tokens == 0 or width == 0:
        return weight_grad
    sorted_ids, order = torch.sort(ids.reshape(-1).to(torch.int64), stable=True)
    n_chunks = cdiv(n_tokens, CHUNK)
    pieces = torch.empty(2 * n_chunks, width, dtype=torch.float32, device=grad.device)
    block = min(next_power_of_2(width), MAX_BLOCK)
    grid = (n_chunks, cdiv(width, block))
    padding = padding_idx if padding_idx is not None else -1
    with on_device(grad):
        _embedding_pieces_kernel[grid](
            sorted_ids,
            order,
            grad2,
            weight_grad,
            pieces,
            grad2.stride(0),
            n_tokens,
            width,
            padding,
            CHUNK=CHUNK,
            BLOCK=block,
            num_warps=4,
        )
        _embedding_runs_kernel[grid](
            sorted_ids, weight_grad, pieces, n_tokens, width, padding, CHUNK=CHUNK, BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    return weight_grad


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.n_rows, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, embedding_backward(ids, grad, ctx.n_rows, ctx.padding_idx), None


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None):
    """F.embedding(ids, weight, padding_idx) with memplan's weight-gradient kernel. Under
    torch.compile, for tensor subclasses and where the weight needs no gradient, torch's own."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise UsageError(f"embedding ids must be int32 or int64, got {ids.dtype}.")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    # a parameter is the usual weight; other tensor subclasses (fake, distributed) are torch's
    plain = type(ids) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
    trained = weight.requires_grad and torch.is_grad_enabled()
    if torch.compiler.is_compiling() or not plain or not trained:
        return F.embedding(ids, weight, padding_idx)
    return _EmbeddingFunction.apply(ids, weight, padding_idx)
