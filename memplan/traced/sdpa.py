"""Scaled dot-product attention as CUDA runs it, on meta tensors.

On a meta tensor torch's dispatcher picks SDPA's math path (its kernel choice asks the CUDA
device, which a meta tensor has not). The traced step instead routes every
F.scaled_dot_product_attention call through `route`, which picks the kernel CUDA would pick and
calls that kernel's own aten op (_scaled_dot_product_cudnn_attention, _flash_attention,
_efficient_attention, or _scaled_dot_product_attention_math), whose meta function gives the
outputs, and whose autograd formula saves what the GPU saves: q, k, v, the output, the
logsumexp, the philox seed and offset, and the mask where the kernel takes one.

The choice follows sdp_utils.cpp (select_sdp_backend) of torch 2.11 with cuDNN >= 9.15 on
Hopper (sm90), where cuDNN attention comes first (check_prefer_cudnn_attention), then flash,
memory-efficient, math; it is what tests/data/saved_cuda_probe.json recorded on an H200 (cuDNN's
(batch, heads, seq, 1) logsumexp for bf16 with or without a mask, the memory-efficient kernel's
32-padded logsumexp for fp32 without grouped heads, the math path for fp32 with them) and what
estimators/contracts.py (attention_saved, sdpa_math_path) encodes:

  cudnn      fp16/bf16, head dims <= 128 (training; <= 256 from cuDNN 9.19), a multiple of 8;
             dropout a multiple of 1/16 (any from 9.19); grouped KV heads and masks accepted;
             first on sm90 and sm10x only
  flash      fp16/bf16, no mask, head dim <= 256, q, k, v of one head dim; grouped KV heads
             accepted; sm80..sm121
  efficient  fp16/bf16/fp32, head dim a multiple of 8 (fp16/bf16) or 4 (fp32), masks
             accepted, grouped KV heads not (torch 2.11 on CUDA)
  math       everything else: fp32 with grouped KV heads, head dims the fused kernels refuse

The wrapper around the kernels (attention.cpp, scaled_dot_product_attention) is reproduced too:
a boolean mask becomes an additive mask in q's dtype (a new tensor every call, saved by the
kernel), flash pads head dims to a multiple of 8, the memory-efficient kernel pads the mask's
last dimension to a multiple of 8. The math path with dropout runs its composite ops here, so
that its dropout is CUDA's fused one."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memplan.estimators.cudnn import CUDNN_RELEASE, cudnn_trains

aten = torch.ops.aten

Kernel = Literal["cudnn", "flash", "efficient", "math"]
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaCall:
    """What decides the kernel: the inputs' dtype and shapes, the mask and GQA flags."""

    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    masked: bool
    enable_gqa: bool
    is_causal: bool
    dropout_p: float = 0.0


def choose_kernel(
    call: SdpaCall, compute_capability: tuple[int, int] = (9, 0), cudnn: int | None = None
) -> Kernel:
    """The kernel CUDA SDPA runs for this call (torch 2.11; module docstring) with cuDNN release
    `cudnn` (torch.backends.cudnn.version(); None: the release the H200 probe ran)."""
    major = compute_capability[0]
    low = call.dtype in LOW_PRECISION
    grouped = call.heads_kv != call.heads_q
    same_dims = call.head_dim_qk == call.head_dim_v
    ampere_or_newer = (8, 0) <= compute_capability <= (12, 1)
    # cuDNN is preferred on sm90 and sm10x only; elsewhere flash comes first.
    if low and major in (9, 10) and _cudnn_accepts(call, cudnn):
        return "cudnn"
    flash = (
        low
        and ampere_or_newer
        and not call.masked
        and same_dims
        and call.head_dim_qk <= 256
        and not (call.is_causal and call.seq_q != call.seq_k)
    )
    if flash:
        return "flash"
    alignment = 8 if low else 4
    efficient = (
        not grouped
        and call.dtype in (*LOW_PRECISION, torch.float32)
        and call.head_dim_qk % alignment == 0
        and call.head_dim_v % alignment == 0
    )
    if efficient:
        return "efficient"
    if low and major not in (9, 10) and _cudnn_accepts(call, cudnn):
        return "cudnn"
    return "math"


def _cudnn_accepts(call: SdpaCall, cudnn: int | None) -> bool:
    """cudnn_trains (head dims and dropout by release), a key length other than 1 and whole
    groups of query heads per KV head."""
    return (
        cudnn_trains(call.head_dim_qk, call.head_dim_v, call.dropout_p, cudnn)
        and call.seq_k != 1
        and call.heads_q % call.heads_kv == 0
    )


def describe(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> SdpaCall:
    mask = options.get("attn_mask")
    return SdpaCall(
        dtype=query.dtype,
        head_dim_qk=query.shape[-1],
        head_dim_v=value.shape[-1],
        heads_q=query.shape[-3] if query.dim() >= 3 else 1,
        heads_kv=key.shape[-3] if key.dim() >= 3 else 1,
        seq_q=query.shape[-2],
        seq_k=key.shape[-2],
        masked=mask is not None,
        enable_gqa=bool(options.get("enable_gqa", False)),
        is_causal=bool(options.get("is_causal", False)),
        dropout_p=float(options.get("dropout_p", 0.0)),
    )


def describe_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> SdpaCall:
    """The SdpaCall of F.scaled_dot_product_attention's arguments."""
    return describe(
        query,
        key,
        value,
        attn_mask=attn_mask,
        enable_gqa=enable_gqa,
        is_causal=is_causal,
        dropout_p=dropout_p,
    )


def route(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    compute_capability: tuple[int, int] = (9, 0),
) -> tuple[Kernel, torch.Tensor]:
    """F.scaled_dot_product_attention as attention.cpp runs it on CUDA, through the aten op of
    the kernel choose_kernel picks; returns that kernel's name and the output."""
    call = describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if call.heads_kv != call.heads_q and not enable_gqa:
        raise RuntimeError("scaled_dot_product_attention: key heads differ without enable_gqa")
    kernel = choose_kernel(call, compute_capability, CUDNN_RELEASE)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    requires_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if kernel == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, requires_grad, dropout_p, is_causal, False, scale=scale
        )[0]
        return kernel, out
    if kernel == "flash":
        head_dim = query.shape[-1]
        if scale is None:
            scale = head_dim**-0.5
        padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
        out = aten._scaled_dot_product_flash_attention(
            *padded, dropout_p, is_causal, False, scale=scale
        )[0]
        return kernel, out[..., :head_dim] if out.shape[-1] != head_dim else out
    if kernel == "efficient":
        if attn_mask is not None:
            attn_mask = _efficient_mask(attn_mask, query, key)
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, requires_grad, dropout_p, is_causal, scale=scale
        )[0]
        return kernel, out
    if dropout_p > 0 and requires_grad:
        return kernel, _math_with_fused_dropout(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    with _math_kernel():
        out = aten._scaled_dot_product_attention_math(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            None,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]
    return kernel, out


# One entry per _scaled_dot_product_attention_math call running (a checkpointed layer's
# recomputation can run inside another's backward): adds_mask_in_place looks only there.
_math_kernels_running: list[bool] = []


@contextlib.contextmanager
def _math_kernel() -> Iterator[None]:
    _math_kernels_running.append(True)
    try:
        yield
    finally:
        _math_kernels_running.pop()


def adds_mask_in_place(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` is the math path adding the mask to the scores, which attention.cpp does in
    place (`attn.add_(mask)`) unless a tensor is subclass-like, as every tensor is under a
    dispatch mode (isTensorSubclassLike): out of place, the trace would hold one more tensor of
    the scores' size (an H100 allocation trace of qwen3-0.6b in fp32 holds none)."""
    if not _math_kernels_running or func is not aten.add.Tensor or kwargs:
        return False
    scores, mask = args
    return (
        isinstance(scores, torch.Tensor)
        and isinstance(mask, torch.Tensor)
        and scores.dtype == mask.dtype
        and torch.broadcast_shapes(scores.shape, mask.shape) == scores.shape
    )


def _math_with_fused_dropout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """_scaled_dot_product_attention_math's composite ops (attention.cpp), with its dropout
    CUDA's fused native_dropout (a bool mask saved): on meta tensors at::dropout would multiply
    by a noise tensor of the probabilities' dtype instead, as it does on the CPU."""
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    if is_causal:
        causal = torch.ones(
            query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device
        ).tril()
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
        attn_mask = torch.where(causal.logical_not(), float("-inf"), zero)
    if enable_gqa:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, -3)
        value = value.repeat_interleave(groups, -3)
    scores = (query * factor) @ (key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        scores.add_(attn_mask)
    probs = aten._safe_softmax(scores, -1)
    if dropout_p > 0:
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return probs @ value


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """convert_boolean_attn_mask: where(mask, 0, -inf) in q's dtype, the two values 0-d tensors
    on the GPU made first and released last-made first, for cuDNN too (H100 allocation traces of
    gemma-3-1b, whose sliding layers run cuDNN with a mask: no inverted mask is made)."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(
        mask, zero, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    )


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    size = t.shape[-1]
    if size % alignment == 0:
        return t
    return torch.nn.functional.pad(t, (0, alignment - size % alignment))


def _efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: pad the last dimension to a multiple of 8 unless the mask's strides are
    aligned already, then expand to (batch, heads, q, k)."""
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        size = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - size % 8))[..., :size]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def backward_scratch_bytes(func: torch._ops.OpOverload, args: tuple) -> int:
    """Bytes an attention backward kernel allocates on the GPU beside its outputs and frees
    before it returns (invisible on meta tensors).

    cuDNN: its graph's workspace, one block: fp32 tensors of q's size, two for a causal (or
    unmasked) call with grouped KV heads and one with a mask or as many KV heads as query heads,
    an fp32 (batch, heads, q) row statistic and 512 bytes of alignment (every cuDNN backward of
    the recorded H100 traces, head dims 64-256, sliding-window masks among them; an H200 probe
    of head dims 64-256 and 1-32 KV heads of 32, causal: docs/fit_verdict.md). Flash: an fp32
    dq accumulator of q's size (dq_accum); with grouped heads it also expands dk and dv to every
    query head before summing them (mha_bwd).
    Memory-efficient: an fp32 (batch, heads, q) delta and, in fp16/bf16, an fp32 dq
    accumulator."""
    name = func.overloadpacket.__name__
    if name not in _BACKWARDS:
        return 0
    query, key = args[1], args[2]
    b, h, t, d = query.shape
    rows = b * h * t
    if name == "_scaled_dot_product_efficient_attention_backward":
        accumulator = rows * d * 4 if query.dtype in LOW_PRECISION else 0
        return rows * 4 + accumulator
    if name == "_scaled_dot_product_cudnn_attention_backward":
        masked = len(args) > 8 and args[8] is not None  # args[8]: the additive mask (attn_bias)
        q_sized = 1 if masked or key.shape[1] == h else 2
        return q_sized * rows * d * 4 + rows * 4 + CUDNN_WORKSPACE_ALIGNMENT
    scratch = rows * d * 4
    if name == "_scaled_dot_product_flash_attention_backward" and key.shape[1] != h:
        scratch += 2 * b * h * key.shape[2] * d * key.element_size()
    return scratch


# What cuDNN's backward workspace holds beyond its tensors (256 or 512 bytes in the traces,
# 512 once the allocator rounds).
CUDNN_WORKSPACE_ALIGNMENT = 512

_BACKWARDS = (
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
)


def cuda_choice(call: SdpaCall, device: str = "cuda") -> str:
    """The kernel torch's own dispatcher picks for this call on the GPU at hand
    (torch._fused_sdp_choice on small CUDA tensors of the call's dtypes, heads, head dims and
    mask; batch 1): what choose_kernel emulates, for checking it where a GPU is."""
    from torch.nn.attention import SDPBackend

    def tensor(heads: int, seq: int, dim: int) -> torch.Tensor:
        shape = (1, heads, seq, dim)
        return torch.zeros(shape, dtype=call.dtype, device=device, requires_grad=True)

    q = tensor(call.heads_q, call.seq_q, call.head_dim_qk)
    k = tensor(call.heads_kv, call.seq_k, call.head_dim_qk)
    v = tensor(call.heads_kv, call.seq_k, call.head_dim_v)
    mask = (
        torch.ones((1, 1, call.seq_q, call.seq_k), dtype=torch.bool, device=device)
        if call.masked
        else None
    )
    choice = torch._fused_sdp_choice(
        q, k, v, mask, call.dropout_p, call.is_causal, scale=None, enable_gqa=call.enable_gqa
    )
    names = {
        int(SDPBackend.CUDNN_ATTENTION.value): "cudnn",
        int(SDPBackend.FLASH_ATTENTION.value): "flash",
        int(SDPBackend.EFFICIENT_ATTENTION.value): "efficient",
        int(SDPBackend.MATH.value): "math",
    }
    return names.get(int(choice), f"backend {choice}")
