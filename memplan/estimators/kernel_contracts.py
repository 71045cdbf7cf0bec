"""Memory contracts of memplan's own kernels: the bytes each op saves for backward and the bytes
it allocates transiently, by dtype. Pure arithmetic; tests/kernels check every function here
against the bytes autograd really saves (torch.autograd.graph.saved_tensors_hooks), so the
kernels and the estimator cannot drift apart.

`rows` is the number of token rows (batch * seq), `dtype_bytes` the element size of the
activations (2 for bf16/fp16, 4 for fp32). Parameters (norm weights, lm_head) are never counted
here: they are weights, not activations."""

from __future__ import annotations

import math

FP32 = 4


def rms_norm_saved_tensors(rows: float, hidden: int, dtype_bytes: int) -> tuple[float, float]:
    """The two tensors it saves: input x (rows x hidden, input dtype) and the fp32 inverse RMS
    per row."""
    return rows * hidden * dtype_bytes, rows * FP32


def rms_norm_saved_bytes(rows: int, hidden: int, dtype_bytes: int) -> int:
    """rms_norm_saved_tensors together. Backward writes dx over dy when `in_place_backward`
    (else a new rows x hidden buffer) and keeps an fp32 dW partial of at most SMs x hidden
    (memplan.kernels._partials), a few MiB."""
    return int(sum(rms_norm_saved_tensors(rows, hidden, dtype_bytes)))


def gated_rms_norm_saved_tensors(rows: float, width: int, dtype_bytes: int) -> tuple[float, ...]:
    """The three tensors the gated RMSNorm saves: its input and gate (rows x width, their
    dtype) and the fp32 inverse RMS per row. Backward allocates dx and dgate like them and an
    fp32 dW partial of at most SMs x width."""
    return rows * width * dtype_bytes, rows * width * dtype_bytes, rows * FP32


def gated_rms_norm_saved_bytes(rows: int, width: int, dtype_bytes: int) -> int:
    """gated_rms_norm_saved_tensors together."""
    return int(sum(gated_rms_norm_saved_tensors(rows, width, dtype_bytes)))


def layer_norm_saved_bytes(rows: int, hidden: int, dtype_bytes: int) -> int:
    """Input x plus fp32 mean and inverse std per row. Backward allocates dx (rows x hidden) and
    fp32 dW/dB partials of at most SMs x hidden each."""
    return rows * hidden * dtype_bytes + 2 * rows * FP32


def rope_saved_bytes(rows: int, head_dim: int, dtype_bytes: int) -> int:
    """Nothing per layer: backward is the transposed rotation with the cos/sin the model already
    holds (one (rows x head_dim) pair shared by every layer, counted once by the estimator)."""
    return 0


def glu_saved_bytes(rows: int, intermediate: int, dtype_bytes: int) -> int:
    """SwiGLU / GeGLU save gate and up; the activation is recomputed in backward, which
    allocates d_gate and d_up (2 x rows x intermediate) unless `in_place_backward` writes them
    over the saved gate and up."""
    return 2 * rows * intermediate * dtype_bytes


def cross_entropy_saved_bytes(
    rows: int, vocab: int, logits_dtype_bytes: int, inplace_grad: bool
) -> int:
    """The logit gradient is computed in the forward. In place it lives in the logits' own
    storage (no new bytes); otherwise in a new buffer of the logits' dtype."""
    return 0 if inplace_grad else rows * vocab * logits_dtype_bytes


def flce_default_chunk(rows: int, hidden: int, vocab: int) -> int:
    """Liger's formula: 2^ceil(log2(BT / ceil(V / H))), at least 1."""
    inc_factor = -(-vocab // hidden)
    return 1 << max(0, math.ceil(math.log2(max(1, -(-rows // inc_factor)))))


def flce_saved_bytes(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    weight_requires_grad: bool = True,
    *,
    hidden_requires_grad: bool = True,
    has_bias: bool = False,
    reduction: str = "mean",
) -> int:
    """For 'mean' and 'sum' FLCE computes the gradients in the forward and saves them, in the
    inputs' dtype: dX (rows x hidden), dW (vocab x hidden) and, with a trainable bias, db (vocab),
    each only when needed. For 'none' it saves only its inputs (no new bytes) and the backward
    recomputes, with the transient of flce_transient_bytes."""
    if reduction == "none":
        return 0
    dx = rows * hidden * dtype_bytes if hidden_requires_grad else 0
    dw = vocab * hidden * dtype_bytes if weight_requires_grad else 0
    db = vocab * dtype_bytes if has_bias else 0
    return dx + dw + db


def flce_transient_bytes(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    chunk: int,
    weight_requires_grad: bool = True,
    *,
    budget_bytes: int | None = None,
    schedule: str | None = None,
    has_bias: bool = False,
    per_token_loss: bool = False,
    min_accumulated_chunk: int = 1024,
) -> int:
    """Bytes FLCE allocates beyond what it saves, all live at its peak (a few scalars aside):
    one chunk of logits, (chunk x vocab) in the inputs' dtype, which the cross-entropy kernel
    overwrites with their gradient; fp32 loss and z-loss for one chunk of rows (for every row
    with per_token_loss, i.e. reduction 'none' or return_per_token_loss); with a trainable bias,
    an fp32 db accumulator (unless db itself is fp32) and one chunk's fp32 column sum. Then by
    schedule:

    - "one_pass" (three GEMMs per chunk: logits, dX, dW): one chunk, an fp32 weight, or no dW
      needed, so nothing is accumulated in low precision. Nothing more.
    - "one_pass_fp32_acc": several chunks with a bf16/fp16 weight; dW is accumulated over chunks
      in an fp32 (vocab x hidden) buffer. Chosen only under a memory budget that holds it, with
      chunks of at least min_accumulated_chunk rows (below that the accumulator's
      read-modify-write per chunk costs more than the two-pass schedule's extra GEMM). dW (a
      saved byte) is allocated after the logits buffer is freed: beyond what is saved, the peak
      is the accumulator plus whatever the logits buffer holds more than dW.
    - "two_pass" (four GEMMs) otherwise: pass 1 per row chunk computes logits, loss, the per-row
      log-sum-exp (fp32, one per row) and dX; pass 2 per vocabulary slice recomputes the slice's
      logits for all rows into the same buffer (max(chunk * vocab, rows) elements) and writes
      the slice of dW with one GEMM, so every element of dW comes from one fp32-accumulated GEMM.

    schedule=None picks the schedule as the kernel does, from the chunk and budget_bytes (the
    kernel's memory_budget)."""
    if rows <= 0:
        return 0
    chunk = max(1, min(chunk, rows))
    if schedule is None:
        schedule = flce_schedule(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            weight_requires_grad=weight_requires_grad,
            budget_bytes=budget_bytes,
            has_bias=has_bias,
            per_token_loss=per_token_loss,
            min_accumulated_chunk=min_accumulated_chunk,
        )
    per_row = 2 * (rows if per_token_loss else chunk) * FP32
    bias = (2 if dtype_bytes < FP32 else 1) * vocab * FP32 if has_bias else 0
    if schedule == "one_pass":
        return chunk * vocab * dtype_bytes + per_row + bias
    if schedule == "one_pass_fp32_acc":
        logits_over_dw = max(0, chunk * vocab - vocab * hidden) * dtype_bytes
        return vocab * hidden * FP32 + logits_over_dw + per_row + bias
    if schedule == "two_pass":
        return max(chunk * vocab, rows) * dtype_bytes + rows * FP32 + per_row + bias
    raise ValueError(f"unknown FLCE schedule {schedule!r}")


def flce_allocations(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    chunk: int,
    weight_requires_grad: bool = True,
    *,
    budget_bytes: int | None = None,
    min_accumulated_chunk: int = 1024,
) -> list[tuple[str, str, int]]:
    """FLCE's forward as the allocator sees it (mean reduction, no bias): ("alloc", name, bytes)
    and ("free", name, 0) in order. dx and dw are its saved outputs (flce_saved_bytes); the
    rest are the transient buffers whose peak is flce_transient_bytes."""
    if rows <= 0:
        return []
    chunk = max(1, min(chunk, rows))
    schedule = flce_schedule(
        rows,
        hidden,
        vocab,
        dtype_bytes,
        chunk,
        weight_requires_grad=weight_requires_grad,
        budget_bytes=budget_bytes,
        min_accumulated_chunk=min_accumulated_chunk,
    )
    dw = vocab * hidden * dtype_bytes if weight_requires_grad else 0
    steps = [("alloc", "dx", rows * hidden * dtype_bytes)]
    if schedule != "one_pass_fp32_acc":
        steps.append(("alloc", "dw", dw))
    steps += [("alloc", "loss_rows", chunk * FP32), ("alloc", "z_rows", chunk * FP32)]
    if schedule == "two_pass":
        steps.append(("alloc", "logits", max(chunk * vocab, rows) * dtype_bytes))
        steps.append(("alloc", "lse_rows", rows * FP32))
        steps += [("free", "logits", 0), ("free", "lse_rows", 0)]
    elif schedule == "one_pass_fp32_acc":
        steps.append(("alloc", "logits", chunk * vocab * dtype_bytes))
        steps.append(("alloc", "acc", vocab * hidden * FP32))
        steps += [("free", "logits", 0), ("alloc", "dw", dw), ("free", "acc", 0)]
    else:
        steps += [("alloc", "logits", chunk * vocab * dtype_bytes), ("free", "logits", 0)]
    steps += [("free", "loss_rows", 0), ("free", "z_rows", 0)]
    return [step for step in steps if step[0] == "free" or step[2] > 0]


def flce_schedule(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    chunk: int,
    *,
    weight_requires_grad: bool = True,
    budget_bytes: int | None = None,
    has_bias: bool = False,
    per_token_loss: bool = False,
    min_accumulated_chunk: int = 1024,
) -> str:
    """The schedule FLCE runs for a chunk (see flce_transient_bytes): one pass when nothing is
    accumulated in low precision, the fp32 accumulator when memory_budget holds it, else two
    passes. The kernel calls this same function."""
    chunk = max(1, min(chunk, rows))
    if -(-rows // chunk) <= 1 or dtype_bytes >= FP32 or not weight_requires_grad:
        return "one_pass"
    if budget_bytes is not None and chunk >= min(rows, min_accumulated_chunk):
        with_accumulator = flce_transient_bytes(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            weight_requires_grad,
            schedule="one_pass_fp32_acc",
            has_bias=has_bias,
            per_token_loss=per_token_loss,
        )
        if with_accumulator <= budget_bytes:
            return "one_pass_fp32_acc"
    return "two_pass"


def flce_chunk_for_budget(
    rows: int,
    hidden: int,
    vocab: int,
    dtype_bytes: int,
    budget_bytes: int,
    weight_requires_grad: bool = True,
    *,
    has_bias: bool = False,
    per_token_loss: bool = False,
    min_accumulated_chunk: int = 1024,
) -> int:
    """The chunk FLCE uses under memory_budget=budget_bytes: the fastest schedule whose transient
    bytes fit. In order: one chunk for all rows (three GEMMs, nothing accumulated); the largest
    power-of-two chunk of at least min_accumulated_chunk rows whose fp32-accumulator schedule
    fits (an fp32 or frozen weight needs no accumulator: any chunk); the largest power-of-two
    chunk whose two-pass schedule fits; 1. flce_transient_bytes(..., chunk,
    budget_bytes=budget_bytes) gives the bytes of the schedule the kernel then runs."""
    if rows <= 0:
        return 1
    top = 1 << max(0, math.ceil(math.log2(rows)))
    powers = [top >> i for i in range(top.bit_length())]

    def fits(chunk: int, schedule: str) -> bool:
        need = flce_transient_bytes(
            rows,
            hidden,
            vocab,
            dtype_bytes,
            chunk,
            weight_requires_grad,
            schedule=schedule,
            has_bias=has_bias,
            per_token_loss=per_token_loss,
        )
        return need <= budget_bytes

    if dtype_bytes >= FP32 or not weight_requires_grad:
        return next((c for c in powers if fits(c, "one_pass")), 1)
    if fits(rows, "one_pass"):
        return top
    for chunk in powers:
        if min_accumulated_chunk <= chunk < rows and fits(chunk, "one_pass_fp32_acc"):
            return chunk
    return next((c for c in powers if c < rows and fits(c, "two_pass")), 1)


def sink_attention_kernel(backend: str, dtype_bytes: int, head_dim: int) -> str:
    """The kernel memplan.kernels.sink_attention runs (its kernel_for): flash attention for
    fp16/bf16 on CUDA, the memory-efficient kernel for fp32 there, the plain-PyTorch path
    elsewhere (and for head dims the fused kernels refuse)."""
    if backend != "cuda":
        return "math"
    if dtype_bytes < FP32 and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    if dtype_bytes == FP32 and head_dim % 4 == 0:
        return "efficient"
    return "math"


def sink_attention_saved(
    seq: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int, kernel: str
) -> list[tuple[str, float, int]]:
    """(name, bytes per token row, constant bytes) of each tensor sink attention saves: q, k
    and v as given (keys and values not expanded: the memory-efficient kernel's backward
    expands them again), the output (which o_proj keeps as its input too), the fp32
    logsumexp per row and head (the memory-efficient kernel pads each (batch, head)'s rows to
    a multiple of 32), and on CUDA the philox seed and offset (counted as SDPA's are). Not r:
    the backward recomputes it from the logsumexp."""
    p = dtype_bytes
    rows = -(-seq // 32) * 32 if kernel == "efficient" else seq
    saved = [
        ("attn.qkv", p * heads * head_dim, 0),
        ("attn.qkv", p * kv_heads * head_dim, 0),
        ("attn.qkv", p * kv_heads * head_dim, 0),
        ("attn.lse", FP32 * heads * rows / seq, 0),
        ("attn.out", p * heads * head_dim, 0),
    ]
    if kernel != "math":
        saved.append(("attn.rng", 0.0, 2 * 8))
    return saved


def sink_attention_forward_transient(heads: int, dtype_bytes: int) -> int:
    """Bytes per token row sink attention's forward holds beyond its outputs: L - s and r
    (fp32, one per row and head) while O is scaled by r in place."""
    return 2 * FP32 * heads


def sink_attention_backward_transient(
    rows: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int, kernel: str
) -> list[int]:
    """The tensors sink attention's backward holds at its peak, for `rows` token rows of
    sequences of `seq` (dq, dk, dv among them): grad * r (one (rows x heads x head_dim) buffer,
    first grad * out for the sinks' row sums), then the kernel's backward. Flash attention
    (mha_bwd): dq, dk, dv, its fp32 dq accumulator and fp32 softmax_d of sequences rounded up
    to 128 rows (head_dim rounded up to 32), and with grouped heads dk and dv expanded to every
    query head before their sum. The memory-efficient kernel: k and v expanded again, dq and
    the expanded dk and dv it returns, its fp32 delta (rows padded to 32), and one more
    q-sized tensor an H100 showed at its peak (b2 x 2048, 64 heads: 66 MiB over the rest,
    not identified in the source). The plain
    path (CPU): fp32 scores, probabilities, their gradient and the expanded q, k, v (per
    (batch, head) every (seq x seq) entry)."""
    p = dtype_bytes
    width = heads * head_dim
    grouped = kv_heads != heads
    scaled = rows * p * width
    dq, dkv = rows * p * width, rows * p * kv_heads * head_dim
    if kernel == "flash":
        batch = -(-rows // seq)
        rounded = batch * (-(-seq // 128) * 128)
        dim = -(-head_dim // 32) * 32 if head_dim <= 192 else 256
        expanded = [rows * p * width] * 2 if grouped else []
        accumulator = rounded * FP32 * heads * dim
        return [scaled, dq, dkv, dkv, accumulator, rounded * FP32 * heads, *expanded]
    if kernel == "efficient":
        batch = -(-rows // seq)
        delta = batch * (-(-seq // 32) * 32) * FP32 * heads
        inputs = [rows * p * width] * 2 if grouped else []
        return [scaled, *inputs, dq, rows * p * width, rows * p * width, delta, scaled]
    square = rows * heads * seq * FP32
    return [scaled, square, square, square, rows * FP32 * width * 3]
