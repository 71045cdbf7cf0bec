"""Review of session 10: the probe script's --lora flag, missing Windows paths."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from memplan.catalog.models import resolve_model
from memplan.errors import MemplanError

PROBE_MEMORY = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_memory.py"


def load_probe_memory():
    spec = importlib.util.spec_from_file_location("probe_memory", PROBE_MEMORY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_memory_saved_with_lora_flag(tmp_path, monkeypatch) -> None:
    """`probe_memory.py saved --lora` (the command its docstring gives) passed the flag's string
    to run_saved, whose key ["+".join(targets)] * lora raised TypeError before any model ran."""
    probe = load_probe_memory()
    monkeypatch.setattr(probe, "FAMILIES", {"llama": {}})
    monkeypatch.setattr(probe, "LORA_TARGETS", {"llama": (("q_proj", "v_proj"),)})
    out = tmp_path / "saved.json"
    argv = ["probe_memory.py", "saved", "--lora", "--device", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    probe.main()
    result = json.loads(out.read_text())
    assert result["lora"] == {"r": 16, "alpha": 32}
    assert sorted(result["saved"]) == [
        f"llama/{precision}/{attn}/q_proj+v_proj"
        for precision in ("amp-bf16", "bf16", "fp32")
        for attn in ("eager", "sdpa")
    ]
    assert all(isinstance(saved, list) and saved for saved in result["saved"].values())


@pytest.mark.parametrize(
    "path", ["C:/models/llama-3", "C:\\models\\llama-3", "d:\\ckpt", "..\\ckpt\\config"]
)
def test_a_missing_windows_path_is_no_such_file(path) -> None:
    """A Windows path that does not exist fell through to the hub id check ('C:/x/y': "not a
    valid repository id", exit 2) or the catalog's unknown name ('C:\\x'), where the POSIX
    forms ('/x', './x', '../x', '.\\x') say "no such file or folder" (exit 1)."""
    with pytest.raises(MemplanError, match="no such file or folder") as raised:
        resolve_model(path)
    assert raised.value.exit_code == 1
