"""memplan.versions: the table of validated versions, and the one warning line that advise, apply
and verify print when the installed versions lie outside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memplan.versions as versions
from memplan.versions import (  # the real one: the autouse fixture replaces the module's
    VALIDATED,
    installed_versions,
    unvalidated,
    warning_line,
)

ROOT = Path(__file__).resolve().parents[1]
INSIDE = {"torch": "2.13.0", "triton": "3.9.0", "transformers": "5.17.0"}


@pytest.mark.parametrize("row", [v for v in VALIDATED if v.gpu is not None], ids=lambda v: v.gpu)
def test_a_gpu_row_is_what_its_committed_results_ran_with(row):
    files = sorted(path for pattern in row.results for path in ROOT.glob(pattern))
    # measured runs only: first predictions, capacities and traced replays hold none
    reports = {path: json.loads(path.read_text()).get("measurements") for path in files}
    reports = {path: ms for path, ms in reports.items() if ms is not None}
    assert reports
    want = {"torch": row.torch, "triton": row.triton, "transformers": row.transformers}
    for path, measurements in reports.items():
        envs = [m["env"] for m in measurements]
        assert envs and all(env["gpu"] == row.gpu for env in envs), path
        for env in envs:
            assert {p: versions.release(env[p]) for p in versions.PACKAGES} == want, path


def test_versions_are_read_without_torch():
    code = (
        "import sys; from memplan.versions import installed_versions; installed_versions(); "
        "assert 'torch' not in sys.modules"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_installed_versions_are_releases():
    found = installed_versions()
    assert set(found) == set(versions.PACKAGES)
    assert all(v is None or "+" not in v for v in found.values())
    assert versions.release("2.11.0+cu130") == "2.11.0"


def test_inside_the_table_nothing_is_said():
    assert unvalidated(INSIDE) == [] and warning_line(INSIDE) is None
    assert warning_line({**INSIDE, "triton": None}) is None  # not installed: nothing to say
    assert warning_line(INSIDE, gpu="NVIDIA H200") is None


@pytest.mark.parametrize(
    "change, named",
    [
        ({"torch": "2.12.0"}, "torch 2.12.0"),
        ({"triton": "3.7.0"}, "triton 3.7.0"),
        ({"transformers": "5.99.0"}, "transformers 5.99.0"),
    ],
)
def test_outside_the_table_is_one_warning_line(change, named):
    line = warning_line({**INSIDE, **change}, gpu="NVIDIA A100-SXM4-80GB")
    assert line.startswith("Warning: ") and "\n" not in line
    assert f"not validated with {named}, GPU NVIDIA A100-SXM4-80GB (" in line


def test_advise_prints_the_warning_and_keeps_errors_one_line(monkeypatch, capsys):
    from memplan.cli import main

    outside = {**INSIDE, "torch": "2.12.0"}
    monkeypatch.setattr(versions, "installed_versions", lambda: dict(outside))
    with pytest.raises(SystemExit) as done:
        main(["advise", "--model", "llama-3.2-1b", "--batch", "1", "--seq", "64"])
    assert done.value.code == 0
    assert capsys.readouterr().err.splitlines() == [warning_line(outside)]
    with pytest.raises(SystemExit):
        main(["advise", "--model", "no-such-model", "--batch", "1", "--seq", "64"])
    assert [line[:6] for line in capsys.readouterr().err.splitlines()] == ["Error:"]


def test_apply_prints_the_warning(monkeypatch, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    import memplan.patching as mp

    outside = {**INSIDE, "triton": "3.7.0"}
    monkeypatch.setattr(versions, "installed_versions", lambda: dict(outside))
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    mp.apply(LlamaForCausalLM(config), kernels=["rms_norm"])
    assert capsys.readouterr().err.splitlines() == [warning_line(outside)]
