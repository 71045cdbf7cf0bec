"""GPU convergence: for every family a mini model (hidden 1024, 4 layers, the real vocabulary)
trains 30 AdamW steps on fixed random data, unpatched and patched, in fp32 and bf16: the loss
at every step within 1e-4 (fp32) / 1e-2 (bf16) relative of HF's, the final parameters close.

Fresh random tokens every step (fixed by seed) keep training in a smooth regime. A first version
cycled two batches at lr 3e-4: the models memorized them (loss 12 -> 0.5 in 30 steps), a regime
where any rounding difference grows step by step, and the late steps of 9 of 20 runs drifted
past the tolerance (e.g. qwen3_moe fp32, step 27: 0.5112 vs 0.5147). The MoE experts add
nondeterminism of their own (index_add_ with atomics on CUDA): for them the tolerance is at least
twice the drift between two runs of unpatched HF.

In fp32 a MoE model's loss drifts past 1e-4 only through routing flips: where two experts' router
probabilities tie or nearly tie, any rounding difference (memplan's kernels, or one ulp on HF's
own weights) can send a token to the other expert, and from that step on the two runs train
different models (docs/accuracy.md).

    pytest -m gpu tests/patching/test_gpu_convergence.py -s
    pytest -m gpu tests/patching/test_gpu_convergence.py -k "llama or gemma2"   (a subset)"""

from __future__ import annotations

import copy

import pytest
import torch

import memplan.patching as mp
from memplan.families.registry import FAMILIES as REGISTRY

from .tiny_models import FAMILIES, catalog_config, rel_err, shrink

MINI = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2816,
}
STEPS = 30
BATCH, SEQ = 2, 256
# (per-step loss tolerance, final parameters tolerance); parameters as one vector (see
# test_equivalence: Adam turns rounding noise of zero gradients into lr-sized steps)
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (1e-2, 2e-2)}


def _mini_model(family: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = shrink(catalog_config(FAMILIES[family]), MINI, window=128, moe_intermediate=512)
    config.pop("vocab_size", None)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    # Gemma 2's softcap and gpt-oss's sinks have no SDPA path
    attn = "eager" if REGISTRY[config.model_type].sdpa_refused_from else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device="cuda", dtype=dtype).train()


# the experts' index_add_ sums in an order CUDA's atomics pick: HF against itself differs too.
# transformers 5.17's default grouped_mm experts sum by reshape: two runs of HF agree exactly
# (qwen3_moe, qwen3_next, qwen3_5_moe_text fp32 on an H100).
NONDETERMINISTIC = {"mixtral", "qwen3_moe", "qwen3_5_moe_text", "qwen3_next"}
# Gemma 4's fp32 mini model grows step-1 differences of 1e-7 to ~1e-3 by step 30 on an H100
# whichever kernel makes them (docs/accuracy.md): its tolerance is twice what a one-ulp
# perturbation of HF's own weights grows to.
AMPLIFIES_ROUNDING = {("gemma4_text", torch.float32)}
# Routing flips at near-ties (H100, docs/accuracy.md): the patched run agrees within 1.2e-6 at
# every step where both route every token alike, and one token routed elsewhere at steps 12, 25
# and 28 moves the loss by 1.5e-5, 3.5e-5 and 1.3e-4. HF's one-ulp perturbation happens to
# flip none here; in qwen3_moe and qwen3_next it flips routes and drifts by 4.8e-5 and 8.8e-5.
ROUTING_FLIP_DRIFT = {("qwen3_5_moe_text", torch.float32)}


def _perturbed(model):
    """The model with every weight moved by one ulp, up or down at random."""
    perturbed = copy.deepcopy(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            signs = torch.randint(0, 2, p.shape, generator=g, device=p.device) * 2 - 1
            p.mul_(1 + torch.finfo(p.dtype).eps * signs)
    return perturbed


def _batches(vocab: int, device: str = "cuda") -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, -SEQ // 4 :] = -100  # a padded tail
        batches.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return batches


def _train(model, batches) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for inputs in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _step_errors(expected: list[float], actual: list[float]) -> list[float]:
    return [abs(a - e) / abs(e) for e, a in zip(expected, actual)]


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_convergence_matches_hf(family, dtype, request):
    if (family, dtype) in ROUTING_FLIP_DRIFT:
        reason = "a token routed to another expert at a near-tie moves the step-28 loss 1.3e-4"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    reference = _mini_model(family, dtype)
    patched = copy.deepcopy(reference)
    rerun = None
    if (family, dtype) in AMPLIFIES_ROUNDING:
        rerun = _perturbed(reference)
    elif family in NONDETERMINISTIC:
        rerun = copy.deepcopy(reference)
    applied = mp.apply(patched)
    rope = {"rope"} if REGISTRY[family].patched_rope else set()
    # gpt-oss: memplan's sink attention (flash / memory-efficient) against HF's eager
    sinks = {"sink_attention"} if "sink_attention" in REGISTRY[family].kernels("") else set()
    assert {"rms_norm", "flce"} | rope | sinks <= set(applied.kernels)
    batches = _batches(reference.config.vocab_size)
    losses_ref = _train(reference, batches)
    losses_pat = _train(patched, batches)

    loss_tol, param_tol = TOLERANCE[dtype]
    step_errors = _step_errors(losses_ref, losses_pat)
    param_error = rel_err(_flat(patched), _flat(reference))
    if rerun is not None:
        losses_rerun = _train(rerun, batches)
        loss_tol = max(loss_tol, 2 * max(_step_errors(losses_ref, losses_rerun)))
        param_tol = max(param_tol, 2 * rel_err(_flat(rerun), _flat(reference)))
    print(
        f"\n{family} {str(dtype)[6:]}: {applied.kernels}; loss {losses_ref[0]:.4f} -> "
        f"{losses_ref[-1]:.4f}; max step loss error {max(step_errors):.2e} (tol {loss_tol:.1e});"
        f" final parameters error {param_error:.2e} (tol {param_tol:.1e})"
    )
    worst = max(range(STEPS), key=lambda i: step_errors[i])
    assert step_errors[worst] <= loss_tol, (
        f"step {worst}: {losses_pat[worst]} vs HF {losses_ref[worst]}"
    )
    assert param_error <= param_tol
