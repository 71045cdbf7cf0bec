"""Shipped configs of popular checkpoints and GPUs, and name/path resolution into ModelSpec and
Gpu. Imports neither torch nor transformers (only a hub-id lookup imports transformers)."""

from memplan.catalog.config_notes import vision_tower_note
from memplan.catalog.config_to_spec import SUPPORTED_MODEL_TYPES, spec_from_config
from memplan.catalog.gpus import DEFAULT_GPU, gpu_notes, list_gpus, parse_memory, resolve_gpu
from memplan.catalog.models import (
    CatalogModel,
    catalog_model,
    catalog_note,
    list_model_entries,
    list_models,
    model_config,
    resolve_config,
    resolve_model,
    resolve_model_input,
    substituted_entry,
)

__all__ = [
    "DEFAULT_GPU",
    "SUPPORTED_MODEL_TYPES",
    "CatalogModel",
    "catalog_model",
    "catalog_note",
    "gpu_notes",
    "list_gpus",
    "list_model_entries",
    "list_models",
    "parse_memory",
    "resolve_config",
    "resolve_gpu",
    "resolve_model",
    "model_config",
    "resolve_model_input",
    "spec_from_config",
    "substituted_entry",
    "vision_tower_note",
]
