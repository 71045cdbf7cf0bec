"""The advisor's decisions follow from the estimator's predictions."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from memplan.advisor import (
    EXPANDABLE_TEXT,
    FUSED_ADAMW_TEXT,
    _divisors_desc,
    advise,
    choose_flce_chunk,
    judge,
    largest_batch,
    parse_kernels,
    runs,
    supported_kernels,
)
from memplan.catalog import resolve_gpu, resolve_model
from memplan.errors import UsageError
from memplan.estimators.kernel_contracts import flce_default_chunk
from memplan.estimators.params import lora_params
from memplan.render import gib, print_advice
from memplan.schema import Advice, TrainSetup


def rendered(advice, width: int = 200) -> str:
    out = io.StringIO()
    print_advice(advice, Console(file=out, width=width))
    return out.getvalue()


def test_gemma_7b_b8_s4096_does_not_fit_an_h100_and_says_what_does() -> None:
    advice = advise("gemma-7b", 8, 4096)
    assert not advice.fits and not advice.estimate.reserved.runs
    assert advice.peak_bytes > advice.gpu.capacity
    assert advice.suggestions and advice.suggestions[0].fits
    assert advice.suggestions[0].reserved_bytes <= advice.gpu.capacity
    for suggestion in advice.suggestions:
        assert judge(resolve_model("gemma-7b"), suggestion.setup, advice.gpu).peak_bytes == (
            suggestion.peak_bytes
        )


def test_peak_bytes_is_the_requested_setup() -> None:
    advice = advise("llama-3.2-1b", 4, 1024, kernels="none")
    assert advice.setup.kernels == ()
    judged = judge(resolve_model("llama-3.2-1b"), advice.setup, advice.gpu)
    assert advice.peak_bytes == judged.peak_bytes


def test_auto_picks_the_lowest_peak_and_flce_over_cross_entropy() -> None:
    advice = advise("qwen2.5-1.5b", 4, 2048)
    assert advice.plan.kernels == ("rms_norm", "rope", "swiglu", "flce", "embedding")
    best = min(advice.kernel_options, key=lambda o: o.peak_bytes)
    assert best.kernels == advice.plan.kernels
    # The chunk is then raised into the headroom (larger GEMMs), never past it.
    assert best.peak_bytes <= advice.peak_bytes
    assert advice.fits and advice.estimate.reserved.reserved_bytes <= advice.gpu.capacity


def test_kernel_parsing() -> None:
    gemma = resolve_model("gemma-2-2b")
    assert parse_kernels("auto", gemma) is None
    assert parse_kernels("none", gemma) == ()
    assert parse_kernels("all", gemma) == ("rms_norm", "rope", "geglu", "flce", "embedding")
    assert parse_kernels("rms_norm,embedding", gemma) == ("rms_norm", "embedding")
    # The original Gemma's "gelu" (exact GELU in transformers 5.17) gets geglu's exact variant.
    assert "geglu" in supported_kernels(resolve_model("gemma-7b"))
    assert parse_kernels("flce,rms_norm", gemma) == ("rms_norm", "flce")
    with pytest.raises(UsageError, match="unknown kernel"):
        parse_kernels("rmsnorm", gemma)
    with pytest.raises(UsageError, match="does not apply"):
        parse_kernels("swiglu", gemma)
    assert "swiglu" not in supported_kernels(resolve_model("mixtral-8x7b"))


def test_flce_chunk_grows_with_headroom_and_shrinks_only_to_fit() -> None:
    spec = resolve_model("llama-3.2-1b")
    setup = TrainSetup(batch=8, seq=2048, kernels=("rms_norm", "flce"))
    formula = flce_default_chunk(8 * 2048, spec.hidden_size, spec.vocab_size)
    roomy = choose_flce_chunk(spec, setup, resolve_gpu("h200"))
    assert roomy >= formula
    tight = choose_flce_chunk(spec, setup, resolve_gpu(memory="27GiB"))
    assert tight <= roomy


def test_largest_batch_is_the_boundary() -> None:
    spec, gpu = resolve_model("qwen2.5-0.5b"), resolve_gpu("l4")
    setup = TrainSetup(batch=1, seq=2048)
    best = largest_batch(spec, setup, gpu)
    assert best > 0
    assert runs(spec, setup.model_copy(update={"batch": best}), gpu)
    assert not runs(spec, setup.model_copy(update={"batch": best + 1}), gpu)


def test_long_sequence_is_a_warning() -> None:
    advice = advise("gemma-2b", 1, 16384)
    assert any("max_position_embeddings" in w for w in advice.warnings)


@pytest.mark.parametrize("batch,seq", [(0, 10), (1, -3)])
def test_bad_numbers(batch, seq) -> None:
    with pytest.raises(UsageError):
        advise("gemma-2b", batch, seq)


def test_divisors_below_a_bound_are_every_divisor_largest_first() -> None:
    for n in range(1, 300):
        for most in (1, 2, 7, n, n + 5):
            assert _divisors_desc(n, most) == [d for d in range(min(n, most), 0, -1) if n % d == 0]
    n = 99_999_999_999_999
    assert _divisors_desc(n, 10) == [d for d in range(10, 0, -1) if n % d == 0]


def test_the_largest_batch_accepted_is_answered_with_micro_batches() -> None:
    advice = advise("gemma-7b", 2**20 - 1, 4096)
    assert not advice.fits and advice.max_batch == 0
    assert advice.suggestions[0].fits
    assert advice.suggestions[0].reserved_bytes <= advice.gpu.capacity
    setup = advice.suggestions[0].setup
    assert setup.batch * setup.grad_accum == 2**20 - 1


def test_lora_targets_must_be_linears_of_the_architecture() -> None:
    with pytest.raises(UsageError, match="gemma has no LoRA target foo; its layers have q_proj"):
        advise("gemma-7b", 1, 1, lora_rank=8, lora_targets=["foo"])
    with pytest.raises(UsageError, match="phi3 has no LoRA target q_proj, v_proj; .* qkv_proj"):
        advise("phi-3-mini", 1, 512, lora_rank=16, lora_targets=["q_proj", "v_proj"])
    # MoE experts are 3-D parameters in transformers 5, not nn.Linear.
    with pytest.raises(UsageError, match="down_proj"):
        advise("mixtral-8x7b", 1, 512, lora_rank=16, lora_targets=["q_proj", "down_proj"])
    # The estimator itself refuses them too, rather than counting 0 adapter parameters.
    setup = TrainSetup(batch=1, seq=1, lora_rank=8, lora_targets=("foo",))
    with pytest.raises(UsageError):
        lora_params(resolve_model("gemma-7b"), setup)


def test_fused_qkv_lora_defaults_and_suggestions_use_qkv_proj() -> None:
    advice = advise("phi-3-mini", 1, 512, lora_rank=16)
    assert advice.setup.lora_targets == ("qkv_proj",)
    assert advice.estimate.trainable_params == lora_params(
        resolve_model("phi-3-mini"), advice.setup
    )
    assert advice.estimate.trainable_params > 0
    assert advise("llama-3.2-1b", 1, 512, lora_rank=16).setup.lora_targets == ("q_proj", "v_proj")
    tight = advise("phi-3-mini", 64, 4096)
    lora = [s for s in tight.suggestions if s.setup.lora_rank]
    assert lora and all(s.setup.lora_targets == ("qkv_proj", "o_proj") for s in lora)
    assert all("qkv_proj" in s.description for s in lora)


@pytest.mark.parametrize(
    "model,gpu,batch,seq,precision",
    [
        ("llama-3.2-1b", "h100", 8, 4096, "bf16"),
        pytest.param("llama-3.2-1b", "h100", 6, 1024, "bf16", marks=pytest.mark.slow),
        ("gemma-2b", "h100", 4, 2048, "amp-bf16"),
        ("qwen2.5-0.5b", "a10g", 4, 2048, "bf16"),
        # batch 4097 under `-m slow`; test_largest_batch_at_the_search_ceiling_says_at_least
        # searches up to 2**20 by default
        pytest.param("smollm2-135m", "h200", 4097, 64, "bf16", marks=pytest.mark.slow),
    ],
)
def test_largest_batch_is_where_advise_stops_fitting(model, gpu, batch, seq, precision) -> None:
    """The analytic search ends where advise's analytic verdict stops fitting (at the edge advise
    takes the traced step's verdict: tests/traced/test_edge_verdict.py checks that search)."""
    advice = advise(model, batch, seq, gpu=gpu, precision=precision, traced_verdict=False)
    kernels = ",".join(advice.plan.kernels)
    best = advice.max_batch
    assert best > 0
    options = dict(gpu=gpu, precision=precision, kernels=kernels, traced_verdict=False)
    assert advise(model, best, seq, **options).fits
    assert not advise(model, best + 1, seq, **options).fits


def test_largest_batch_at_the_search_ceiling_says_at_least() -> None:
    spec, gpu = resolve_model("smollm2-135m"), resolve_gpu("h200")
    setup = TrainSetup(batch=1, seq=64, kernels=("rms_norm", "flce"))
    assert largest_batch(spec, setup, gpu, ceiling=100) == 100
    advice = advise("smollm2-135m", 1, 1, gpu_mem="10TiB")
    assert advice.max_batch == 2**20
    assert "Largest batch that fits with these kernels: at least 1,048,576" in rendered(advice)


def test_largest_sequence_is_printed_and_is_the_edge_of_the_verdict() -> None:
    args = dict(gpu="h100", kernels="none", method="analytic")
    advice = advise("llama-3.2-1b", 4, 2048, **args)
    seq = advice.max_seq
    assert seq and seq % 64 == 0
    assert f"Largest sequence that fits at batch 4: {seq:,} tokens." in rendered(advice)
    assert advise("llama-3.2-1b", 4, seq, **args).fits
    assert not advise("llama-3.2-1b", 4, seq + 64, **args).fits


def test_why_names_the_largest_part_of_the_peak() -> None:
    advice = advise("qwen2.5-0.5b", 16, 4096, kernels="none", gpu="a10g")
    name, nbytes = max(advice.estimate.breakdown.items(), key=lambda kv: kv[1])
    assert name == "logits_and_loss"
    assert f"largest part of the peak is the logits and the loss ({gib(nbytes)})" in rendered(
        advice
    )


@pytest.mark.parametrize("kernels", ["auto", "rms_norm,flce", "rms_norm,rope,swiglu,flce"])
def test_the_plan_s_row_of_the_comparison_is_the_plan(kernels) -> None:
    advice = advise("llama-3.2-1b", 8, 4096, kernels=kernels)
    rows = [o for o in advice.kernel_options if o.kernels == advice.plan.kernels]
    assert len(rows) == 1 and rows[0].peak_bytes == advice.peak_bytes
    assert advice.kernel_options[0].kernels == ()


def test_contradictory_options_are_errors() -> None:
    with pytest.raises(UsageError, match="^flce_chunk sets the flce kernel's chunk, but kernels"):
        advise("gemma-7b", 1, 1, flce_chunk=100, kernels="none")
    with pytest.raises(UsageError, match="cross_entropy and flce"):
        advise("gemma-7b", 1, 1, kernels="cross_entropy,flce")
    with pytest.raises(UsageError, match="names no kernel"):
        advise("gemma-7b", 1, 1, kernels=",")
    with pytest.raises(UsageError, match="stands alone"):
        advise("gemma-7b", 1, 1, kernels="all,none")
    # A list of names (verify passes one) may still be empty: no kernels.
    assert parse_kernels([], resolve_model("gemma-7b")) == ()


def test_gpu_memory_must_exceed_what_lies_outside_the_allocator() -> None:
    with pytest.raises(UsageError, match="bare number counts bytes"):
        advise("gemma-7b", 1, 1, gpu_mem="24")
    with pytest.raises(UsageError, match="outside PyTorch's allocator"):
        advise("gemma-7b", 1, 1, gpu_mem="1GiB")


@pytest.mark.parametrize("margin", ["-1GiB", "abc", "100%", "200GiB"])
def test_a_safety_margin_must_leave_memory(margin) -> None:
    with pytest.raises(UsageError, match="safety_margin"):
        advise("llama-3.2-1b", 1, 128, safety_margin=margin)


def test_a_safety_margin_comes_off_the_capacity() -> None:
    plain = advise("llama-3.2-1b", 1, 128)
    kept = advise("llama-3.2-1b", 1, 128, safety_margin="10GiB")
    assert kept.safety_margin_bytes == 10 * 2**30
    assert kept.headroom_bytes == plain.headroom_bytes - 10 * 2**30
    assert kept.max_batch < plain.max_batch


def test_expandable_segments_are_suggested_where_fragmentation_decides() -> None:
    """A setup whose allocated peak fits but whose replay runs out of memory: the first
    suggestion is the allocator setting, and with it the step fits."""
    spec, gpu = resolve_model("llama-3.2-1b"), resolve_gpu("h100")
    setup = TrainSetup(batch=1, seq=2048, grad_checkpointing=True)
    decided = next(
        b
        for b in range(1, 64)
        if (judged := judge(spec, setup.model_copy(update={"batch": b}), gpu)).peak_bytes
        <= gpu.capacity
        and not judged.reserved.runs
    )
    # the analytic replay's verdict (the traced step's says this batch runs, as it did on an H100)
    advice = advise(
        "llama-3.2-1b", decided, 2048, grad_checkpointing=True, kernels="none", traced_verdict=False
    )
    assert not advice.fits
    assert advice.suggestions[0].description == EXPANDABLE_TEXT
    assert advice.suggestions[0].fits and advice.suggestions[0].setup.expandable_segments


def test_fused_adamw_is_suggested_where_the_foreach_step_runs_out() -> None:
    advice = advise(
        "llama-3.1-8b", 1, 1024, grad_checkpointing=True, kernels="none", gpu_mem="75GiB"
    )
    assert advice.estimate.reserved.oom_phase == "optimizer"
    fused = [s for s in advice.suggestions if s.description == FUSED_ADAMW_TEXT]
    assert fused and fused[0].fits and fused[0].setup.optimizer == "adamw-fused"


@pytest.mark.parametrize("option", ["lora_rank", "flce_chunk"])
@pytest.mark.parametrize("value", [True, 2.0])
def test_counts_of_the_python_api_are_positive_integers_not_bools(option, value) -> None:
    """lora_rank=True planned a rank-1 LoRA and flce_chunk=True a 1-row chunk; 2.0 was taken
    as 2, where batch=2.0 is refused."""
    with pytest.raises(UsageError, match="positive integer"):
        advise("llama-3.2-1b", 2, 64, **{option: value})


def test_lora_targets_may_be_a_comma_separated_string() -> None:
    """A string was split into characters: "llama has no LoRA target q, _, p, r, o, j"."""
    advice = advise("llama-3.2-1b", 2, 64, lora_rank=8, lora_targets="q_proj, k_proj")
    assert advice.setup.lora_targets == ("q_proj", "k_proj")


def test_suggestions_that_drop_the_users_flce_chunk_say_so() -> None:
    """With --flce-chunk 32768 the first suggestion read 'kernels rms_norm, rope, swiglu, flce',
    the user's own kernels, while what made it fit was memplan's FLCE setting in place of the
    chunk: re-running with those kernels and the chunk still did not fit."""
    chunk = 32768
    advice = advise("llama-3.2-1b", 20, 4096, gpu="h100", flce_chunk=chunk)
    assert not advice.fits and advice.suggestions
    for suggestion in advice.suggestions:
        st = suggestion.setup
        kept = st.flce_chunk == chunk
        assert kept or f"memplan's FLCE setting instead of your chunk of {chunk} rows" in (
            suggestion.description
        )
        rerun = advise(
            "llama-3.2-1b",
            st.batch,
            st.seq,
            gpu="h100",
            grad_checkpointing=st.grad_checkpointing,
            lora_rank=st.lora_rank,
            lora_targets=st.lora_targets if st.lora_rank else None,
            grad_accum=st.grad_accum,
            kernels=list(st.kernels),
            flce_chunk=chunk if kept else None,
        )
        assert rerun.peak_bytes == suggestion.peak_bytes and rerun.fits and suggestion.fits


# with LoRA under `-m slow`: test_advise_output.py's test_when_nothing_fits_the_closest_is_said_so
# renders that advice's Why line by default
@pytest.mark.parametrize("lora_rank", [None, pytest.param(8, marks=pytest.mark.slow)])
def test_why_names_the_weights_when_they_alone_do_not_fit(lora_rank) -> None:
    """llama-3-70b on an L4: 131 GiB of bf16 weights. The Why line advised LoRA, with LoRA
    already on, and without it LoRA could not help either."""
    advice = advise("llama-3-70b", 1, 512, gpu="l4", lora_rank=lora_rank)
    weights = advice.estimate.breakdown["weights"]
    assert not advice.fits and weights > advice.gpu.capacity
    why = next(line for line in _rendered(advice).splitlines() if line.startswith("Why:"))
    assert "weights alone" in why and "LoRA" not in why and "FSDP" in why


def test_why_does_not_advise_lora_when_lora_is_on() -> None:
    """The optimizer step does not fit but the weights do: LoRA is suggested only without it."""
    for lora_rank, gpu_mem in ((None, "9GiB"), (8, "3.6GiB")):
        advice = advise("llama-3.2-1b", 1, 512, gpu_mem=gpu_mem, lora_rank=lora_rank)
        step = [p for p in advice.estimate.timeline if p.phase == "optimizer"][-1]
        limit = advice.gpu.capacity
        assert advice.estimate.breakdown["weights"] <= limit < step.allocated_bytes
        why = next(line for line in _rendered(advice).splitlines() if line.startswith("Why:"))
        assert "optimizer step alone" in why
        assert ("LoRA" in why) == (lora_rank is None)


def test_small_trainable_counts_are_not_printed_as_zero() -> None:
    """smollm2-135m with LoRA r=8 on q and v trains 460,800 parameters, printed '0.000B'."""
    advice = advise("smollm2-135m", 1, 64, lora_rank=8)
    assert advice.estimate.trainable_params == 460_800
    setup_line = next(line for line in _rendered(advice).splitlines() if line.startswith("Setup:"))
    assert "(461K trainable)" in setup_line


def _rendered(advice) -> str:
    import io

    from rich.console import Console

    from memplan.render import print_advice

    out = io.StringIO()
    print_advice(advice, Console(file=out, width=300))
    return out.getvalue()


def test_advice_names_the_gated_deltanet_path_it_estimates(monkeypatch):
    import memplan.advisor

    def deltanet_advice(**options) -> tuple[list[str], Advice]:
        advice = advise("qwen3.5-0.8b", 1, 256, gpu="h100", **options)
        return [w for w in advice.warnings if "gated DeltaNet" in w], advice

    def importable(*names: str) -> None:
        monkeypatch.setattr(memplan.advisor, "find_spec", lambda name: name in names or None)

    importable()
    (note,), torch_rule = deltanet_advice()
    assert "18 gated DeltaNet layers" in note and "torch_chunk_gated_delta_rule" in note
    assert "torch's causal conv" in note and "here" not in note
    # where fla imports transformers runs its rule, and so does the estimate
    importable("fla")
    (note,), fla_rule = deltanet_advice()
    assert "flash-linear-attention's chunk_gated_delta_rule" in note and "here" not in note
    assert fla_rule.setup.deltanet_kernels == "fla" and fla_rule.setup.deltanet_conv == "torch"
    assert fla_rule.estimate.peak_bytes < torch_rule.estimate.peak_bytes
    (note,), forced = deltanet_advice(deltanet_kernels="torch")
    assert "flash-linear-attention imports here" in note
    assert forced.estimate.peak_bytes == torch_rule.estimate.peak_bytes
    # causal-conv1d's kernel saves neither the padded conv output nor a cast weight
    importable("fla", "causal_conv1d")
    (note,), both = deltanet_advice()
    assert "causal-conv1d's causal conv" in note and "here" not in note
    assert both.setup.deltanet_conv == "causal_conv1d"
    # 18 layers x 16K tokens x 6144 channels x 2 bytes (the padded output) fewer at the loss
    rule_only, with_conv = (
        advise("qwen3.5-0.8b", 8, 2048, gpu="h100", deltanet_kernels="fla", deltanet_conv=conv)
        for conv in ("torch", "causal_conv1d")
    )
    saved = rule_only.estimate.peak_bytes - with_conv.estimate.peak_bytes
    assert saved >= 18 * 8 * 2048 * 6144 * 2
    (note,), _ = deltanet_advice(deltanet_conv="torch", deltanet_kernels="torch")
    assert "flash-linear-attention imports and causal-conv1d imports here" in note
    importable()
    (note,), _ = deltanet_advice(deltanet_conv="causal_conv1d")
    assert "causal-conv1d does not import here" in note
    for bad in ({"deltanet_kernels": "cuda"}, {"deltanet_conv": "cudnn"}):
        with pytest.raises(UsageError, match=next(iter(bad))):
            advise("qwen3.5-0.8b", 1, 256, gpu="h100", **bad)
    assert not [w for w in advise("llama-3.2-1b", 1, 256, gpu="h100").warnings if "DeltaNet" in w]


def test_fla_at_the_edge_says_its_first_step_tunes_kernels():
    def tuning(batch: int, rule: str) -> bool:
        advice = advise("qwen3.5-0.8b", batch, 2048, gpu="h100", deltanet_kernels=rule)
        return any("tunes its kernels" in w for w in advice.warnings)

    assert tuning(22, "fla")  # 98% of an H100's capacity allocated
    assert not tuning(4, "fla") and not tuning(10, "torch")
