"""The estimator's activation bytes equal the bytes autograd really saves in one forward of the
Hugging Face model: live on the CPU for every family, and against the probe recorded on an H200
(tests/data/saved_cuda_probe.json, from tools/record_saved_tensors.py) for the families it
recorded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memplan.catalog import spec_from_config
from memplan.estimators.releases import Release
from memplan.estimators.timeline import forward_saved
from memplan.schema import TrainSetup
from memplan.versions import installed_versions

# The live forwards run the installed transformers; the H200 probe ran the contracts' release.
INSTALLED = installed_versions()["transformers"]
PROBE = json.loads((Path(__file__).parent / "data" / "saved_cuda_probe.json").read_text())
CASES = sorted(PROBE["saved"])


def recorder_families() -> dict[str, dict]:
    """The config overrides tools/record_saved_tensors.py records each family with."""
    tool = Path(__file__).resolve().parents[1] / "tools" / "record_saved_tensors.py"
    spec = importlib.util.spec_from_file_location("record_saved_tensors", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FAMILIES


# Families the recorder knows and the H200 probe has not recorded yet: checked on the CPU only.
CPU_ONLY_FAMILIES = {
    name: overrides
    for name, overrides in recorder_families().items()
    if name not in PROBE["families"]
}


def attentions(model_type: str) -> tuple[str, ...]:
    """The attention implementations the installed transformers builds the family with."""
    refused = Release.of(INSTALLED).refuses_sdpa(model_type)
    return ("eager",) if refused else ("sdpa", "eager")


def default_case(case: str) -> bool:
    """A family's bf16 case with its first attention runs by default, the others under slow."""
    model_type = case.split("/")[0]
    return case == f"{model_type}/bf16/{attentions(model_type)[0]}"


def family_overrides(model_type: str) -> dict:
    family = PROBE["families"].get(model_type)
    return {**PROBE["tiny"], **(CPU_ONLY_FAMILIES[model_type] if family is None else family)}


def probe_config(model_type: str) -> dict:
    return AutoConfig.for_model(model_type, **family_overrides(model_type)).to_dict()


def predicted(
    model_type: str, precision: str, attn: str, backend: str, transformers: str | None = None
) -> int:
    spec = spec_from_config(probe_config(model_type))
    setup = TrainSetup(
        batch=PROBE["batch"],
        seq=PROBE["seq"],
        precision=precision,
        attn=attn,
        transformers=transformers,
    )
    return forward_saved(spec, setup, backend=backend, rounded=False).total


def saved_bytes_live(saved_storage_bytes, model_type: str, precision: str, attn: str) -> int:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **family_overrides(model_type))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn).train()
    return saved_bytes_of(
        saved_storage_bytes, model, cfg.vocab_size, autocast=precision.startswith("amp")
    )


def saved_bytes_of(saved_storage_bytes, model: torch.nn.Module, vocab: int, autocast: bool) -> int:
    """One forward on the CPU: the unique storages autograd saves and keeps for backward,
    parameters excluded (the conftest fixture `saved_storage_bytes`)."""
    ids = torch.randint(0, vocab, (PROBE["batch"], PROBE["seq"]))

    def forward() -> object:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, labels=ids)

    return saved_storage_bytes(forward, model)


@pytest.mark.parametrize("case", CASES)
def test_matches_h200_probe(case: str) -> None:
    measured = PROBE["saved"][case]
    if isinstance(measured, dict):
        pytest.skip(f"the probe could not run this case on the GPU: {measured['error'][:80]}")
    model_type, precision, attn = case.split("/")
    measured_bytes = sum(t["nbytes"] for t in measured)
    assert predicted(model_type, precision, attn, "cuda") == measured_bytes


LIVE = [c for c in CASES if not c.startswith("gemma2/") or c.endswith("/eager")]
LIVE += [
    case if default_case(case) else pytest.param(case, marks=pytest.mark.slow)
    for case in (
        f"{family}/{precision}/{attn}"
        for family in CPU_ONLY_FAMILIES
        for precision in ("bf16", "fp32")
        for attn in attentions(family)
    )
]


@pytest.mark.parametrize("case", LIVE)
def test_matches_autograd_on_cpu(case: str, saved_storage_bytes) -> None:
    model_type, precision, attn = case.split("/")
    if precision.startswith("amp"):
        pytest.skip("CPU autocast casts other ops than CUDA autocast; checked against the probe")
    measured = saved_bytes_live(saved_storage_bytes, model_type, precision, attn)
    assert predicted(model_type, precision, attn, "cpu", INSTALLED) == measured


CPU_ONLY_CASES = [
    f"{family}/{precision}/{attn}"
    for family in CPU_ONLY_FAMILIES
    for precision in ("bf16", "fp32")
    for attn in attentions(family)
]


@pytest.mark.parametrize(
    "case",
    [c if default_case(c) else pytest.param(c, marks=pytest.mark.slow) for c in CPU_ONLY_CASES],
)
def test_unprobed_family_matches_autograd_on_cpu(case: str, saved_storage_bytes) -> None:
    """seed_oss on the CPU: its dropouts (at::dropout's noise, of the input's dtype, where CUDA's
    fused kernel keeps a bool mask; SDPA's math path, in fp32, where the CPU's fused kernel takes
    no dropout) and its attention biases. smollm3: a layer without RoPE, windowed. granite: its
    multipliers save nothing (products with a number). gpt_oss: eager attention with sinks
    (the (seq + 1)-wide softmax, the row max's indices), half-width cos/sin, the biased top-k
    router and clamped experts."""
    model_type, precision, attn = case.split("/")
    measured = saved_bytes_live(saved_storage_bytes, model_type, precision, attn)
    assert predicted(model_type, precision, attn, "cpu", INSTALLED) == measured


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    "model_type,targets,precision,attn",
    [
        ("llama", ("q_proj", "k_proj", "v_proj", "o_proj"), "bf16", "sdpa"),
        ("qwen3", ("q_proj", "v_proj"), "bf16", "sdpa"),
        ("gemma", ("q_proj", "v_proj", "gate_proj"), "bf16", "sdpa"),
        ("phi3", ("qkv_proj",), "bf16", "sdpa"),
        ("mixtral", ("q_proj", "v_proj"), "bf16", "sdpa"),
        # The first layer saves nothing before its first adapter; a frozen down_proj saves no
        # input; in fp32 adapters that share an input save it once.
        ("llama", ("gate_proj", "up_proj", "down_proj"), "bf16", "sdpa"),
        ("llama", ("o_proj",), "bf16", "sdpa"),
        ("llama", ("gate_proj", "up_proj", "down_proj"), "fp32", "sdpa"),
        ("llama", ALL_LINEAR, "fp32", "sdpa"),
        ("qwen2", ("q_proj", "v_proj"), "fp32", "sdpa"),
        # phi3's copy of SDPA's output is kept by a trainable o_proj or an fp32 adapter only.
        ("phi3", ("o_proj",), "bf16", "sdpa"),
        # Eager attention in the first layer keeps q only if k needs a gradient, k only if q
        # does, v and the fp32 probabilities only if the scores do.
        ("llama", ("q_proj", "v_proj"), "bf16", "eager"),
        ("llama", ("v_proj",), "fp32", "eager"),
        ("gemma2", ("k_proj",), "bf16", "eager"),
        # Ministral 3's query factor is saved where q needs a gradient: not in the first layer
        # when q_proj is not adapted.
        ("ministral3", ("q_proj", "v_proj"), "bf16", "sdpa"),
        ("ministral3", ("v_proj",), "fp32", "eager"),
        # OLMo: adapters read the residual stream; q/k norms over the whole projection
        ("olmo2", ("q_proj", "v_proj"), "bf16", "sdpa"),
        ("olmo2", ALL_LINEAR, "fp32", "sdpa"),
        # the first layer (sliding) saves no rotation: its cos/sin pair is not kept
        ("olmo3", ("gate_proj", "up_proj", "down_proj"), "bf16", "sdpa"),
        ("olmo3", ("k_proj",), "fp32", "eager"),
        # seed_oss: dropout after o_proj and down_proj keeps its noise only where a gradient
        # flows through it (o_proj adapted, q/k/v frozen in the first layer)
        ("seed_oss", ("o_proj", "down_proj"), "bf16", "eager"),
        pytest.param("seed_oss", ("v_proj",), "fp32", "sdpa", marks=pytest.mark.slow),
        pytest.param("smollm3", ("k_proj",), "fp32", "eager", marks=pytest.mark.slow),
        pytest.param("granite", ("q_proj", "down_proj"), "bf16", "sdpa", marks=pytest.mark.slow),
        # glm4_moe: the frozen fp32 router keeps its weight's fp32 copy and no input; a
        # heads-major q (half of each head rotated) makes SDPA's output a copy for o_proj
        ("glm4_moe", ("q_proj", "v_proj"), "bf16", "sdpa"),
        pytest.param("glm4_moe", ("k_proj", "o_proj"), "fp32", "eager", marks=pytest.mark.slow),
        # deepseek_v3: the first layer keeps a latent's norm only where its down-projection is
        # adapted, the rotation where q or the shared rotated key needs a gradient; fp32
        # adapters on q_a_proj and kv_a_proj_with_mqa share the input norm's output
        ("deepseek_v3", ("q_b_proj", "kv_b_proj"), "bf16", "sdpa"),
        ("deepseek_v3", ("kv_a_proj_with_mqa",), "fp32", "eager"),
        pytest.param(
            "deepseek_v3",
            ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
            "fp32",
            "sdpa",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "deepseek_v3", ("q_a_proj", "o_proj"), "bf16", "eager", marks=pytest.mark.slow
        ),
        # Gemma 4: the full layer has no v_proj to adapt (its values are its keys); v_norm keeps
        # what it needs only where v needs a gradient
        ("gemma4_text", ("q_proj", "v_proj"), "bf16", "sdpa"),
        pytest.param("gemma4_text", ALL_LINEAR, "fp32", "eager", marks=pytest.mark.slow),
        pytest.param("gemma4_text", ("k_proj",), "bf16", "eager", marks=pytest.mark.slow),
        # sinks: the first layer keeps the softmax output only where the scores need a gradient,
        # else matmul(probs, v) keeps its storage for v's; frozen experts keep no bias index
        pytest.param("gpt_oss", ("q_proj", "v_proj"), "bf16", "eager", marks=pytest.mark.slow),
        pytest.param("gpt_oss", ("v_proj",), "fp32", "eager", marks=pytest.mark.slow),
        # Llama 4: frozen experts keep neither their input nor the product before down_proj;
        # the first layer keeps no L2 norm of q, nor k, where neither needs a gradient
        ("llama4_text", ("q_proj", "v_proj"), "bf16", "sdpa"),
        pytest.param("llama4_text", ("v_proj",), "fp32", "eager", marks=pytest.mark.slow),
        pytest.param("llama4_text", ("k_proj", "o_proj"), "bf16", "eager", marks=pytest.mark.slow),
        # Qwen3.5: where q_proj's output needs no gradient, the product with the output gate
        # keeps neither the attention output nor its copy, and o_proj's adapter the product
        ("qwen3_5_text", ("k_proj", "o_proj"), "fp32", "eager"),
        pytest.param("qwen3_5_text", ("v_proj",), "bf16", "sdpa", marks=pytest.mark.slow),
        # Qwen3.5-MoE: the DeltaNet layer before the first adapter saves nothing; the frozen
        # shared expert and its gate keep the product's factors only
        ("qwen3_5_moe_text", ("q_proj", "v_proj"), "bf16", "sdpa"),
        pytest.param("qwen3_5_moe_text", ("o_proj",), "fp32", "eager", marks=pytest.mark.slow),
        pytest.param(
            "qwen3_5_moe_text", ("k_proj", "o_proj"), "fp32", "sdpa", marks=pytest.mark.slow
        ),
        # Qwen3-Next: as Qwen3.5-MoE, its DeltaNet's projections fused
        ("qwen3_next", ("q_proj", "v_proj"), "bf16", "sdpa"),
        pytest.param("qwen3_next", ("k_proj", "o_proj"), "fp32", "eager", marks=pytest.mark.slow),
    ],
)
def test_lora_matches_autograd_on_cpu(
    model_type: str, targets: tuple[str, ...], precision: str, attn: str, saved_storage_bytes
) -> None:
    """peft LoRA (fp32 adapters on a frozen base): only what the adapters' gradients need."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **family_overrides(model_type))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(model, config).train()
    measured = saved_bytes_of(saved_storage_bytes, model, cfg.vocab_size, autocast=False)
    spec = spec_from_config(probe_config(model_type))
    setup = TrainSetup(
        batch=PROBE["batch"],
        seq=PROBE["seq"],
        precision=precision,
        attn=attn,
        lora_rank=16,
        lora_targets=targets,
        transformers=INSTALLED,
    )
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total == measured


@pytest.mark.parametrize(
    "model_type,kernels,precision,lora_targets",
    [
        ("llama", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                ("llama", ("rms_norm", "rope", "swiglu", "flce"), "fp32", ()),
                ("gemma", ("rms_norm", "rope", "geglu", "flce"), "bf16", ()),
                ("qwen3", ("rms_norm", "rope", "swiglu", "cross_entropy"), "bf16", ()),
                ("phi3", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
                ("mixtral", ("rms_norm", "rope", "flce"), "bf16", ()),
                ("ministral3", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
                ("ministral3", ("rms_norm", "rope", "swiglu", "flce"), "fp32", ()),
                # the RoPE kernel gives q a gradient with k's: the factor is saved with it
                ("ministral3", ("rope",), "bf16", ("k_proj",)),
                ("olmo2", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
                ("olmo2", ("rms_norm", "rope", "swiglu", "flce"), "fp32", ()),
                ("olmo3", ("rms_norm", "rope", "swiglu", "cross_entropy"), "bf16", ()),
                ("olmo3", ("rms_norm", "rope"), "bf16", ("gate_proj", "up_proj")),
                ("seed_oss", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
                ("smollm3", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
                # lm_head keeps the hidden states divided by logits_scaling, not the norm's output
                ("granite", ("rms_norm", "rope", "swiglu", "cross_entropy"), "bf16", ()),
                ("granite", ("rms_norm", "rope", "swiglu", "flce"), "fp32", ()),
                ("glm4_moe", ("rms_norm", "rope", "swiglu", "cross_entropy"), "fp32", ()),
                ("glm4_moe", ("rope",), "bf16", ("q_proj",)),
                # v_norm, without a weight, keeps HF's forward beside the kernels' norms
                ("gemma4_text", ("rms_norm", "rope", "geglu", "flce"), "bf16", ()),
                ("gemma4_text", ("rms_norm", "rope", "geglu", "cross_entropy"), "fp32", ()),
                ("gemma4_text", ("rms_norm", "rope"), "bf16", ("k_proj", "o_proj")),
                # the RoPE kernel on half-width cos/sin, eager attention with sinks
                ("gpt_oss", ("rms_norm", "rope", "flce"), "bf16", ()),
                ("gpt_oss", ("rms_norm", "rope", "cross_entropy"), "fp32", ()),
                ("gpt_oss", ("rope",), "bf16", ("v_proj",)),
                # memplan's RMSNorm keeps the sliced kv latent whole (fp32 as bf16)
                ("deepseek_v3", ("rms_norm", "swiglu", "flce"), "fp32", ()),
                ("deepseek_v3", ("rms_norm",), "bf16", ("q_a_proj", "kv_b_proj")),
                ("gpt_oss", ("rms_norm", "rope", "sink_attention", "cross_entropy"), "fp32", ()),
                ("gpt_oss", ("rope", "sink_attention"), "bf16", ("q_proj",)),
                # the shared expert's GLU kernel; the attention keeps its forward
                ("llama4_text", ("rms_norm", "swiglu", "flce"), "bf16", ()),
                ("llama4_text", ("rms_norm", "swiglu", "cross_entropy"), "fp32", ()),
            ]
        ),
        # deepseek_v3: RMSNorm on the latents' norms too, SwiGLU in the dense layer and the
        # shared experts; the latent attention and its RoPE as transformers runs them
        ("deepseek_v3", ("rms_norm", "swiglu", "flce"), "bf16", ()),
        # glm4_moe: RoPE on half of each head (q heads-major after it), SwiGLU in the dense layer
        # and the shared experts, the fp32 router's copies beside the patched norms
        ("glm4_moe", ("rms_norm", "rope", "swiglu", "flce"), "bf16", ()),
        # memplan's RoPE gives k a gradient with q's in layer 0, but not in smollm3's layer 1,
        # which applies no RoPE
        pytest.param("smollm3", ("rope",), "bf16", ("q_proj",), marks=pytest.mark.slow),
        # memplan's sink attention: q, k, v, its output and logsumexp, no scores
        ("gpt_oss", ("rms_norm", "rope", "sink_attention", "flce"), "bf16", ()),
        # Eager attention under LoRA on q alone: the RoPE kernel gives k a gradient too, so the
        # first layer keeps q and k, unlike HF's RoPE (test_lora_matches_autograd_on_cpu).
        ("llama", ("rope",), "bf16", ("q_proj",)),
        # Qwen3.5: the gated DeltaNet's gated RMSNorm keeps x, the gate and rstd (rms_norm),
        # with the base weights trained or frozen
        ("qwen3_5_text", ("rms_norm", "swiglu", "flce"), "bf16", ()),
        ("qwen3_5_text", ("rms_norm",), "bf16", ("gate_proj", "up_proj")),
        pytest.param(
            "qwen3_5_text", ("rms_norm", "cross_entropy"), "fp32", (), marks=pytest.mark.slow
        ),
        # Qwen3.5-MoE: the Gemma-cast norms and the shared expert's GLU kernel beside the
        # DeltaNet, the gated attention and the experts as transformers runs them
        ("qwen3_5_moe_text", ("rms_norm", "swiglu", "flce"), "bf16", ()),
        pytest.param(
            "qwen3_5_moe_text",
            ("rms_norm", "swiglu", "cross_entropy"),
            "fp32",
            (),
            marks=pytest.mark.slow,
        ),
        ("qwen3_next", ("rms_norm", "swiglu", "flce"), "bf16", ()),
        pytest.param(
            "qwen3_next",
            ("rms_norm", "swiglu", "cross_entropy"),
            "fp32",
            (),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_patched_model_matches_autograd_on_cpu(
    model_type, kernels, precision, lora_targets, saved_storage_bytes
) -> None:
    """With memplan's kernels applied, the estimator's contracts of those kernels hold too."""
    import memplan

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **family_overrides(model_type))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    attn = "eager" if lora_targets else attentions(model_type)[0]
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    lora = {}
    if lora_targets:
        peft = pytest.importorskip("peft")
        targets = list(lora_targets)
        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        lora = {"lora_rank": 16, "lora_targets": lora_targets}
    memplan.apply(model.train(), plan=None, kernels=list(kernels))
    measured = saved_bytes_of(saved_storage_bytes, model, cfg.vocab_size, autocast=False)
    spec = spec_from_config(probe_config(model_type))
    setup = TrainSetup(
        batch=PROBE["batch"],
        seq=PROBE["seq"],
        precision=precision,
        attn=attn,
        kernels=kernels,
        transformers=INSTALLED,
        **lora,
    )
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total == measured


@pytest.mark.parametrize(
    "kernels,precision,lora",
    [
        (("flce",), "fp32", False),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                (("flce",), "bf16", False),
                (("cross_entropy",), "fp32", False),
                (("cross_entropy",), "bf16", False),
                (("cross_entropy",), "fp32", True),
            ]
        ),
    ],
)
def test_logits_scaling_in_memplans_loss_costs_what_the_walk_says(
    kernels, precision, lora, live_bytes
) -> None:
    """memplan's loss divides Granite's hidden states by logits_scaling before lm_head, where HF
    divides the logits: one hidden-sized tensor more through the loss (kept by a trainable
    lm_head without autocast, beside the norm's output). The peak of the storages alive in the
    patched forward, logits_scaling 16 against 1, grows by what the estimate's loss phase adds,
    to the byte (a vocabulary of 8192, so that the loss is the forward's peak)."""
    import memplan
    from memplan.estimators.timeline import step_sizes, walk_run
    from tests.patching.tiny_models import TINY, catalog_config, shrink

    def forward_peak_and_estimate(scaling: float) -> tuple[int, int]:
        config = shrink(
            catalog_config("granite-3.3-8b-instruct"),
            {**TINY, "vocab_size": 8192},
            logits_scaling=scaling,
        )
        model_type = config.pop("model_type")
        torch.manual_seed(0)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        hf = AutoConfig.for_model(model_type, **config)
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation="sdpa")
        setup_lora = {}
        if lora:
            peft = pytest.importorskip("peft")
            targets = ["q_proj", "v_proj"]
            adapters = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets)
            model = peft.get_peft_model(model, adapters)
            setup_lora = {"lora_rank": 16, "lora_targets": tuple(targets)}
        memplan.apply(model.train(), plan=None, kernels=list(kernels))
        ids = torch.randint(0, hf.vocab_size, (2, 64))
        mode = live_bytes()
        with mode:
            model(input_ids=ids, labels=ids)
        spec = spec_from_config({**config, "model_type": model_type})
        setup = TrainSetup(
            batch=2, seq=64, precision=precision, kernels=kernels, transformers=INSTALLED,
            **setup_lora,
        )  # fmt: skip
        (first, _), _ = walk_run(spec, setup, step_sizes(spec, setup, None, "cpu"))
        loss_phase = max(n for phase, _, n in first.points if phase == "loss")
        return mode.peak, loss_phase

    (measured_16, estimated_16), (measured_1, estimated_1) = map(
        forward_peak_and_estimate, (16.0, 1.0)
    )
    hidden = 2 * 64 * TINY["hidden_size"] * (2 if precision == "bf16" else 4)
    assert measured_16 - measured_1 == estimated_16 - estimated_1 == hidden


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_bf16_weights_under_autocast_match_autograd_on_cpu(model_type, saved_storage_bytes) -> None:
    """FSDP2's amp step: bf16 weights (its mixed-precision policy) inside accelerate's autocast.
    The GLU kernel leaves down_proj to nn.Linear under autocast, which saves its input."""
    import memplan

    kernels = ("rms_norm", "rope", "swiglu" if model_type == "llama" else "geglu")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **family_overrides(model_type))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    memplan.apply(model.train(), plan=None, kernels=list(kernels))
    measured = saved_bytes_of(saved_storage_bytes, model, cfg.vocab_size, autocast=True)
    spec = spec_from_config(probe_config(model_type))
    setup = TrainSetup(
        batch=PROBE["batch"], seq=PROBE["seq"], kernels=kernels, transformers=INSTALLED
    )
    saved = forward_saved(spec, setup, backend="cpu", rounded=False, under_autocast=True)
    assert saved.total == measured
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total < measured


@pytest.mark.parametrize("k_eq_v", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_gemma4_under_autocast_matches_autograd_on_cpu(k_eq_v, saved_storage_bytes) -> None:
    """gemma4_text's amp forward, live on the CPU's autocast (which casts the ops of Gemma 3 and
    4 as CUDA's does: gemma3_text's CPU forward agrees too): where v is k_proj's output, the
    layer norm's output is cast once fewer; v_norm copies its bf16 input to fp32."""
    overrides = {**family_overrides("gemma4_text"), "attention_k_eq_v": k_eq_v}
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma4_text", **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    measured = saved_bytes_of(saved_storage_bytes, model.train(), cfg.vocab_size, autocast=True)
    spec = spec_from_config(AutoConfig.for_model("gemma4_text", **overrides).to_dict())
    setup = TrainSetup(
        batch=PROBE["batch"], seq=PROBE["seq"], precision="amp-bf16", transformers=INSTALLED
    )
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total == measured


KERNEL_PROBE = json.loads(
    (Path(__file__).parent / "data" / "saved_cuda_probe_kernels.json").read_text()
)


@pytest.mark.parametrize("case", sorted(KERNEL_PROBE["saved"]))
def test_patched_model_matches_h200_probe(case: str) -> None:
    """memplan.apply with every kernel the family supports (FLCE for the loss), recorded on an
    H200 by `tools/record_saved_tensors.py --kernels all`: bf16, fp32 and autocast, SDPA and
    eager."""
    _, precision, attn = case.split("/")
    assert_matches_probe(KERNEL_PROBE, case, precision=precision, attn=attn, all_kernels=True)


def assert_matches_probe(probe: dict, case: str, *, all_kernels: bool, **setup) -> None:
    """The estimator's forward-saved bytes for one case of a fixture
    (tools/record_saved_tensors.py) equal the bytes the GPU recorded; all_kernels: every kernel the
    family supports, as `--kernels all` applied them."""
    from memplan.advisor import best_kernel_set, supported_kernels

    measured = probe["saved"][case]
    if isinstance(measured, dict):
        pytest.skip(f"the probe could not run this case on the GPU: {measured['error'][:80]}")
    model_type = case.split("/")[0]
    overrides = {**probe["tiny"], **probe["families"][model_type]}
    spec = spec_from_config(AutoConfig.for_model(model_type, **overrides).to_dict())
    kernels = best_kernel_set(supported_kernels(spec)) if all_kernels else ()
    train = TrainSetup(batch=probe["batch"], seq=probe["seq"], kernels=kernels, **setup)
    expected = forward_saved(spec, train, backend="cuda", rounded=False).total
    assert expected == sum(t["nbytes"] for t in measured)


LORA_PROBES = {
    kernels: json.loads((Path(__file__).parent / "data" / name).read_text())
    for kernels, name in (
        ("none", "saved_cuda_probe_lora.json"),
        ("kernels", "saved_cuda_probe_lora_kernels.json"),
    )
}


LORA_CASES = [(kernels, case) for kernels, probe in LORA_PROBES.items() for case in probe["saved"]]


@pytest.mark.parametrize("kernels,case", sorted(LORA_CASES))
def test_lora_matches_h200_probe(kernels: str, case: str) -> None:
    """peft LoRA on every family, bf16 / fp32 / autocast, SDPA and eager, with kernels off and
    with every kernel the family supports, recorded on an H200 by
    `tools/record_saved_tensors.py --lora` (CUDA's autocast and attention backends, which the
    CPU tests cannot reach)."""
    probe = LORA_PROBES[kernels]
    _, precision, attn, targets = case.split("/")
    assert_matches_probe(
        probe,
        case,
        precision=precision,
        attn=attn,
        lora_rank=probe["lora"]["r"],
        lora_targets=tuple(targets.split("+")),
        all_kernels=kernels == "kernels",
    )


@pytest.mark.parametrize(
    "model_type,precision,setup_options",
    [
        ("llama", "bf16", {}),
        ("phi3", "amp-bf16", {}),
        ("qwen3", "fp32", {}),
        ("llama", "bf16", {"grad_checkpointing": True}),
        # the first layer's attention needs no gradient: it saves nothing, the cache is its own
        ("llama", "bf16", {"lora_rank": 16, "lora_targets": ("gate_proj", "up_proj")}),
        # OLMo's RoPE casts k back to bf16 under autocast: the cache is attention's own k
        ("olmo2", "amp-bf16", {}),
        ("olmo3", "bf16", {}),
        # k concatenated from its rotated half (fp32 under autocast) and the rest
        ("glm4_moe", "amp-bf16", {}),
        # the patched models (minutes each under the interpreter)
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                ("llama", "amp-bf16", {"kernels": ("rms_norm", "rope", "swiglu", "flce")}),
                ("llama", "amp-bf16", {"kernels": ("rope",)}),
                ("ministral3", "amp-bf16", {}),
                # the CPU's math path (attention dropout) saves fp32 copies of k and v
                ("seed_oss", "bf16", {}),
                # a layer without RoPE keeps k in bf16 under autocast: SDPA saves the cache's k
                ("smollm3", "amp-bf16", {}),
                ("granite", "bf16", {}),
                ("glm4_moe", "bf16", {"kernels": ("rms_norm", "rope", "swiglu", "flce")}),
            ]
        ),
        # latent attention caches the normed kv latent (kv_b_proj's input, or an fp32
        # adapter's) and the rotated shared key (kept by nothing)
        ("deepseek_v3", "bf16", {}),
        pytest.param(
            "deepseek_v3",
            "fp32",
            {"lora_rank": 16, "lora_targets": ("q_a_proj", "kv_b_proj")},
            marks=pytest.mark.slow,
        ),
        pytest.param("deepseek_v3", "amp-bf16", {"attn": "eager"}, marks=pytest.mark.slow),
        # eager attention with sinks keeps repeated k and v: the cache is memory of its own
        ("gpt_oss", "bf16", {"attn": "eager"}),
    ],
)
def test_kv_cache_matches_transformers(model_type, precision, setup_options) -> None:
    """transformers builds a KV cache in training (k after RoPE in the residual dtype, OLMo's in
    its own; v in k's before transformers 5.24, in its own after), held by the output until
    forward returns; not with checkpointing, nor under memplan's causal-LM forward. The
    estimator's cache bytes equal those of the cache's tensors that autograd does not also save
    (attention saves the cache's own k and v where it takes them as they are)."""
    import memplan
    from memplan.estimators.timeline import step_sizes, walk_run

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **family_overrides(model_type))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    setup = TrainSetup(
        batch=PROBE["batch"],
        seq=PROBE["seq"],
        precision=precision,
        transformers=INSTALLED,
        **setup_options,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=setup.attn)
    model.train()
    if setup.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if setup.lora_rank:
        peft = pytest.importorskip("peft")
        lora = peft.LoraConfig(
            r=setup.lora_rank, lora_alpha=32, target_modules=list(setup.lora_targets)
        )
        model = peft.get_peft_model(model, lora)
    if setup.kernels:
        memplan.apply(model, plan=None, kernels=list(setup.kernels))
    ids = torch.randint(0, cfg.vocab_size, (PROBE["batch"], PROBE["seq"]))
    saved: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.startswith("amp")),
    ):
        cache = model(input_ids=ids, labels=ids).past_key_values
    layers = [] if cache is None else cache.layers
    tensors = [t for layer in layers for t in (layer.keys, layer.values)]
    # a sliding layer's cache keeps a view of its last window - 1 positions: their storage
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    measured = sum(n for ptr, n in storages.items() if ptr not in saved)
    spec = spec_from_config(probe_config(model_type))
    (_, walk), _ = walk_run(spec, setup, step_sizes(spec, setup, None, "cpu"))
    assert measured == max(snapshot.get("kv_cache", 0) for snapshot in walk.snapshots)


def test_checkpointed_lora_keeps_the_embedding_leaf_until_the_next_forward() -> None:
    """Under checkpointing peft makes the frozen embedding's output a leaf that requires grad;
    the graph the caller's `loss` holds keeps it and its gradient after backward, until the next
    step replaces `loss` (measured on an H200: two hidden-state tensors more at the next FLCE
    peak). The estimator keeps the same two tensors from the end of backward to the next
    forward's end."""
    import gc

    from memplan.estimators.timeline import step_sizes, walk_run

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **family_overrides("llama"))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    ids = torch.randint(0, cfg.vocab_size, (PROBE["batch"], PROBE["seq"]))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    shape = (PROBE["batch"], PROBE["seq"], cfg.hidden_size)

    def kept_leaves() -> list[torch.Tensor]:
        gc.collect()
        return [
            t
            for t in gc.get_objects()
            if type(t) is torch.Tensor and t.is_leaf and t.requires_grad and t.shape == shape
        ]

    (leaf,) = kept_leaves()
    measured = leaf.untyped_storage().nbytes() + leaf.grad.untyped_storage().nbytes()
    del leaf, loss
    assert kept_leaves() == []

    setup = TrainSetup(
        batch=PROBE["batch"], seq=PROBE["seq"], grad_checkpointing=True, lora_rank=16,
        lora_targets=("q_proj",), transformers=INSTALLED,
    )  # fmt: skip
    spec = spec_from_config(probe_config("llama"))
    (_, walk), _ = walk_run(spec, setup, step_sizes(spec, setup, None, "cpu"))
    assert walk.snapshots[0]["embedding_leaf"] == measured
    assert walk.snapshots[-1]["embedding_leaf"] == measured


KV1_PROBE = json.loads((Path(__file__).parent / "data" / "saved_cuda_probe_kv1.json").read_text())


@pytest.mark.parametrize("case", sorted(KV1_PROBE["saved"]))
def test_one_kv_head_matches_h200_probe(case: str) -> None:
    """One KV head (gemma-3-1b): HF's repeat_kv is then a view, so SDPA with a sliding-window
    mask saves k and v at one head, unless autocast casts them into a full-size copy."""
    _, precision, kernels = case.split("/")
    assert_matches_probe(
        KV1_PROBE, case, precision=precision, attn="sdpa", all_kernels=kernels == "all"
    )


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "llama", "olmo3"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_one_kv_head_matches_autograd_on_cpu(model_type, precision, attn, saved_storage_bytes):
    overrides = {**family_overrides(model_type), "num_key_value_heads": 1}
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **overrides)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    except ValueError as exc:  # Gemma 2 takes only eager attention from transformers 5.2x
        if "does not support an attention implementation" not in str(exc):
            raise
        pytest.skip(f"this transformers builds {model_type} without {attn}")
    measured = saved_bytes_of(saved_storage_bytes, model.train(), cfg.vocab_size, autocast=False)
    setup = TrainSetup(
        batch=PROBE["batch"], seq=PROBE["seq"], precision=precision, attn=attn,
        transformers=INSTALLED,
    )  # fmt: skip
    spec = spec_from_config(cfg.to_dict())
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total == measured


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_norm_topk_prob_false_is_read_as_each_router_reads_it(model_type, saved_storage_bytes):
    """Qwen3-Next's router skips the top-k renormalization where norm_topk_prob is false;
    Qwen3.5-MoE's renormalizes whatever the config says."""
    overrides = {**family_overrides(model_type), "norm_topk_prob": False}
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    measured = saved_bytes_of(saved_storage_bytes, model.train(), cfg.vocab_size, autocast=False)
    spec = spec_from_config(cfg.to_dict())
    setup = TrainSetup(batch=PROBE["batch"], seq=PROBE["seq"], transformers=INSTALLED)
    assert forward_saved(spec, setup, backend="cpu", rounded=False).total == measured
