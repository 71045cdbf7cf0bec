"""What advise says and in which order: the verdict on the first line (GPU, fits, headroom), what
to do first as lines to copy, then the setup, the kernels (those that save no memory marked as
chosen for speed) and what is alive at the peak, then the terms used; the tables under
--verbose. Suggestions keep the user's kernels unless they say they change them."""

from __future__ import annotations

import pytest

from memplan.advisor import advise, judge
from memplan.catalog import resolve_model
from memplan.estimators import estimate
from memplan.render import advice_text, apply_line, legend_lines, training_arguments_line
from memplan.schema import TrainSetup


def test_the_first_line_is_the_verdict_with_the_gpu_assumed() -> None:
    advice = advise("gemma-7b", 8, 4096)
    text = " ".join(advice_text(advice, width=300).splitlines()[:1])
    oom = advice.estimate.reserved
    assert text == (
        "gemma-7b, batch 8 x seq 4096 on H100 80GB SXM (the default GPU): does not fit, out of "
        f"memory ({oom.oom_phase}, {oom.oom_label})."
    )
    fits = advise("llama-3.2-1b", 2, 1024, gpu="a100-40gb")
    first = advice_text(fits).splitlines()[0]
    assert first.startswith("llama-3.2-1b, batch 2 x seq 1024 on A100 40GB: fits, ")
    assert f"{fits.headroom_bytes / 2**30:,.2f} GiB headroom" in first


def test_what_to_do_first_comes_before_the_details() -> None:
    advice = advise("gemma-7b", 8, 4096)
    lines = advice_text(advice, width=200).splitlines()
    first = advice.suggestions[0]
    todo = lines.index(next(line for line in lines if line.startswith("Do this first:")))
    assert lines[todo] == f"Do this first: {first.description}."
    code = [line.strip() for line in lines[todo + 2 : todo + 5]]
    assert code[0] == apply_line(first.setup)
    assert code[0].startswith('memplan.apply(model, kernels=["rms_norm", "rope", "geglu", "flce"')
    assert (
        code[1] == 'peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])'
    )
    assert code[2] == (
        f"TrainingArguments(per_device_train_batch_size={first.setup.batch}, "
        f"gradient_accumulation_steps={first.setup.grad_accum})"
    )
    setup = lines.index(next(line for line in lines if line.startswith("Setup:")))
    assert todo < setup and "Kernel sets compared" not in lines


def test_copied_lines_reproduce_the_suggestion() -> None:
    """The apply line carries the kernels and FLCE's setting that the prediction assumed."""
    setup = TrainSetup(
        batch=2, seq=4096, kernels=("rms_norm", "flce"), flce_chunk=512, grad_accum=4
    )
    assert apply_line(setup) == 'memplan.apply(model, kernels=["rms_norm", "flce"], flce_chunk=512)'
    budget = setup.model_copy(update={"flce_chunk": None, "flce_memory_budget": 1024})
    assert apply_line(budget).endswith("flce_memory_budget=1024)")
    assert apply_line(setup.model_copy(update={"kernels": ()})) is None
    amp = setup.model_copy(update={"precision": "amp-bf16", "grad_checkpointing": True})
    assert training_arguments_line(amp) == (
        "TrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, bf16=True)"
    )
    assert training_arguments_line(setup.model_copy(update={"grad_accum": 1})) is None


def test_kernels_that_save_no_memory_are_marked_as_chosen_for_speed() -> None:
    advice = advise("llama-3.2-1b", 4, 2048)
    spec = resolve_model("llama-3.2-1b")
    # by the walk's tensors, as every kernel set is compared (without the replay's blocks)
    plan = estimate(spec, advice.setup, advice.gpu).peak_bytes
    for kernel, saved in advice.kernel_savings.items():
        rest = tuple(k for k in advice.setup.kernels if k != kernel)
        update = {"kernels": rest}
        if kernel == "flce":
            update.update(flce_chunk=None, flce_memory_budget=None)
        without = estimate(spec, advice.setup.model_copy(update=update), advice.gpu)
        assert saved == without.peak_bytes - plan
    assert advice.kernel_savings["rope"] == advice.kernel_savings["embedding"] == 0
    assert advice.kernel_savings["flce"] > 0
    text = advice_text(advice, width=300)
    kernels = next(line for line in text.splitlines() if line.startswith("Kernels:"))
    assert "rope (for speed: saves no memory here)" in kernels
    assert f"flce (saves {advice.kernel_savings['flce'] / 2**30:,.2f} GiB" in kernels


def test_the_terms_used_are_explained() -> None:
    advice = advise("gemma-7b", 8, 4096)
    terms = dict(legend_lines(advice))
    assert terms["bf16"].startswith("weights, gradients and optimizer states all in bf16")
    assert terms["flce"].startswith("fused linear cross entropy")
    assert terms["transient"] == "the temporaries of the op running at the peak"
    text = advice_text(advice, width=300)
    legend = text[text.index("Terms:") :].splitlines()
    for term, meaning in terms.items():
        assert any(line.split() == [f"{term}:", *meaning.split()] for line in legend)
    amp = dict(legend_lines(advise("gemma-2b", 1, 512, precision="amp-bf16")))
    assert "bf16" not in amp and amp["amp-bf16"].startswith("fp32 weights")


def test_verbose_adds_the_tables() -> None:
    advice = advise("gemma-7b", 8, 4096)
    short, verbose = advice_text(advice, width=200), advice_text(advice, verbose=True, width=200)
    for title in ("Predicted peak, kernels:", "Kernel sets compared", "What makes it fit"):
        assert title not in short and title in verbose
    assert verbose.splitlines()[0] == short.splitlines()[0]


def test_suggestions_keep_the_users_kernels_unless_they_say_so() -> None:
    """With --kernels none, "gradient checkpointing" predicted 12.15 GiB for llama-3.2-1b b16
    s2048 on an H100: the figure of every kernel on, not of checkpointing alone."""
    spec = resolve_model("llama-3.2-1b")
    advice = advise("llama-3.2-1b", 16, 2048, kernels="none", gpu="h100")
    assert not advice.fits and len(advice.suggestions) == 4
    switch = "kernels rms_norm, rope, swiglu, flce, embedding instead of none"
    assert advice.suggestions[0].description == switch
    for s in advice.suggestions:
        assert s.fits and s.reserved_bytes <= advice.gpu.capacity
        assert judge(spec, s.setup, advice.gpu).peak_bytes == s.peak_bytes
        assert (s.setup.kernels != ()) == s.description.startswith(switch)
    checkpointing = next(s for s in advice.suggestions if "checkpointing" in s.description)
    assert checkpointing.description == "gradient checkpointing (~30% slower steps)"
    alone = advice.setup.model_copy(update={"grad_checkpointing": True})
    assert checkpointing.peak_bytes == judge(spec, alone, advice.gpu).peak_bytes
    lora = next(s for s in advice.suggestions if "LoRA" in s.description)
    assert lora.setup.kernels == () and lora.setup.lora_rank == 16


def test_when_nothing_fits_the_closest_is_said_so() -> None:
    advice = advise("llama-3-70b", 1, 512, gpu="l4", lora_rank=8)
    assert not advice.fits and len(advice.suggestions) == 1 and not advice.suggestions[0].fits
    text = advice_text(advice, width=300)
    assert "Nothing tried fits one GPU; the closest: " in text
    assert "Why: the weights alone hold" in text


def test_an_advice_reads_as_text_in_a_notebook() -> None:
    advice = advise("llama-3.2-1b", 4, 2048)
    assert str(advice) == advice_text(advice)
    assert repr(advice).startswith("Advice('llama-3.2-1b', batch=4, seq=2048, gpu='H100 80GB SXM'")
    assert len(repr(advice)) < 200

    class Printer:  # the part of IPython's pretty printer that a notebook cell calls
        def __init__(self) -> None:
            self.shown: list[str] = []

        def text(self, value: str) -> None:
            self.shown.append(value)

    printer = Printer()
    advice._repr_pretty_(printer, False)
    assert printer.shown == [str(advice)]


@pytest.mark.parametrize("width", [60, 100])
def test_the_copy_lines_are_never_wrapped(width) -> None:
    advice = advise("llama-3.2-1b", 4, 2048)
    lines = advice_text(advice, width=width).splitlines()
    (line,) = [line for line in lines if "memplan.apply(" in line]
    assert line.strip() == apply_line(advice.setup) and len(line) > width
