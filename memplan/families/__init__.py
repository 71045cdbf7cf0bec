"""The model families memplan knows (registry.py), each as data (family.py, patch_spec.py):
the one place that says how a family's config reads, what its layers keep, what memplan patches
in it and which catalog entry its tests shrink; and the multimodal wrappers whose text_config
holds one of them (wrappers.py). No torch here."""

from __future__ import annotations

from memplan.families.family import ConfigRules, Family, MoeRules
from memplan.families.registry import FAMILIES
from memplan.families.wrappers import WRAPPERS, Wrapper

# A multimodal wrapper's model_type -> the text families its text_config may hold.
TEXT_FAMILIES_OF: dict[str, tuple[str, ...]] = {
    wrapper: tuple(name for name, family in FAMILIES.items() if wrapper in family.wrapped_by)
    for wrapper in WRAPPERS
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*FAMILIES, *TEXT_FAMILIES_OF)

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "TEXT_FAMILIES_OF",
    "WRAPPERS",
    "ConfigRules",
    "Family",
    "MoeRules",
    "Wrapper",
]
