"""Cross entropy and fused linear cross entropy on the GPU at real sizes (run: pytest -m gpu):
more than 2**31 logits, the fp32 reference, the three FLCE schedules, measured peak memory
against the contract, torch.compile with inductor."""

import pytest
import torch

from memplan.estimators.kernel_contracts import (
    flce_chunk_for_budget,
    flce_default_chunk,
    flce_saved_bytes,
    flce_transient_bytes,
)
from memplan.kernels.cross_entropy import (
    LossOptions,
    cross_entropy,
    launch_cross_entropy_forward,
    reference_cross_entropy,
)
from memplan.kernels.fused_linear_cross_entropy import (
    flce_schedule,
    fused_linear_cross_entropy,
    reference_fused_linear_cross_entropy,
)

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def chunked_reference(x, w, target, rows_per_chunk=2048, softcap=None, label_smoothing=0.0):
    """fp32 loss (mean), dX and dW without autograd, a chunk of rows at a time."""
    n_valid = (target != -100).sum().clamp_min(1)
    w32 = w.float()
    loss = torch.zeros((), device=x.device)
    dx = torch.empty(x.shape, device=x.device)
    dw = torch.zeros(w.shape, device=x.device)
    for r0 in range(0, x.shape[0], rows_per_chunk):
        x32 = x[r0 : r0 + rows_per_chunk].float().requires_grad_()
        logits = x32 @ w32.t()
        rows = reference_cross_entropy(
            logits,
            target[r0 : r0 + rows_per_chunk],
            softcap=softcap,
            label_smoothing=label_smoothing,
            reduction="sum",
        )
        (g_logits,) = torch.autograd.grad(rows, logits)
        loss += rows.detach()
        dx[r0 : r0 + rows_per_chunk] = g_logits @ w32
        dw += g_logits.t() @ x32.detach()
    return loss / n_valid, dx / n_valid, dw / n_valid


def random_targets(n_rows, vocab, n_ignored, device="cuda"):
    target = torch.randint(0, vocab, (n_rows,), device=device)
    target[torch.randperm(n_rows, device=device)[:n_ignored]] = -100
    return target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"label_smoothing": 0.1, "softcap": 30.0, "z_loss_scale": 1e-4},
        {"reduction": "none"},
        {"num_items_in_batch": 5000},
    ],
)
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_cross_entropy_real_size(dtype, options, inplace_grad):
    n_rows, vocab = 4096, 128256
    logits = (torch.randn(n_rows, vocab, device="cuda") * 3).to(dtype)
    target = random_targets(n_rows, vocab, 300)
    ref_leaf = logits.float().clone().requires_grad_()
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(
        leaf * 1 if inplace_grad else leaf, target, inplace_grad=inplace_grad, **options
    )
    ref = reference_cross_entropy(ref_leaf, target, **options)
    grad_out = torch.rand_like(ref) + 0.5
    loss.backward(grad_out)
    ref.backward(grad_out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(loss, ref) <= tol
    assert rel_err(leaf.grad, ref_leaf.grad) <= tol
    with torch.no_grad():  # the loss-only launch configuration
        assert rel_err(cross_entropy(logits, target, **options), ref) <= tol


@pytest.mark.parametrize("vocab", [32000, 151936])  # the vocab loop, 4 and 19 blocks
def test_cross_entropy_more_than_2_31_logits(vocab):
    n_rows = (2**31) // vocab + 300
    assert n_rows * vocab > 2**31
    logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    target = random_targets(n_rows, vocab, 1000)
    target[-1] = vocab - 1
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf * 1, target, inplace_grad=True, reduction="none", softcap=20.0)
    loss.sum().backward()
    # Reference row chunks in fp32; the rows past 2**31 elements included.
    sq_err = sq_ref = 0.0
    for r0 in range(0, n_rows, 4096):
        x = logits[r0 : r0 + 4096].float().requires_grad_()
        ref = reference_cross_entropy(x, target[r0 : r0 + 4096], reduction="none", softcap=20.0)
        ref.sum().backward()
        assert rel_err(loss[r0 : r0 + 4096], ref) <= 1e-2
        sq_err += (leaf.grad[r0 : r0 + 4096].float() - x.grad).square().sum().item()
        sq_ref += x.grad.square().sum().item()
    assert (sq_err / sq_ref) ** 0.5 <= 1e-2
    assert leaf.grad[-1].abs().sum() > 0
    with torch.no_grad():  # the loss-only launch configuration, past 2**31 too
        loss_only = cross_entropy(logits, target, reduction="none", softcap=20.0)
    assert rel_err(loss_only, loss.detach()) <= 1e-5


@pytest.mark.parametrize("vocab", [8000, 128256])  # the row in registers; 32 streamed blocks
def test_cross_entropy_in_place_loss_reads_the_target_logit_first(vocab):
    """Every thread reads the target's logit for the loss; one thread writes its gradient over
    it. Without ordering, the loss used the gradient in 11 of 300 calls at vocab 128256."""
    n_rows, repeats = 4096, 200
    logits = torch.randn(n_rows, vocab, device="cuda") * 3
    target = random_targets(n_rows, vocab, 300)
    expected, loss = torch.empty(n_rows, device="cuda"), torch.empty(n_rows, device="cuda")
    scale = torch.ones(1, device="cuda")
    options = LossOptions()
    launch_cross_entropy_forward(logits, None, target, expected, None, None, scale, options)
    buffer = torch.empty_like(logits)
    wrong_rows = 0
    for _ in range(repeats):
        buffer.copy_(logits)
        launch_cross_entropy_forward(buffer, buffer, target, loss, None, None, scale, options)
        wrong_rows += ((loss - expected).abs() > 1e-4).sum().item()
    assert wrong_rows == 0


@pytest.mark.parametrize("vocab", [8000, 128256])
def test_cross_entropy_target_outside_the_vocabulary_is_nan_in_its_row(vocab):
    """The last row's target is the vocabulary size: its loss and gradient are NaN and nothing
    past the buffer is read; every other row matches the reference."""
    n_rows = 4096
    logits = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    target = random_targets(n_rows, vocab, 300)
    target[-1] = vocab
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf * 1, target, reduction="none", inplace_grad=True)
    loss.sum().backward()
    assert torch.isnan(loss[-1]) and torch.isnan(leaf.grad[-1].float()).all()
    ref_leaf = logits[:-1].float().requires_grad_()
    ref = reference_cross_entropy(ref_leaf, target[:-1], reduction="none")
    ref.sum().backward()
    assert rel_err(loss[:-1], ref) <= 1e-2
    assert rel_err(leaf.grad[:-1], ref_leaf.grad) <= 1e-2


def run_flce(x, w, target, **kwargs):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(xl, wl, target, **kwargs)
    loss.backward()
    return loss, xl.grad, wl.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flce_matches_fp32_reference(dtype):
    """BT 4096 x H 4096 x V 128256 against the fp32 reference, default chunk and a budget."""
    n_rows, hidden, vocab = 4096, 4096, 128256
    x = torch.randn(n_rows, hidden, device="cuda").to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(dtype)
    target = random_targets(n_rows, vocab, 200)
    ref_loss, ref_dx, ref_dw = chunked_reference(x, w, target)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for kwargs in ({}, {"memory_budget": 2 << 30}):
        loss, dx, dw = run_flce(x, w, target, **kwargs)
        assert rel_err(loss, ref_loss) <= tol
        assert rel_err(dx, ref_dx) <= tol
        assert rel_err(dw, ref_dw) <= tol


@pytest.mark.parametrize(
    "kwargs, schedule",
    [
        ({}, "two_pass"),
        ({"memory_budget": 900 * MIB}, "one_pass_fp32_acc"),
        ({"memory_budget": 4 << 30}, "one_pass"),
    ],
)
def test_flce_schedules_with_options(kwargs, schedule):
    n_rows, hidden, vocab = 16384, 4096, 32000
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    target = random_targets(n_rows, vocab, 3000)
    target[:4096] = -100  # the first chunks skip their GEMMs
    chunk = flce_default_chunk(n_rows, hidden, vocab)
    if kwargs:
        chunk = flce_chunk_for_budget(n_rows, hidden, vocab, 2, kwargs["memory_budget"])
    assert (
        flce_schedule(
            n_rows,
            hidden,
            vocab,
            2,
            min(chunk, n_rows),
            weight_requires_grad=True,
            budget_bytes=kwargs.get("memory_budget"),
            has_bias=False,
        )
        == schedule
    )
    options = {"softcap": 30.0, "label_smoothing": 0.1}
    ref_loss, ref_dx, ref_dw = chunked_reference(x, w, target, **options)
    loss, dx, dw = run_flce(x, w, target, **options, **kwargs)
    assert rel_err(loss, ref_loss) <= 1e-2
    assert rel_err(dx, ref_dx) <= 1e-2
    assert rel_err(dw, ref_dw) <= 1e-2


def test_flce_more_than_2_31_logits_in_one_chunk():
    n_rows, hidden, vocab = 16800, 1024, 128256
    assert n_rows * vocab > 2**31
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.03).to(torch.bfloat16)
    target = random_targets(n_rows, vocab, 500)
    ref_loss, ref_dx, ref_dw = chunked_reference(x, w, target)
    loss, dx, dw = run_flce(x, w, target, chunk_size=n_rows)
    assert rel_err(loss, ref_loss) <= 1e-2
    assert rel_err(dx, ref_dx) <= 1e-2 and rel_err(dx[-100:], ref_dx[-100:]) <= 1e-2
    assert rel_err(dw, ref_dw) <= 1e-2


@pytest.mark.parametrize(
    "kwargs", [{}, {"memory_budget": 900 * MIB}, {"memory_budget": 4 << 30}, {"chunk_size": 1000}]
)
def test_flce_peak_memory_matches_contract(kwargs):
    """Peak allocated during forward and backward, above the inputs, equals what the contract
    says it saves plus its transient (to the allocator's rounding and a few scalars): the
    backward adds nothing, dX and dW become the .grad tensors."""
    n_rows, hidden, vocab = 16384, 4096, 32000
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    target = random_targets(n_rows, vocab, 100)
    fused_linear_cross_entropy(x, w, target, **kwargs).backward()  # cuBLAS workspace, warm-up
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fused_linear_cross_entropy(x, w, target, **kwargs).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    budget = kwargs.get("memory_budget")
    if budget is not None:
        chunk = flce_chunk_for_budget(n_rows, hidden, vocab, 2, budget)
    else:
        chunk = kwargs.get("chunk_size") or flce_default_chunk(n_rows, hidden, vocab)
    predicted = flce_saved_bytes(n_rows, hidden, vocab, 2) + flce_transient_bytes(
        n_rows, hidden, vocab, 2, chunk, budget_bytes=budget
    )
    print(f"{kwargs}: measured {peak / MIB:.1f} MiB, contract {predicted / MIB:.1f} MiB")
    # the caching allocator may hand out up to 1 MiB more than asked for a large block
    assert abs(peak - predicted) <= max(4 * MIB, predicted // 100)


def test_cross_entropy_in_place_allocates_only_rows():
    n_rows, vocab = 8192, 128256
    leaf = torch.randn(n_rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = random_targets(n_rows, vocab, 10)
    logits = leaf * 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cross_entropy(logits, target, inplace_grad=True)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.cuda.synchronize()
    # per-row fp32 loss and z-loss and a few scalars: no (rows x vocab) buffer
    assert torch.cuda.max_memory_allocated() - base <= 2 * MIB
    assert grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    n_rows, hidden, vocab = 512, 256, 5000
    x = torch.randn(n_rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * 0.05).to(torch.bfloat16)
    target = random_targets(n_rows, vocab, 50)

    def step(x, w):
        a = cross_entropy(x @ w.t(), target, inplace_grad=True, softcap=30.0)
        b = fused_linear_cross_entropy(x, w, target, chunk_size=100, z_loss_scale=1e-4)
        return a + 2 * b

    def ref_step(x, w):
        a = reference_cross_entropy(x @ w.t(), target, softcap=30.0)
        b = reference_fused_linear_cross_entropy(x, w, target, z_loss_scale=1e-4)
        return a + 2 * b

    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    refs = [x.float().requires_grad_(), w.float().requires_grad_()]
    got = torch.compile(step, fullgraph=True)(*leaves)
    ref = ref_step(*refs)
    got.backward()
    ref.backward()
    assert rel_err(got, ref) <= 1e-2
    for leaf, ref_leaf in zip(leaves, refs):
        assert rel_err(leaf.grad, ref_leaf.grad) <= 1e-2
