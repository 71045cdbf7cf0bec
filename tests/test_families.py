"""The families registry (memplan/families): every entry reads, patches and is advised from the
one place, and what it says holds against transformers' own classes."""

from __future__ import annotations

import pytest

from memplan.advisor import supported_kernels as advised_kernels
from memplan.catalog import SUPPORTED_MODEL_TYPES, resolve_model
from memplan.families import FAMILIES, TEXT_FAMILIES_OF, WRAPPERS, ConfigRules
from memplan.patching import SUPPORTED_MODEL_TYPES as PATCHED_MODEL_TYPES
from memplan.patching import supported_kernels as patched_kernels
from tests.patching.tiny_models import build


def test_catalog_and_patcher_know_the_registry_families() -> None:
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES) | set(TEXT_FAMILIES_OF)
    assert set(PATCHED_MODEL_TYPES) == set(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.patch.model_type == name
        assert resolve_model(family.tiny_from).model_type == name


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_advisor_and_patcher_name_the_same_kernels(model_type: str) -> None:
    """The advisor reads the family's entry; apply also looks at the model it is given (the tiny
    qwen3_moe has a dense last layer, so its GLU applies there, where the catalog's never does)."""
    model = build(model_type)
    expected = set(advised_kernels(resolve_model(FAMILIES[model_type].tiny_from)))
    if model_type == "qwen3_moe":
        expected.add("swiglu")
    assert set(patched_kernels(model)) == expected


def test_a_pattern_rule_needs_its_pattern() -> None:
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        ConfigRules(defaults={}, windowed_layers="pattern")


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrappers_read_their_text_config_as_transformers_does(wrapper: str) -> None:
    """The text families a wrapper holds are registry families, and its default text_config
    model_type is its config class's: a text_config without model_type builds that family."""
    from transformers import AutoConfig

    families = TEXT_FAMILIES_OF[wrapper]
    assert families and WRAPPERS[wrapper].default_text in families
    built = AutoConfig.for_model(wrapper, text_config={"hidden_size": 64})
    assert built.get_text_config().model_type == WRAPPERS[wrapper].default_text
    for family in families:
        config = AutoConfig.for_model(wrapper, text_config={"model_type": family})
        assert config.get_text_config().model_type == family


def test_post_norm_and_sandwich_norm_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="post_norm and sandwich_norm"):
        ConfigRules(defaults={}, post_norm=True, sandwich_norm=True)
