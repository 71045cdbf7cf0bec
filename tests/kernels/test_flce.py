"""Fused linear cross entropy against the fp32 PyTorch reference (CPU: Triton interpreter), its
three schedules, and its memory contract."""

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memplan.kernels.fused_linear_cross_entropy as flce_module
from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import (
    flce_chunk_for_budget,
    flce_default_chunk,
    flce_saved_bytes,
    flce_transient_bytes,
)
from memplan.kernels.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    flce_schedule,
    fused_linear_cross_entropy,
    reference_fused_linear_cross_entropy,
)

# Triton's CPU interpreter truncates fp32 -> bf16 stores instead of rounding them, which about
# doubles bf16 errors there; on the GPU the bf16 bound is the 1e-2.
TOL = {
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2 if os.environ.get("TRITON_INTERPRET") != "1" else 1.5e-2,
}

OPTIONS = {
    "plain": {},
    "smoothing_softcap_z": {"label_smoothing": 0.1, "softcap": 3.0, "z_loss_scale": 1e-3},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "num_items": {"num_items_in_batch": 9},
}


def rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_inputs(n_rows, hidden, vocab, dtype, *, bias=False, n_ignored=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 2.0).to(dtype)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[torch.randperm(n_rows, generator=gen)[: min(n_ignored, n_rows - 1)]] = -100
    return x, w, b, target


def check(x, w, b, target, dtype, **kwargs):
    """Loss, dX, dW (and db) for a random grad_output against the fp32 reference."""
    options = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "memory_budget")}
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    refs = [t.float().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    loss = fused_linear_cross_entropy(*leaves[:2], target, leaves[2], **kwargs)
    ref = reference_fused_linear_cross_entropy(*refs[:2], target, refs[2], **options)
    grad_out = torch.randn_like(ref) + 2.0
    loss.backward(grad_out)
    ref.backward(grad_out)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert rel_err(loss, ref) <= TOL[dtype]
    for got_leaf, ref_leaf in zip(leaves, refs):
        if got_leaf is not None:
            assert got_leaf.grad.dtype == dtype
            assert rel_err(got_leaf.grad, ref_leaf.grad) <= TOL[dtype]


def record_schedules(monkeypatch):
    """The schedule each call of the chunked loop runs."""
    seen = []
    original = flce_module._flce

    def spy(*args):
        seen.append(args[9])  # _flce's schedule
        return original(*args)

    monkeypatch.setattr(flce_module, "_flce", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# one row and 37 rows under `-m slow`; test_single_row checks one row by default
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((1, 64, 97), marks=pytest.mark.slow),
        (7, 96, 500),
        pytest.param((37, 64, 1000), marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_reference_default_chunk(dtype, shape, option):
    x, w, b, target = make_inputs(*shape, dtype)
    check(x, w, b, target, dtype, **OPTIONS[option])


# bf16 chunking is also covered by test_schedules and the default-chunk test
@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]
)
# chunks of 37 and 64 (all the rows) under `-m slow`; test_schedules runs one chunk by default
@pytest.mark.parametrize(
    "chunk_size", [1, 5, *(pytest.param(c, marks=pytest.mark.slow) for c in (37, 64))]
)
@pytest.mark.parametrize("option", ["plain", "smoothing_softcap_z", "none"])
def test_chunk_sizes(dtype, chunk_size, option):
    n_rows = 7 if chunk_size == 1 else 37  # chunk 1 runs one GEMM triple per row: keep it short
    x, w, b, target = make_inputs(n_rows, 64, 500, dtype)
    check(x, w, b, target, dtype, chunk_size=chunk_size, **OPTIONS[option])


@pytest.mark.parametrize(
    "dtype, chunk_size",
    [
        (torch.float32, None),
        (torch.float32, 6),
        (torch.bfloat16, None),
        pytest.param(torch.bfloat16, 6, marks=pytest.mark.slow),
    ],
)
def test_bias(dtype, chunk_size):
    x, w, b, target = make_inputs(37, 64, 500, dtype, bias=True)
    check(x, w, b, target, dtype, chunk_size=chunk_size, label_smoothing=0.1, softcap=5.0)


def test_bias_reduction_none():
    x, w, b, target = make_inputs(19, 64, 500, torch.float32, bias=True)
    check(x, w, b, target, torch.float32, chunk_size=4, reduction="none")


# 64 rows, H 16, V 500, bf16 with a bias: one chunk of all rows takes 68512 transient bytes,
# the fp32-accumulator schedule 36000 + 8 * chunk + max(0, 1000 * chunk - 16000) (dW is allocated
# after the logits buffer is freed), the two-pass one 1008 * chunk + 4256.
@pytest.mark.parametrize(
    "dtype, kwargs, schedule",
    [
        (torch.bfloat16, {"chunk_size": 64}, "one_pass"),  # one chunk
        (torch.float32, {"chunk_size": 5}, "one_pass"),  # fp32 weight accumulates in dW
        # the default run checks two_pass on bf16 chunks in test_schedule_of_reduction_none_backward
        pytest.param(torch.bfloat16, {"chunk_size": 5}, "two_pass", marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, {}, "two_pass", marks=pytest.mark.slow),  # formula chunk (2)
        (torch.bfloat16, {"memory_budget": 55_000}, "one_pass_fp32_acc"),  # chunk 32
        pytest.param(  # chunk 16, no accumulator
            torch.bfloat16, {"memory_budget": 30_000}, "two_pass", marks=pytest.mark.slow
        ),
        (torch.bfloat16, {"memory_budget": 1 << 30}, "one_pass"),  # room for one chunk
    ],
)
def test_schedules(monkeypatch, dtype, kwargs, schedule):
    monkeypatch.setattr(flce_module, "MIN_ACCUMULATED_CHUNK", 8)
    seen = record_schedules(monkeypatch)
    x, w, b, target = make_inputs(64, 16, 500, dtype, bias=True)
    check(x, w, b, target, dtype, label_smoothing=0.05, softcap=4.0, **kwargs)
    assert seen == [schedule]


def test_schedule_of_reduction_none_backward(monkeypatch):
    """'none' computes losses only in the forward; the backward runs the schedule."""
    seen = record_schedules(monkeypatch)
    x, w, b, target = make_inputs(37, 64, 500, torch.bfloat16)
    check(x, w, b, target, torch.bfloat16, chunk_size=4, reduction="none")
    assert seen == ["two_pass", "two_pass"]


def test_frozen_weight_and_frozen_hidden(monkeypatch):
    seen = record_schedules(monkeypatch)
    x, w, _, target = make_inputs(37, 64, 500, torch.bfloat16)
    ref_x = x.float().requires_grad_()
    leaf = x.clone().requires_grad_()
    loss = fused_linear_cross_entropy(leaf, w, target, chunk_size=5)
    ref = reference_fused_linear_cross_entropy(ref_x, w.float(), target)
    loss.backward()
    ref.backward()
    assert rel_err(leaf.grad, ref_x.grad) <= 1e-2
    assert seen == ["one_pass"]  # no dW: nothing accumulated

    ref_w = w.float().requires_grad_()
    leaf_w = w.clone().requires_grad_()
    fused_linear_cross_entropy(x, leaf_w, target, chunk_size=5).backward()
    reference_fused_linear_cross_entropy(x.float(), ref_w, target).backward()
    assert rel_err(leaf_w.grad, ref_w.grad) <= 1e-2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction):
    x, w, b, _ = make_inputs(9, 64, 97, torch.float32, bias=True)
    target = torch.full((9,), -100)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    loss = fused_linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    for leaf in leaves:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("bad_target", [500, -5])
def test_target_outside_the_vocabulary_raises(bad_target):
    x, w, _, target = make_inputs(9, 64, 500, torch.float32)
    target[4] = bad_target
    with pytest.raises(UsageError, match=r"outside the vocabulary \[0, 500\)"):
        fused_linear_cross_entropy(x, w.requires_grad_(), target, chunk_size=4)


def test_chunks_without_targets_skip_their_gemms(monkeypatch):
    calls = []
    original = flce_module._linear
    monkeypatch.setattr(
        flce_module, "_linear", lambda *args: calls.append(args[0].shape[0]) or original(*args)
    )
    x, w, b, target = make_inputs(16, 64, 500, torch.bfloat16, n_ignored=0)
    target[:12] = -100  # chunks of 4: only the last one has targets
    check(x, w, b, target, torch.bfloat16, chunk_size=4)
    # pass 1: one chunk; pass 2 spans only its 4 rows, in vocabulary slices of 256 and 244
    assert calls == [4, 4, 4]


def test_single_row():
    x, w, b, target = make_inputs(1, 64, 1000, torch.bfloat16, bias=True)
    check(x, w, b, target, torch.bfloat16, **OPTIONS["smoothing_softcap_z"])


def test_return_per_token_loss():
    x, w, _, target = make_inputs(37, 64, 500, torch.float32)
    loss, per_token = fused_linear_cross_entropy(x, w, target, return_per_token_loss=True)
    ref = reference_fused_linear_cross_entropy(x, w, target, reduction="none")
    assert rel_err(per_token, ref) <= 1e-5
    assert rel_err(loss, ref.sum() / (target != -100).sum()) <= 1e-5
    loss, per_token = fused_linear_cross_entropy(
        x, w, target, reduction="none", return_per_token_loss=True
    )
    assert loss is per_token


def test_num_items_tensor():
    x, w, _, target = make_inputs(37, 64, 500, torch.float32)
    check(x, w, None, target, torch.float32, chunk_size=8, num_items_in_batch=torch.tensor(50))


def test_non_contiguous_inputs():
    x, w, _, target = make_inputs(37, 64, 500, torch.float32)
    x_t = x.t().contiguous().requires_grad_()  # hidden stored (H, N)
    w_t = w.t().contiguous().requires_grad_()
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    fused_linear_cross_entropy(x_t.t(), w_t.t(), target, chunk_size=6).backward()
    reference_fused_linear_cross_entropy(ref_x, ref_w, target).backward()
    assert rel_err(x_t.grad.t(), ref_x.grad) <= 1e-5
    assert rel_err(w_t.grad.t(), ref_w.grad) <= 1e-5


def test_autocast_runs_in_the_autocast_dtype():
    x, w, _, target = make_inputs(13, 64, 500, torch.float32)
    leaf = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, leaf, target, chunk_size=4)
    ref = reference_fused_linear_cross_entropy(x.bfloat16(), w.bfloat16(), target)
    loss.backward()
    assert rel_err(loss, ref) <= 1e-2 and leaf.grad.dtype == torch.float32


def test_module_matches_functional():
    x, w, b, target = make_inputs(37, 64, 500, torch.float32, bias=True)
    module = FusedLinearCrossEntropyLoss(label_smoothing=0.1, chunk_size=8)
    got = module(x, w, target, b)
    assert torch.equal(
        got, fused_linear_cross_entropy(x, w, target, b, label_smoothing=0.1, chunk_size=8)
    )


def test_second_backward_is_refused():
    x, w, _, target = make_inputs(7, 64, 97, torch.float32)
    loss = fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_size": 4, "memory_budget": 1000}, "not both"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"memory_budget": -5}, "memory_budget"),
        ({"reduction": "avg"}, "reduction"),
    ],
)
def test_bad_options_raise_usage_error(kwargs, match):
    x, w, _, target = make_inputs(3, 64, 97, torch.float32)
    with pytest.raises(UsageError, match=match):
        fused_linear_cross_entropy(x, w, target, **kwargs)


def test_bad_shapes_and_dtypes_raise_usage_error():
    x, w, _, target = make_inputs(3, 64, 97, torch.float32)
    with pytest.raises(UsageError, match="expects hidden"):
        fused_linear_cross_entropy(x, w[:, :32], target)
    with pytest.raises(UsageError, match="dtype"):
        fused_linear_cross_entropy(x.bfloat16(), w, target)


# --- memory contract ------------------------------------------------------------------------


CONTRACT_CASES = [
    ("mean", False, True, True),
    ("sum", True, True, True),
    ("mean", False, True, False),
    ("mean", False, False, True),
    ("none", True, True, True),
]


# every case in fp32; in bf16 the last (bias, reduction "none"), the rest under `-m slow`
@pytest.mark.parametrize(
    "dtype, reduction, bias, x_grad, w_grad",
    [(torch.float32, *case) for case in CONTRACT_CASES]
    + [(torch.bfloat16, *CONTRACT_CASES[-1])]
    + [pytest.param(torch.bfloat16, *case, marks=pytest.mark.slow) for case in CONTRACT_CASES[:-1]],
)
def test_saved_bytes_match_contract(dtype, reduction, bias, x_grad, w_grad):
    """New bytes autograd keeps (unique storages other than the inputs) equal flce_saved_bytes."""
    n_rows, hidden, vocab = 37, 64, 500
    x, w, b, target = make_inputs(n_rows, hidden, vocab, dtype, bias=bias)
    x.requires_grad_(x_grad)
    w.requires_grad_(w_grad)
    if b is not None:
        b.requires_grad_(w_grad)
    inputs = {t.untyped_storage().data_ptr() for t in (x, w, b, target) if t is not None}
    saved = {}

    def pack(t):
        if t is not None and t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=8)
    loss.sum().backward()
    expected = flce_saved_bytes(
        n_rows,
        hidden,
        vocab,
        x.element_size(),
        w_grad,
        hidden_requires_grad=x_grad,
        has_bias=bias and w_grad,
        reduction=reduction,
    )
    assert sum(saved.values()) == expected


@pytest.mark.parametrize("with_bias", [False, True])
def test_backward_allocates_nothing_large(with_bias, new_storages):
    """For 'mean' backward only scales the saved dX, dW (and db) where they lie, and they become
    the .grad tensors without a copy."""
    x, w, b, target = make_inputs(37, 64, 500, torch.float32, bias=with_bias)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=8)
    with new_storages() as created:
        (2.0 * loss).backward()
    assert created.sizes == []
    assert all(leaf.grad.untyped_storage().data_ptr() in saved for leaf in leaves)


def test_contract_schedule_rule_matches_kernel():
    """flce_transient_bytes(schedule=None) applies the rule the kernel's flce_schedule applies."""
    min_chunk = flce_module.MIN_ACCUMULATED_CHUNK
    for (
        rows,
        hidden,
        vocab,
        dtype_bytes,
        chunk,
        budget,
        w_grad,
        bias,
        rows_kept,
    ) in itertools.product(
        [1, 700, 4096, 20000],
        [64, 4096],
        [97, 128256],
        [2, 4],
        [1, 512, 1024, 4096, 32768],
        [None, 1 << 20, 1 << 31, 1 << 34],
        [True, False],
        [True, False],
        [True, False],
    ):
        chunk = min(chunk, rows)
        schedule = flce_schedule(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            weight_requires_grad=w_grad,
            budget_bytes=budget,
            has_bias=bias,
            per_token_loss=rows_kept,
        )
        auto = flce_transient_bytes(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            w_grad,
            budget_bytes=budget,
            has_bias=bias,
            per_token_loss=rows_kept,
            min_accumulated_chunk=min_chunk,
        )
        explicit = flce_transient_bytes(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            w_grad,
            schedule=schedule,
            has_bias=bias,
            per_token_loss=rows_kept,
        )
        assert auto == explicit


def test_chunk_for_budget_picks_the_fastest_schedule_that_fits():
    rows, hidden, vocab = 16384, 4096, 128256
    gib = 1 << 30

    def pick(budget):
        chunk = flce_chunk_for_budget(rows, hidden, vocab, 2, budget)
        schedule = flce_schedule(
            rows,
            hidden,
            vocab,
            2,
            min(chunk, rows),
            weight_requires_grad=True,
            budget_bytes=budget,
            has_bias=False,
        )
        transient = flce_transient_bytes(rows, hidden, vocab, 2, chunk, budget_bytes=budget)
        assert transient <= budget
        return chunk, schedule

    assert pick(5 * gib) == (16384, "one_pass")  # all logits fit: one chunk
    # 2 GiB fp32 dW + 2 GiB of logits at 8192 rows, less the 1 GiB dW that replaces them
    assert pick(7 * gib // 2) == (8192, "one_pass_fp32_acc")
    assert pick(2 * gib) == (4096, "one_pass_fp32_acc")  # logits <= dW: the 1.96 GiB acc only
    assert pick(3 * gib // 2) == (4096, "two_pass")  # the accumulator alone does not fit
    formula = flce_default_chunk(rows, hidden, vocab)
    lean = flce_transient_bytes(rows, hidden, vocab, 2, formula)
    assert pick(lean) == (formula, "two_pass")
    assert flce_chunk_for_budget(rows, hidden, vocab, 2, 1) == 1


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(reduction):
    torch._dynamo.reset()
    x, w, b, target = make_inputs(13, 32, 97, torch.float32, bias=True)
    weights = torch.arange(13.0)

    def step(x, w, b):
        loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=4, reduction=reduction)
        return (loss * weights).sum() if reduction == "none" else 2.0 * loss

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves)
    ref = reference_fused_linear_cross_entropy(
        refs[0], refs[1], target, refs[2], reduction=reduction
    )
    ref = (ref * weights).sum() if reduction == "none" else 2.0 * ref
    got.backward()
    ref.backward()
    assert rel_err(got, ref) <= 1e-5
    for leaf, ref_leaf in zip(leaves, refs):
        assert rel_err(leaf.grad, ref_leaf.grad) <= 1e-5


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(
    n_rows=st.integers(1, 40),
    hidden=st.sampled_from([16, 64, 96]),
    vocab=st.integers(2, 700),
    chunk_size=st.one_of(st.none(), st.integers(2, 48)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    option=st.sampled_from(list(OPTIONS)),
    seed=st.integers(0, 2**16),
)
def test_property_shapes(n_rows, hidden, vocab, chunk_size, dtype, option, seed):
    x, w, b, target = make_inputs(
        n_rows, hidden, vocab, dtype, bias=seed % 2 == 0, n_ignored=n_rows // 4, seed=seed
    )
    check(x, w, b, target, dtype, chunk_size=chunk_size, **OPTIONS[option])


# hypothesis draws outside pytest's fixtures: the device is fixed here as the fixture fixes it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    schedule=st.sampled_from(["one_pass", "one_pass_fp32_acc", "two_pass"]),
    has_bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    num_items=st.sampled_from([None, 5, "tensor"]),
    all_options=st.booleans(),
    needs_grad=st.sampled_from([(1, 1, 1), (1, 0, 1), (0, 1, 0), (0, 0, 1)]),
    ignored=st.sampled_from(["some", "first_chunk", "all"]),
    chunk=st.sampled_from([2, 4, 9]),
    per_token=st.booleans(),
)
def test_flce_option_combinations(
    schedule, has_bias, reduction, num_items, all_options, needs_grad, ignored, chunk, per_token
):
    """Every schedule with bias, per-row scales ('none'), kept rows, frozen inputs, chunks that
    do not divide the rows or hold no target, and num_items_in_batch, against the reference."""
    if reduction != "mean":
        num_items = None
    gen = torch.Generator().manual_seed(chunk)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(37, 8, generator=gen) / 2
    bias = torch.randn(37, generator=gen) / 2 if has_bias else None
    target = torch.randint(0, 37, (9,), generator=gen)
    target[{"some": slice(5, 6), "first_chunk": slice(0, 4), "all": slice(None)}[ignored]] = -100
    hidden, weight, target = hidden.to(DEVICE), weight.to(DEVICE), target.to(DEVICE)
    bias = bias.to(DEVICE) if bias is not None else None
    options = {
        "reduction": reduction,
        "num_items_in_batch": torch.tensor(5, device=DEVICE)
        if num_items == "tensor"
        else num_items,
    }
    if all_options:
        options |= {"label_smoothing": 0.2, "softcap": 2.5, "z_loss_scale": 1e-2}
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    leaves = [t.clone().requires_grad_(bool(g)) for t, g in zip(inputs, needs_grad)]
    twins = [t.clone().requires_grad_(bool(g)) for t, g in zip(inputs, needs_grad)]
    if bias is None:
        leaves.append(None)
        twins.append(None)
    original = flce_module.flce_schedule
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            flce_module,
            "flce_schedule",
            lambda *a, **k: schedule if k["weight_requires_grad"] else original(*a, **k),
        )
        out = fused_linear_cross_entropy(
            *leaves[:2], target, leaves[2], chunk_size=chunk, return_per_token_loss=per_token,
            **options,
        )  # fmt: skip
    ref = reference_fused_linear_cross_entropy(*twins[:2], target, twins[2], **options)
    loss = out[0] if per_token else out
    if per_token:
        per_row = options | {"reduction": "none", "num_items_in_batch": None}
        with torch.no_grad():
            rows = reference_fused_linear_cross_entropy(*twins[:2], target, twins[2], **per_row)
        assert torch.allclose(out[1], rows, rtol=1e-5, atol=1e-6)
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    if not ref.requires_grad:  # no input needs a gradient (bias-free, both frozen)
        assert not loss.requires_grad
        return
    grad_out = (torch.rand(ref.shape, generator=gen) + 0.5).to(DEVICE)
    loss.backward(grad_out)
    ref.backward(grad_out)
    for got, want in zip(leaves, twins):
        if got is not None and got.requires_grad:
            assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)
