"""GPU: a patched model under torch.compile (inductor, fullgraph) trains like unpatched HF.

The CPU test (test_integrations) traces with aot_eager; this one lets inductor generate code
around memplan's custom ops and runs it: mini models (hidden 1024, 4 layers, the real
vocabulary), bf16, fresh random tokens each step, AdamW, per-step loss within 1e-2 relative of
eager unpatched HF.

    pytest -m gpu tests/patching/test_gpu_compile.py -s"""

from __future__ import annotations

import copy

import pytest
import torch

import memplan.patching as mp

from .test_gpu_convergence import _batches, _mini_model, _step_errors, _train

STEPS = 6
LOSS_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_compiled_patched_model_trains_like_hf(family):
    torch._dynamo.reset()
    reference = _mini_model(family, torch.bfloat16)
    patched = copy.deepcopy(reference)
    applied = mp.apply(patched)
    assert {"rms_norm", "rope", "flce"} <= set(applied.kernels)
    compiled = torch.compile(patched, fullgraph=True)
    batches = _batches(reference.config.vocab_size)[:STEPS]

    losses_ref = _train(reference, batches)
    losses_compiled = _train(compiled, batches)

    step_errors = _step_errors(losses_ref, losses_compiled)
    print(
        f"\n{family} compiled: {applied.kernels}; loss {losses_ref[0]:.4f} -> "
        f"{losses_ref[-1]:.4f}; max step loss error {max(step_errors):.2e}"
    )
    assert max(step_errors) <= LOSS_TOL, (losses_ref, losses_compiled)
    assert mp.applied_patch(compiled) is not None
