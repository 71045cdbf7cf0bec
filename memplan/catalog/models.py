"""The shipped model catalog (models.json) and `--model NAME|PATH|HUB_ID` resolution.

Order: exact catalog key or hf_id; an existing config.json or a folder holding one; the longest
catalog key contained in the name, else the one key containing it (gpt-fast's
ModelArgs.from_name); a hub id through transformers' AutoConfig. A path is tried before the
substring rule so that a local checkpoint folder whose name contains a catalog key is read, not
replaced by the catalog entry. transformers is imported only in the hub branch."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.catalog.config_notes import config_notes
from memplan.catalog.config_to_spec import spec_from_config
from memplan.errors import MemplanError, UsageError
from memplan.schema import ModelSpec

_MODELS_JSON = Path(__file__).with_name("models.json")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class CatalogModel:
    """One shipped checkpoint: its catalog key, hub id, published parameter count, spec."""

    key: str
    hf_id: str
    params: int | None
    spec: ModelSpec


@functools.cache
def _entries() -> dict[str, dict[str, Any]]:
    return json.loads(_MODELS_JSON.read_text())


def list_models() -> list[tuple[str, ModelSpec]]:
    """Every catalog model as (key, spec), in catalog order."""
    return [(entry.key, entry.spec) for entry in list_model_entries()]


def list_model_entries() -> list[CatalogModel]:
    return [_catalog_model(key) for key in _entries()]


def catalog_model(key: str) -> CatalogModel:
    """The catalog entry of an exact key; UsageError if there is none."""
    if key not in _entries():
        raise UsageError(f"{key!r} is not a catalog model (run `memplan models`)")
    return _catalog_model(key)


def _catalog_model(key: str) -> CatalogModel:
    entry = _entries()[key]
    spec = spec_from_config(entry["config"], name=key)
    return CatalogModel(key=key, hf_id=entry["hf_id"], params=entry.get("params"), spec=spec)


def resolve_model(name_or_path: str, *, trust_remote_code: bool = False) -> ModelSpec:
    """The ModelSpec for a catalog name, a config.json path or folder, or a hub id. A name that
    is none of these, or a malformed hub id ('org/bad name'), is a UsageError; a missing path
    (_PATH_PREFIXES, a drive letter, *.json, or two '/' or more), a bad config or a hub id the
    hub does not give is a MemplanError."""
    config, name = resolve_config(name_or_path, trust_remote_code=trust_remote_code)
    return spec_from_config(config, name=name)


def model_config(
    model: Any, *, trust_remote_code: bool = False
) -> tuple[dict[str, Any], str | None]:
    """The config dict of anything advise and verify take as a model, and the name it goes by:
    a catalog name, a config.json path or folder or a hub id (a str, resolve_config); a config
    as a dict; a transformers PretrainedConfig; a model that has one as `.config` (a
    transformers or PEFT model); or a ModelSpec. Anything else is a UsageError saying so."""
    if isinstance(model, ModelSpec):
        return {**model.hf_config, "model_type": model.model_type}, model.name
    if isinstance(model, str):
        return resolve_config(model, trust_remote_code=trust_remote_code)
    config = model if isinstance(model, Mapping) else getattr(model, "config", model)
    if isinstance(config, Mapping):
        name = config.get("_name_or_path")
    else:
        name = getattr(config, "_name_or_path", None)
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise UsageError(
                "the model must be a catalog name, a config.json path or folder, a hub id, a "
                "config dict, a transformers config or model, or a memplan ModelSpec; got "
                f"{type(model).__name__}"
            )
        config = to_dict()
    return dict(config), name if isinstance(name, str) and name else None


def resolve_model_input(
    model: Any, *, trust_remote_code: bool = False
) -> tuple[ModelSpec, list[str]]:
    """The spec of anything model_config takes, and the warnings its config calls for
    (config_notes)."""
    if isinstance(model, ModelSpec):
        return model, config_notes(model.hf_config, model) if model.hf_config else []
    config, name = model_config(model, trust_remote_code=trust_remote_code)
    spec = spec_from_config(config, name=name)
    return spec, config_notes(config, spec)


def catalog_note(name: str | None) -> list[str]:
    """The note a catalog entry carries where its config is not the checkpoint's own (an entry
    written from transformers' class defaults says so)."""
    entry = _entries().get(name) if name else None
    return [entry["note"]] if entry and entry.get("note") else []


def resolve_config(name_or_path: str, *, trust_remote_code: bool = False) -> tuple[dict, str]:
    """The config.json dict that resolve_model reads, and the name the model goes by (the
    catalog key, the path or the hub id as given), without reading it into a ModelSpec."""
    query = name_or_path.strip()
    if not query:
        raise UsageError("the model name is empty (run `memplan models` for the catalog)")

    key = _exact_key(query)
    if key is not None:
        return dict(_entries()[key]["config"]), key

    path = Path(query).expanduser()
    if path.exists():
        return _read_config(path), query
    # A hub id has one '/': more reads as a relative path (checkpoints/run1/final).
    reads_as_path = _WINDOWS_DRIVE.match(query) or query.endswith(".json") or query.count("/") > 1
    if query.startswith(_PATH_PREFIXES) or reads_as_path:
        raise MemplanError(f"no such file or folder: {query}")

    key = _substring_key(query)
    if key is not None:
        return dict(_entries()[key]["config"]), key

    if "/" in query:
        return _hub_config(query, trust_remote_code=trust_remote_code), query
    # Neither a name, nor a path, nor a hub id: a mistyped argument (exit 2), like a bad --gpu.
    raise UsageError(f"unknown model {query!r} (run `memplan models` for the catalog)")


def substituted_entry(name_or_path: str) -> CatalogModel | None:
    """The catalog entry resolve_model takes for a name that is neither a catalog name, nor a
    hub id of the catalog, nor an existing path, but contains or is contained in a catalog key
    (another checkpoint, e.g. a fine-tune with another context length); None otherwise."""
    query = name_or_path.strip()
    if not query or _exact_key(query) is not None or Path(query).expanduser().exists():
        return None
    try:
        key = _substring_key(query)
    except UsageError:
        return None
    return _catalog_model(key) if key is not None else None


def _exact_key(query: str) -> str | None:
    lowered = query.lower()
    for key, entry in _entries().items():
        if lowered == key or lowered == entry["hf_id"].lower():
            return key
    return None


def _substring_key(query: str) -> str | None:
    lowered = query.lower()
    contained = sorted((k for k in _entries() if k in lowered), key=len, reverse=True)
    if contained:
        best = [k for k in contained if len(k) == len(contained[0])]
        if len(best) > 1:
            raise UsageError(f"model name {query!r} is ambiguous; candidates: {', '.join(best)}")
        return best[0]
    containing = [k for k in _entries() if lowered in k]
    if len(containing) > 1:
        raise UsageError(f"model name {query!r} is ambiguous; candidates: {', '.join(containing)}")
    return containing[0] if containing else None


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise MemplanError(f"the folder {path} has no config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise MemplanError(f"{file} is not valid JSON ({e.msg}, line {e.lineno})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise MemplanError(f"cannot read {file}: {e}") from e
    if not isinstance(config, dict):
        raise MemplanError(f"{file} must hold a JSON object, not {type(config).__name__}")
    return config


def _hub_config(hub_id: str, *, trust_remote_code: bool) -> dict[str, Any]:
    """The config of a hub id: the local cache first, then one request to the hub, no retries.

    huggingface_hub retries a failed connection five times with backoff (about 25 s) and logs
    each try; a name that is not a repository should fail at once with one line instead."""
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
        from transformers import AutoConfig
    except ImportError as e:
        raise MemplanError(f"resolving the hub id {hub_id!r} needs transformers") from e

    def load(local_files_only: bool) -> Any:
        return AutoConfig.from_pretrained(
            hub_id, trust_remote_code=trust_remote_code, local_files_only=local_files_only
        )

    with _quiet_hub_loggers():
        try:
            config = load(local_files_only=True)
        # Not in the cache: transformers raises OSError or ValueError, depending on the version.
        except Exception:  # noqa: BLE001
            config = None
        if config is None:
            _check_repo_id(hub_id)
            if constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
                raise _unknown_hub_id(hub_id, "offline mode is on, and it is not cached")
            try:
                get_hf_file_metadata(
                    hf_hub_url(hub_id, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT
                )
            # Network, HTTP and repository errors alike mean "not reachable"; the reason says
            # which.
            except Exception as e:  # noqa: BLE001
                raise _unknown_hub_id(hub_id, _hub_failure(e)) from e
            try:
                config = load(local_files_only=False)
            except Exception as e:  # noqa: BLE001
                raise MemplanError(
                    f"the hub's config of {hub_id!r} cannot be read ({_first_line(e)})"
                ) from e
    return config.to_dict()


def _unknown_hub_id(hub_id: str, reason: str, *, usage: bool = False) -> MemplanError:
    """A hub id that gave no config: a UsageError (exit 2) when the id itself is malformed,
    else a MemplanError (exit 1: offline, unreachable, no such repository)."""
    error = UsageError if usage else MemplanError
    return error(
        f"unknown model {hub_id!r}: not a catalog name, not a local path, and not reachable on "
        f"the Hugging Face hub ({reason}); run `memplan models` for the catalog names"
    )


def _check_repo_id(hub_id: str) -> None:
    """UsageError (exit 2) for a name that cannot be a repository id ('a/b/c', 'org/{x}'),
    offline or not: a malformed argument, not an unreachable repository."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(hub_id)
    except HFValidationError as e:
        raise _unknown_hub_id(hub_id, "not a valid repository id", usage=True) from e


def _env_true(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().upper() in ("1", "ON", "YES", "TRUE") for n in names)


def _hub_failure(error: Exception) -> str:
    """A few words on why the hub did not give a config."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
    )

    if isinstance(error, HFValidationError):
        return "not a valid repository id"

    if isinstance(error, GatedRepoError):
        return "the repository is gated: accept its license and log in with `hf auth login`"
    if isinstance(error, RepositoryNotFoundError):
        return "no such repository, or a private one"
    if isinstance(error, EntryNotFoundError):
        return "the repository has no config.json"
    if type(error).__module__.startswith(("httpx", "requests", "urllib3")) or isinstance(
        error, ConnectionError | TimeoutError
    ):
        return "the hub cannot be reached"
    return _first_line(error)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return first if len(first) <= 120 else first[:117] + "..."


@contextlib.contextmanager
def _quiet_hub_loggers() -> Iterator[None]:
    """Silence huggingface_hub's and transformers' warnings: the caller reports in one line."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
