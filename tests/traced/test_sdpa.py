"""SDPA as CUDA runs it: the kernel choice, and the bytes a traced forward saves against those
recorded on an H200 (tests/data/saved_cuda_probe*.json, benchmarks/probe_memory.py saved):
cuDNN, memory-efficient and math-path attention, autocast, one KV head, peft LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memplan.estimators.cudnn import CUDNN_RELEASE
from memplan.estimators.releases import CONTRACTS_RELEASE
from memplan.schema import TrainSetup
from memplan.traced.model import hf_config
from memplan.traced.sdpa import SdpaCall, choose_kernel
from memplan.traced.step import trace_steps
from memplan.versions import installed_versions

DATA = Path(__file__).parents[1] / "data"

# The probes recorded what transformers 5.17's code saved on the GPU; another release's code
# saves what memplan.estimators.releases lists as changed, which the contract tests check live.
RECORDED_RELEASE = pytest.mark.skipif(
    installed_versions()["transformers"] != CONTRACTS_RELEASE,
    reason=f"the H200 probes ran transformers {CONTRACTS_RELEASE}, not the installed release",
)


def call(dtype=torch.bfloat16, head_dim=64, heads=8, kv=8, masked=False, dropout=0.0, **kw):
    return SdpaCall(
        dtype=dtype,
        head_dim_qk=head_dim,
        head_dim_v=head_dim,
        heads_q=heads,
        heads_kv=kv,
        seq_q=kw.get("seq", 1024),
        seq_k=kw.get("seq", 1024),
        masked=masked,
        enable_gqa=kv != heads,
        is_causal=not masked,
        dropout_p=dropout,
    )


@pytest.mark.parametrize(
    "sdpa,capability,kernel",
    [
        (call(), (9, 0), "cudnn"),
        (call(kv=2), (9, 0), "cudnn"),  # grouped KV heads
        (call(masked=True), (9, 0), "cudnn"),
        (call(head_dim=256), (9, 0), "flash"),  # past cuDNN's training head dims
        (call(head_dim=256, masked=True), (9, 0), "efficient"),  # flash takes no mask
        (call(dropout=0.1), (9, 0), "flash"),  # cuDNN: dropout in 1/16 steps only
        (call(dropout=0.125), (9, 0), "cudnn"),
        (call(), (8, 0), "flash"),  # cuDNN comes first on sm90/sm10x only
        (call(dtype=torch.float32), (9, 0), "efficient"),
        (call(dtype=torch.float32, kv=2), (9, 0), "math"),  # no fused fp32 kernel takes GQA
        (call(dtype=torch.float32, head_dim=66), (9, 0), "math"),  # not a multiple of 4
        (call(dtype=torch.float16, head_dim=512), (9, 0), "efficient"),
    ],
)
def test_kernel_choice(sdpa: SdpaCall, capability: tuple[int, int], kernel: str) -> None:
    assert choose_kernel(sdpa, capability) == kernel


@pytest.mark.parametrize(
    "sdpa,kernel",
    [
        (call(head_dim=256), "cudnn"),
        (call(head_dim=256, masked=True, kv=2), "cudnn"),
        (call(head_dim=160), "cudnn"),
        (call(dropout=0.1), "cudnn"),
        (call(head_dim=264), "efficient"),
        (call(head_dim=512, kv=2), "math"),
    ],
)
def test_kernel_choice_on_cudnn_9_19(sdpa: SdpaCall, kernel: str) -> None:
    """What torch 2.11 picked on an H100 with cuDNN 9.19 (docs/traced.md)."""
    assert choose_kernel(sdpa, (9, 0), cudnn=91900) == kernel


def forward_saved(probe: dict, model_type: str, setup: TrainSetup) -> int:
    """Bytes the traced forward leaves saved (the 4-byte held loss taken off)."""
    fields = {**probe["tiny"], **probe["families"][model_type], "model_type": model_type}
    run = trace_steps(hf_config(fields, name=None, trust_remote_code=False), setup, steps=1)
    return sum(run.recorder.storages[k].nbytes for k in run.saved_by_forward) - 4


def probe_bytes(saved: list[dict]) -> int:
    """The probe's bytes less the input ids (traced as inputs) and Gemma's 0-d embedding
    normalizer (a CPU tensor in the GPU run)."""
    return sum(
        t["nbytes"]
        for t in saved
        if t["module"] != "model.embed_tokens" or (t["shape"] and t["dtype"] != "int64")
    )


def cases(name: str, every: int = 1, default_every: int = 1) -> list:
    """Every `every`-th case of the probe; of those, every `default_every`-th in the default run
    and the others under `-m slow`."""
    probe = json.loads((DATA / name).read_text())
    names = [c for c, v in probe["saved"].items() if not isinstance(v, dict)][::every]
    return [
        pytest.param(name, c, id=c, marks=() if i % default_every == 0 else pytest.mark.slow)
        for i, c in enumerate(names)
    ]


# The plain probe lists four setups per family (bf16 SDPA and eager, fp32, amp-bf16): every
# third case by default takes each setup over the families in turn.
@RECORDED_RELEASE
@pytest.mark.parametrize(
    "name,case",
    cases("saved_cuda_probe.json", default_every=3)
    + cases("saved_cuda_probe_lora.json", every=5, default_every=2),
)
def test_forward_saves_what_the_h200_saved(name: str, case: str) -> None:
    probe = json.loads((DATA / name).read_text())
    model_type, precision, attn, *lora = case.split("/")
    options = {}
    if lora:
        options = {"lora_rank": probe["lora"]["r"], "lora_targets": tuple(lora[0].split("+"))}
    setup = TrainSetup(
        batch=probe["batch"], seq=probe["seq"], precision=precision, attn=attn, **options
    )
    assert forward_saved(probe, model_type, setup) == probe_bytes(probe["saved"][case])


@RECORDED_RELEASE
@pytest.mark.parametrize(
    "name,case", [c for c in cases("saved_cuda_probe_kv1.json") if c.id.endswith("/none")]
)
def test_one_kv_head_saves_what_the_h200_saved(name: str, case: str) -> None:
    """One KV head: transformers' repeat_kv is a view, and SDPA saves k and v as they are."""
    probe = json.loads((DATA / name).read_text())
    model_type, precision, _ = case.split("/")
    setup = TrainSetup(batch=probe["batch"], seq=probe["seq"], precision=precision)
    assert forward_saved(probe, model_type, setup) == probe_bytes(probe["saved"][case])


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(12))
def test_kernel_choice_is_the_gpu_s(index: int) -> None:
    """On a GPU, torch's own dispatcher agrees with the emulated choice for the GPU's cuDNN (the
    rules are torch 2.11's; another torch shows here first)."""
    from memplan.traced.sdpa import cuda_choice

    sdpa = [
        call(),
        call(kv=2),
        call(masked=True),
        call(head_dim=256),
        call(head_dim=256, masked=True),
        call(dropout=0.1),
        call(dropout=0.125),
        call(dtype=torch.float32),
        call(dtype=torch.float32, kv=2),
        call(dtype=torch.float32, head_dim=66),
        call(dtype=torch.float16, head_dim=512),
        call(head_dim=80, kv=4),
    ][index]
    capability, cudnn = torch.cuda.get_device_capability(), torch.backends.cudnn.version()
    assert choose_kernel(sdpa, capability, cudnn) == cuda_choice(sdpa)


@pytest.mark.parametrize("causal", [True, False])
def test_math_path_with_dropout_keeps_what_the_math_kernel_keeps_and_a_bool_mask(causal):
    """The traced math path with dropout runs attention.cpp's composite ops itself, so that its
    dropout is CUDA's fused one: on real CPU tensors it saves what the math kernel saves without
    dropout, and with dropout the bool mask and the dropped probabilities besides."""
    from memplan.traced.sdpa import _math_with_fused_dropout

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    mask = None if causal else torch.randn(2, 1, 16, 16)
    gqa = mask is None
    if not gqa:
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)

    def saved(fn) -> tuple[torch.Tensor, list[tuple[int, torch.dtype]]]:
        """The output, and the bytes and dtype of each storage autograd saves."""
        kept = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, sorted(kept.values(), key=str)

    ref, kept_ref = saved(
        lambda: torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, 0.0, causal, None, scale=0.3, enable_gqa=gqa
        )[0]
    )
    out, kept = saved(lambda: _math_with_fused_dropout(q, k, v, mask, 0.0, causal, 0.3, gqa))
    assert torch.allclose(out, ref, atol=1e-6) and kept == kept_ref
    _, kept_dropout = saved(lambda: _math_with_fused_dropout(q, k, v, mask, 0.1, causal, 0.3, gqa))
    scores = 2 * 4 * 16 * 16
    extra = [(scores, torch.bool), (scores * 4, torch.float32)]
    assert sorted(kept + extra, key=str) == kept_dropout


@pytest.mark.parametrize(
    "nope,rope,v,precision",
    [
        (128, 64, 128, "bf16"),  # DeepSeek-V3, Moonlight: q/k 192 with v 128, cuDNN
        (64, 32, 64, "bf16"),  # both at most 128: cuDNN
        (128, 32, 128, "bf16"),  # q/k 160: cuDNN from 9.19 (earlier: memory-efficient)
        (128, 64, 96, "bf16"),  # q/k 192 with v 96: likewise
        (68, 32, 100, "bf16"),  # head dims not multiples of 8: flash, which pads them
        (256, 32, 256, "bf16"),  # q/k 288: over every fused kernel's limit, memory-efficient
        (128, 64, 128, "fp32"),  # fp32 without grouped heads: memory-efficient
    ],
)
def test_latent_attention_kernel_is_the_traced_steps(nope, rope, v, precision) -> None:
    """The analytic contracts pick the SDPA kernel of latent attention's head dims (q/k
    qk_nope + qk_rope, v v_head_dim, as many KV heads as heads, no mask) as the traced step's
    emulation of CUDA (choose_kernel with the cuDNN release both assume) does."""
    from memplan.catalog import resolve_model
    from memplan.estimators.contracts import DtypePlan, attention_path, fused_attention_kernel
    from memplan.estimators.timeline import layer_contexts

    dims = {"qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v}
    spec = resolve_model("deepseek-v3")
    spec = spec.model_copy(update={"head_dim": nope + rope, "rotary_dim": rope, "v_head_dim": v})
    setup = TrainSetup(batch=1, seq=1024, precision=precision)
    ctx = layer_contexts(spec, setup, DtypePlan.of(precision), "cuda")[0]
    path = attention_path(ctx)
    analytic = "efficient" if path == "memory_efficient" else fused_attention_kernel(ctx)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    call = SdpaCall(dtype, nope + rope, v, 128, 128, 1024, 1024, False, False, True)
    assert analytic == choose_kernel(call, cudnn=CUDNN_RELEASE), dims


@pytest.mark.parametrize(
    "name",
    [
        "llama-3.2-1b_b4_s2048_bf16_hf",  # head dim 64, 4 query heads a KV head
        "qwen2.5-1.5b_b4_s2048_bf16_hf",  # head dim 128, 6 a KV head
        "qwen3-0.6b_b4_s1024_bf16_sgd_hf",  # head dim 128, 2 a KV head
        "gemma-2-2b_b2_s1024_bf16_lora16-q_proj-v_proj_rms-rope-geglu-flce_chunk2048",  # 256
    ],
)
def test_cudnn_backward_workspace_is_the_block_the_h100_allocated_per_layer(name: str) -> None:
    import gzip

    from memplan.estimators.allocator import round_size
    from memplan.schema import Measurement
    from memplan.traced.sdpa import backward_scratch_bytes

    path = DATA / "allocator_traces" / f"{name}.json.gz"
    m = Measurement.model_validate_json(gzip.open(path, "rt").read())
    config, setup = m.hf_config, m.setup
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q = torch.empty(setup.batch, heads, setup.seq, head_dim, device="meta", dtype=torch.bfloat16)
    k = torch.empty(setup.batch, kv, setup.seq, head_dim, device="meta", dtype=torch.bfloat16)
    func = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    workspace = round_size(backward_scratch_bytes(func, (q, q, k)))
    blocks = [size for action, _, size in m.allocator_trace if action == "alloc"]
    per_layer_and_step = config["num_hidden_layers"] * m.steps
    assert sum(round_size(size) == workspace for size in blocks) == per_layer_and_step
