"""tools/record_saved_tensors.py, the generator of the saved-tensor fixtures, run on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "record_saved_tensors.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("record_saved_tensors", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_records_every_precision_and_attention(tmp_path, monkeypatch) -> None:
    """`--lora` (the command its docstring gives) records each family's adapter placements in
    every precision and attention, each a list of saved tensors."""
    tool = load_tool()
    monkeypatch.setattr(tool, "FAMILIES", {"llama": {}})
    monkeypatch.setattr(tool, "LORA_TARGETS", {"llama": (("q_proj", "v_proj"),)})
    out = tmp_path / "saved.json"
    argv = ["record_saved_tensors.py", "--lora", "--device", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    tool.main()
    result = json.loads(out.read_text())
    assert result["lora"] == {"r": 16, "alpha": 32}
    assert sorted(result["saved"]) == [
        f"llama/{precision}/{attn}/q_proj+v_proj"
        for precision in ("amp-bf16", "bf16", "fp32")
        for attn in ("eager", "sdpa")
    ]
    assert all(isinstance(saved, list) and saved for saved in result["saved"].values())
