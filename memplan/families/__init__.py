"""The model families memplan knows (registry.py), each as data (family.py, patch_spec.py):
the one place that says how a family's config reads, what its layers keep, what memplan patches
in it and which catalog entry its tests shrink. No torch here."""

from __future__ import annotations

from memplan.families.family import ConfigRules, Family, MoeRules
from memplan.families.registry import FAMILIES

# A multimodal wrapper's model_type -> the text family its text_config holds.
TEXT_FAMILY_OF: dict[str, str] = {
    wrapper: family.model_type for family in FAMILIES.values() for wrapper in family.wrapped_by
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*FAMILIES, *TEXT_FAMILY_OF)

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "TEXT_FAMILY_OF",
    "ConfigRules",
    "Family",
    "MoeRules",
]
