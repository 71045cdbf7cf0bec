"""The allocation tracker against torch.cuda-free references: the same tiny model run for real on
the CPU gives the bytes autograd saves (saved_tensors_hooks), the parameters, the gradients and
the optimizer states; the traced step on meta tensors must record exactly those bytes."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memplan.estimators.events import EventLog
from memplan.estimators.releases import CONTRACTS_RELEASE
from memplan.schema import TrainSetup
from memplan.traced.autocast import Autocast
from memplan.traced.emulation import CudaSemantics
from memplan.traced.estimate import event_log
from memplan.traced.model import hf_config
from memplan.traced.sdpa import CUDNN_WORKSPACE_ALIGNMENT
from memplan.traced.step import (
    TracedRun,
    make_optimizer,
    rotary_embeddings_without_autocast,
    trace_steps,
)
from memplan.traced.tracker import AllocationTracker, Recorder
from memplan.versions import installed_versions
from tests.traced.tiny import UNREGISTERED, tiny

BATCH, SEQ = 2, 24
FAMILIES = ["llama", "qwen3", "gemma2", "phi3", "mixtral", "olmo3", *UNREGISTERED]


def traced(family: str, steps: int = 1, **setup) -> TracedRun:
    config = hf_config(tiny(family), name=None, trust_remote_code=False)
    setup = TrainSetup(batch=BATCH, seq=SEQ, **setup)
    return trace_steps(config, setup, steps=steps)


def cpu_model(family: str, dtype: torch.dtype, attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    fields = tiny(family)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).train()


def cpu_saved(family: str, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of the storages autograd saves in one CPU forward that are still saved when it
    returns (a saved tensor of a branch the loss does not use, such as topk's indices when only
    its values are, goes with that branch), parameters excluded; and the input ids' bytes.
    Gemma scales the embedding by torch.tensor(sqrt(hidden)), made without a device: in the GPU
    run that 0-d tensor stays on the CPU, so it does not count."""
    model = cpu_model(family, dtype)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, weakref.ref] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[id(storage)] = weakref.ref(storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    total = sum(s.nbytes() for ref in saved.values() if (s := ref()) is not None)
    del loss
    if family.startswith("gemma"):
        total -= dtype.itemsize
    return total, ids.nbytes


def tagged_bytes(run: TracedRun, tag: str) -> int:
    return sum(s.nbytes for s in run.recorder.storages.values() if s.tag == tag)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_saves_what_autograd_saves_on_the_cpu(family: str) -> None:
    """Eager attention in fp32 runs the same ops on both devices: the storages the traced forward
    leaves alive are those autograd saves on the CPU, less the input ids (traced as inputs, not
    made by the forward), plus the 4-byte loss the protocol holds."""
    saved, ids = cpu_saved(family, torch.float32)
    run = traced(family, precision="fp32", attn="eager")
    forward = sum(run.recorder.storages[k].nbytes for k in run.saved_by_forward)
    assert forward == saved - ids + 4


@pytest.mark.parametrize("family", ["llama", "gemma", "olmoe"])
def test_bf16_forward_saves_what_autograd_saves_on_the_cpu(family: str) -> None:
    saved, ids = cpu_saved(family, torch.bfloat16)
    run = traced(family, precision="bf16", attn="eager")
    forward = sum(run.recorder.storages[k].nbytes for k in run.saved_by_forward)
    assert forward == saved - ids + 4


@pytest.mark.parametrize(
    "family,optimizer", [("llama", "adamw"), ("gpt2", "sgd-momentum"), ("olmoe", "adam")]
)
def test_weights_gradients_and_states_match_a_cpu_step(family: str, optimizer: str) -> None:
    """Parameter, gradient and optimizer-state bytes of a real CPU step (bf16 weights)."""
    model = cpu_model(family, torch.bfloat16)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], optimizer)
    opt.step()
    states = sum(
        v.nbytes
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    weights = sum(t.untyped_storage().nbytes() for t in model.parameters()) + sum(
        b.nbytes for b in model.buffers()
    )
    run = traced(family, optimizer=optimizer, attn="eager")
    assert tagged_bytes(run, "weights") == weights
    assert sum(run.recorder.storages[k].nbytes for k in run.gradients) == grads
    assert sum(run.recorder.storages[k].nbytes for k in run.optimizer_states) == states


def test_lora_counts_the_adapters_peft_adds() -> None:
    peft = pytest.importorskip("peft")
    model = cpu_model("llama", torch.bfloat16)
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    run = traced("llama", lora_rank=4, lora_targets=("q_proj", "v_proj"))
    assert run.trainable_params == trainable > 0
    assert run.params == sum(p.numel() for p in model.parameters())


def _replay(log: EventLog) -> tuple[int, dict[int, int]]:
    alive: dict[int, int] = {}
    for e in log.events:
        if e.action == "alloc":
            assert e.tensor not in alive and e.nbytes > 0
            alive[e.tensor] = e.nbytes
        else:
            assert alive.pop(e.tensor) == e.nbytes
    return sum(alive.values()), alive


@pytest.mark.parametrize("setup", [{}, {"grad_checkpointing": True}, {"grad_accum": 2}])
def test_every_release_follows_its_allocation(setup: dict) -> None:
    """The event stream of two steps: each id allocated once and released at most once; what
    stays is the weights, the optimizer states, the two cuBLAS workspaces, the input ids and the
    held loss."""
    run = traced("qwen3", steps=2, **setup)
    left, alive = _replay(event_log(run))
    categories = {e.tensor: e.category for e in event_log(run).events}
    kinds = {categories[t] for t in alive}
    assert kinds == {"weights", "optimizer_states", "cublas_workspace", "inputs", "logits_and_loss"}
    assert tagged_bytes(run, "cublas_workspace") == 2 * 32 * 2**20
    loss = [t for t in alive if categories[t] == "logits_and_loss"]
    assert [alive[t] for t in loss] == [4]


def _rotary_dtypes(hooked: bool) -> tuple[torch.dtype, torch.dtype]:
    """cos/sin's dtypes from OLMo 3's rotary embedding under the emulated autocast."""
    fields = tiny("olmo3")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    autocast = Autocast(torch.bfloat16, enabled=True)
    handles = rotary_embeddings_without_autocast(model, autocast) if hooked else []
    hidden = torch.empty(BATCH, SEQ, config.hidden_size, device="meta")
    positions = torch.arange(SEQ, device="meta")[None]
    with CudaSemantics(autocast, (9, 0)):
        cos, sin = model.model.rotary_emb(hidden, positions, "full_attention")
    for handle in handles:
        handle.remove()
    assert autocast.enabled
    return cos.dtype, sin.dtype


def test_rotary_embeddings_compute_without_autocast() -> None:
    """transformers computes cos/sin with autocast off (maybe_autocast(enabled=False), a no-op on
    meta tensors): under the emulated autocast they come out fp32, as OLMo keeps them."""
    assert _rotary_dtypes(hooked=True) == (torch.float32, torch.float32)


@pytest.mark.skipif(
    installed_versions()["transformers"] != CONTRACTS_RELEASE,
    reason="transformers 5.24 computes cos/sin in fp32 without the traced step's hooks",
)
def test_without_the_hooks_the_emulation_would_compute_cos_sin_in_bf16() -> None:
    assert _rotary_dtypes(hooked=False) == (torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softmax_backward_forms_its_product_beside_its_output(dtype: torch.dtype) -> None:
    """CUDA's softmax backward holds grad * output beside the d(input) it writes: a transient of
    the fp32 gradient's size recorded after that output, freed before the next op."""
    recorder = Recorder()
    scores = torch.empty(2, 3, 5, 7, device="meta", dtype=dtype, requires_grad=True)
    with AllocationTracker(recorder):
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs.sum().backward()
    fp32_bytes = scores.numel() * 4
    transients = [r for r in recorder.records if recorder.storages[r.key].tag == "transient"]
    assert [(r.action, r.nbytes) for r in transients] == [
        ("alloc", fp32_bytes),
        ("free", fp32_bytes),
    ]
    before = recorder.records[: recorder.records.index(transients[0])]
    assert before[-1].action == "alloc"  # d(scores), alive with the product


@pytest.mark.parametrize("family, tied", [("llama", True), ("mixtral", False)])
def test_the_build_gives_a_tied_head_a_weight_of_its_own_first(family: str, tied: bool) -> None:
    """As the GPU's build does (every tied model's H100 allocation trace): the weights in
    registration order, then a block of the embedding's size made and released where the head
    is tied to the embedding; LoRA's adapters after that."""

    def weights(run: TracedRun) -> list:
        return [r for r in run.recorder.records if run.recorder.storages[r.key].tag == "weights"]

    built = len(weights(traced(family)))
    run = traced(family, lora_rank=4, lora_targets=("q_proj",))
    records = run.recorder.records
    last_built, first_adapter = (records.index(r) for r in weights(run)[built - 1 : built + 1])
    between = [(r.action, r.nbytes) for r in records[last_built + 1 : first_adapter]]
    embedding_bytes = 256 * 64 * 2
    assert between == ([("alloc", embedding_bytes), ("free", embedding_bytes)] if tied else [])


def test_autograd_sums_a_tensors_gradients_in_place_where_cuda_does() -> None:
    """x feeds two products: autograd adds the second gradient into the first (CUDA's
    InputBuffer::accumulate), making no third block; where the gradients are shared with other
    tensors (here views a hook keeps) it adds out of place."""

    def gradient_blocks(keep_views: bool) -> int:
        recorder = Recorder()
        x = torch.empty(64, 32, device="meta", requires_grad=True)
        kept: list[torch.Tensor] = []
        with AllocationTracker(recorder):
            y, z = x * 2, x * 3
            if keep_views:
                for node in (y.grad_fn, z.grad_fn):
                    node.register_hook(lambda grads, _: kept.append(grads[0][:1]))
            torch.autograd.backward([y, z], [torch.ones_like(y), torch.ones_like(z)])
        size = x.numel() * x.element_size()
        blocks = [r for r in recorder.records if r.action == "alloc" and r.nbytes == size]
        return len(blocks) - 4  # y, z and the two gradients given for them

    assert gradient_blocks(keep_views=False) == 2
    assert gradient_blocks(keep_views=True) == 3


def test_autocast_runs_out_variants_as_called() -> None:
    """CUDA autocast registers the ops' functional overloads only: an addmm into an fp32 `out`
    (FLCE's fp32 accumulator under amp) keeps its fp32 output, where a cast copy would not
    take the result."""
    autocast = Autocast(torch.bfloat16, enabled=True)
    a = torch.empty(4, 8, device="meta", dtype=torch.bfloat16)
    out = torch.empty(4, 4, device="meta")
    args, kwargs = autocast.apply(torch.addmm, (out, a, a.t()), {"out": out})
    assert args[0] is out and kwargs["out"] is out
    args, _ = autocast.apply(torch.addmm, (out, a, a.t()), {})
    assert args[0].dtype == torch.bfloat16


def _math_attention_records(is_causal: bool) -> tuple[list[tuple[str, int]], int]:
    """The (action, bytes) records of one fp32 SDPA call with grouped heads (the math path), and
    the number of its attention scores."""
    recorder = Recorder()
    q = torch.empty(2, 4, 64, 32, device="meta", requires_grad=True)
    k, v = (torch.empty(2, 2, 64, 32, device="meta", requires_grad=True) for _ in range(2))
    mask = None if is_causal else torch.zeros(2, 1, 64, 64, device="meta")
    with AllocationTracker(recorder), CudaSemantics(None, (9, 0)):
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True
        )
    kept = [r for r in recorder.records if recorder.storages[r.key].tag != "cublas_workspace"]
    return [(r.action, r.nbytes) for r in kept], 2 * 4 * 64 * 64


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "masked"])
def test_math_attention_adds_its_mask_in_place_and_masks_empty_rows_beside_the_probs(
    is_causal: bool,
) -> None:
    """SDPA's math path as an H100 allocation trace of qwen3-0.6b in fp32 has it: the scores,
    the probabilities, then _safe_softmax's bool of the scores' size, its bool per row and a
    0-d zero, freed last-made first, then the scores. No third block of the scores' size
    (attention.cpp adds the mask in place where no dispatch mode runs)."""
    records, scores = _math_attention_records(is_causal)
    first = records.index(("alloc", scores * 4))
    assert records[first : first + 9] == [
        ("alloc", scores * 4),
        ("alloc", scores * 4),
        ("alloc", scores),
        ("alloc", scores // 64),
        ("alloc", 4),
        ("free", 4),
        ("free", scores // 64),
        ("free", scores),
        ("free", scores * 4),
    ]
    assert records.count(("alloc", scores * 4)) == 2


@pytest.mark.parametrize(
    "masked,kv_heads,q_sized",
    [(False, 2, 2), (False, 4, 1), (True, 4, 1)],
    ids=["causal-grouped", "causal", "masked"],
)
def test_cudnn_attention_backward_takes_the_workspace_the_gpu_shows(
    masked: bool, kv_heads: int, q_sized: int
) -> None:
    """cuDNN's backward workspace: an fp32 per query row, fp32 blocks of q's size (two with
    grouped KV heads, as every H100 trace of a causal grouped-head model shows; one with as many
    KV heads as query heads, as an H200 probe shows, or where the kernel is given a bias:
    gemma-3-1b's sliding layers, 16 MiB + 64 KiB, its full layers 32 MiB + 64 KiB) and 512
    bytes of alignment."""
    recorder = Recorder()
    q = torch.empty(2, 4, 64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.empty(2, kv_heads, 64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    mask = torch.ones(64, 64, device="meta", dtype=torch.bool).tril() if masked else None
    with AllocationTracker(recorder), CudaSemantics(None, (9, 0)) as semantics:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not masked, enable_gqa=kv_heads != 4
        )
        out.sum().backward()
    assert dict(semantics.kernels) == {"cudnn": 1}
    rows = 2 * 4 * 64
    workspace = [r.nbytes for r in recorder.records if recorder.storages[r.key].tag == "transient"]
    assert workspace == [rows * 4 + q_sized * rows * 32 * 4 + CUDNN_WORKSPACE_ALIGNMENT] * 2
