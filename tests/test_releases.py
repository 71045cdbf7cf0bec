"""What transformers releases changed in a step's memory (memplan.estimators.releases): each
change moves the prediction by exactly its tensors, on the release it names and after. The live
contract tests (test_estimator_contracts.py) check the installed release against autograd."""

from __future__ import annotations

import pytest

from memplan.advisor import advise
from memplan.catalog import resolve_model
from memplan.errors import UsageError
from memplan.estimators.contracts import DtypePlan
from memplan.estimators.releases import Release, as_run_by, release_tuple
from memplan.estimators.timeline import forward_saved, kv_cache_tensors
from memplan.schema import TrainSetup


@pytest.mark.parametrize(
    "text,expected",
    [
        ("5.17.0", (5, 17, 0)),
        ("5.24", (5, 24, 0)),
        ("5.25.0.dev0", (5, 25, 0)),
        ("6.0.1rc1", (6, 0, 1)),
    ],
)
def test_release_tuple(text: str, expected: tuple[int, int, int]) -> None:
    assert release_tuple(text) == expected


@pytest.mark.parametrize("text", ["", "five", "v5.17", "5"])
def test_release_tuple_refuses_what_is_no_release(text: str) -> None:
    with pytest.raises(ValueError, match="is not a transformers release"):
        release_tuple(text)


def test_no_release_means_the_contracts_release() -> None:
    assert Release.of(None) == Release.of("5.17.0")


def test_moe_sentinel_mask_is_one_byte_per_routed_row_before_5_18() -> None:
    spec = resolve_model("mixtral-8x7b")
    setup = TrainSetup(batch=2, seq=512)
    before = forward_saved(spec, setup.model_copy(update={"transformers": "5.17.0"}), rounded=False)
    after = forward_saved(spec, setup.model_copy(update={"transformers": "5.18.0"}), rounded=False)
    routed_rows = setup.batch * setup.seq * spec.num_experts_per_tok
    assert before.total - after.total == spec.num_hidden_layers * routed_rows


@pytest.mark.parametrize(
    "precision,key_bytes,value_bytes_524", [("amp-bf16", 4, 2), ("bf16", 2, 2)]
)
def test_kv_cache_values_take_their_own_dtype_from_5_24(precision, key_bytes, value_bytes_524):
    spec = resolve_model("llama-3.2-1b")
    setup = TrainSetup(batch=1, seq=1024, precision=precision)
    dtypes = DtypePlan.of(precision)
    elements = setup.batch * setup.seq * spec.num_key_value_heads * spec.head_dim
    old = kv_cache_tensors(spec, setup.model_copy(update={"transformers": "5.23.0"}), dtypes)
    new = kv_cache_tensors(spec, setup.model_copy(update={"transformers": "5.24.0"}), dtypes)
    assert old == (elements * key_bytes, elements * key_bytes)
    assert new == (elements * key_bytes, elements * value_bytes_524)


def test_gemma2_runs_eager_where_the_release_refuses_sdpa() -> None:
    setup = TrainSetup(batch=1, seq=1024)
    assert as_run_by("gemma2", setup, "5.20.2").attn == "sdpa"
    assert as_run_by("gemma2", setup, "5.21.0").attn == "eager"
    assert as_run_by("llama", setup, "5.24.0").attn == "sdpa"
    assert as_run_by("gemma2", setup, "5.24.0").transformers == "5.24.0"


def test_gpt_oss_runs_eager_on_every_release() -> None:
    """GptOssForCausalLM refuses SDPA (no SDPA path takes its sinks): eager on every release."""
    setup = TrainSetup(batch=1, seq=1024)
    assert as_run_by("gpt_oss", setup, "5.17.0").attn == "eager"
    assert as_run_by("gpt_oss", setup, "5.24.0").attn == "eager"


def test_advise_predicts_what_the_named_release_runs() -> None:
    old = advise("gemma-2-2b", 1, 2048, kernels="none", transformers="5.20.2")
    new = advise("gemma-2-2b", 1, 2048, kernels="none", transformers="5.24.0")
    assert (old.setup.attn, new.setup.attn) == ("sdpa", "eager")
    assert new.setup.transformers == "5.24.0"
    assert new.peak_bytes > old.peak_bytes  # eager keeps the scores
    assert any("refuses SDPA for gemma2" in w for w in new.warnings)
    assert not any("refuses SDPA" in w for w in old.warnings)


def test_advise_refuses_what_is_no_release() -> None:
    with pytest.raises(UsageError, match="transformers must be a transformers release"):
        advise("llama-3.2-1b", 1, 2048, transformers="latest")


def test_a_measurement_is_predicted_for_the_release_it_ran_on() -> None:
    from memplan.schema import Measurement
    from memplan.verify.predict import ran_setup

    setup = TrainSetup(batch=1, seq=128)
    ran = Measurement(case="c", model="m", setup=setup, env={"transformers": "5.24.0+local"})
    assert ran_setup(ran).transformers == "5.24.0"
    unrecorded = Measurement(case="c", model="m", setup=setup)
    assert ran_setup(unrecorded).transformers is None
    named = Measurement(
        case="c", model="m", setup=setup.model_copy(update={"transformers": "5.20.0"}), env=ran.env
    )
    assert ran_setup(named).transformers == "5.20.0"


@pytest.mark.parametrize(
    "precision,weight_bytes",
    [("bf16", 2), pytest.param("fp32", 0, marks=pytest.mark.slow)],
)
def test_glm4_moe_router_weight_is_kept_in_fp32_from_5_24(precision, weight_bytes) -> None:
    """From 5.24 GLM-4.5's router weight is made and kept in fp32 in a bf16 model: two bytes
    more an element in its weight, gradient and each AdamW state (before 5.24 and in fp32: the
    same), and its fp32 linear copies no weight (the copy 5.23 saves for backward)."""
    from memplan.estimators import estimate
    from memplan.verify.predict import with_layers

    spec = with_layers(resolve_model("glm-4.5-air"), 2)  # one MoE layer
    router = spec.num_experts * spec.hidden_size
    before, after = (
        TrainSetup(batch=1, seq=256, precision=precision, transformers=release)
        for release in ("5.23.0", "5.24.0")
    )
    old, new = estimate(spec, before), estimate(spec, after)
    for part in ("weights", "gradients"):
        assert new.breakdown[part] - old.breakdown[part] == weight_bytes * router
    assert new.breakdown["optimizer_states"] - old.breakdown["optimizer_states"] == (
        2 * weight_bytes * router
    )
    copy = 0 if precision == "fp32" else 4 * router
    saved_old, saved_new = (forward_saved(spec, s, rounded=False) for s in (before, after))
    assert saved_old.total - saved_new.total == copy
