"""Which attention shapes cuDNN trains, by cuDNN release: torch-free, so that the analytic
contracts (contracts.fused_attention_kernel) and the traced step's emulation of CUDA's kernel
choice (traced/sdpa.choose_kernel) read one rule."""

from __future__ import annotations

# From this cuDNN release (9.19, seen on an H100) cuDNN attention trains head dims up to 256 with
# any dropout probability; the H200 probe's earlier release took head dims up to 128 (or q/k 192
# with v 128), dropout in 1/16ths.
CUDNN_WIDE_TRAINING = 91900
# The release memplan assumes: what torch 2.11's CUDA 13 wheels run on the measured H100s and
# H200s (torch.backends.cudnn.version(); the H100 traces' head-dim-256 layers ran cuDNN).
CUDNN_RELEASE = 91900


def cudnn_trains(head_dim_qk: int, head_dim_v: int, dropout_p: float, release: int | None) -> bool:
    """check_cudnn_tensor_shapes, check_cudnn_d256_bprop_head_dim and check_cudnn_dropout of
    torch 2.11 for a training step with cuDNN `release` (None: the H200 probe's, before 9.19):
    head dims multiples of 8, within the release's limit, a dropout it takes."""
    wide = release is not None and release >= CUDNN_WIDE_TRAINING
    if wide:
        dims_ok = head_dim_qk <= 256 and head_dim_v <= 256
    else:
        dims_ok = (head_dim_qk <= 128 and head_dim_v <= 128) or (
            head_dim_qk == 192 and head_dim_v == 128
        )
    aligned = head_dim_qk % 8 == 0 and head_dim_v % 8 == 0
    return dims_ok and aligned and (wide or float(dropout_p * 16).is_integer())
