"""`memplan report` and `memplan verify` on files a user gets wrong: one `Error:` line each and
nothing written, through click's runner and as a process (exit codes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.errors import MemplanError
from memplan.verify import runner
from memplan.verify.cli import report_command, verify_command
from memplan.verify.report import load_reports

from .fakes import FakeLauncher, ok_result

FIXTURE = Path(__file__).parents[1] / "data" / "fixture_results.json"


def invoke(command, args):
    return CliRunner().invoke(command, args, catch_exceptions=False)


def memplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args], capture_output=True, text=True, timeout=120
    )


def test_a_file_that_is_not_utf8_is_one_line(tmp_path) -> None:
    """It was a UnicodeDecodeError traceback."""
    binary = tmp_path / "results.json"
    binary.write_bytes(b'{"measurements": [\xff\xfe]}')
    run = memplan("report", str(binary))
    assert run.returncode == 1
    assert (
        run.stderr == f"Error: {binary} is not a memplan results file (not UTF-8 text: byte 18)\n"
    )


def test_a_file_that_is_not_json_says_so(tmp_path) -> None:
    """It printed "(: Invalid JSON ...)", the location of the error being empty."""
    text = tmp_path / "notes.txt"
    text.write_text("predicted 18 GiB, measured 18 GiB")
    with pytest.raises(MemplanError) as caught:
        load_reports([text])
    assert str(caught.value).startswith(f"{text} is not a memplan results file (Invalid JSON")
    assert "(:" not in str(caught.value)


def test_a_negative_size_is_refused(tmp_path) -> None:
    """A negative measured peak was reported as an error of -387712911460.00%."""
    report = json.loads(FIXTURE.read_text())
    report["measurements"][0]["peak_bytes"] = -1
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(report))
    result = invoke(report_command, [str(damaged)])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: {damaged} is not a valid memplan results file (measurements.0.peak_bytes is -1 "
        "bytes; a memory size cannot be negative)\n"
    )
    report["measurements"][0]["peak_bytes"] = 10
    report["measurements"][0]["predicted"]["peak_bytes"] = -(2**40)
    damaged.write_text(json.dumps(report))
    with pytest.raises(MemplanError, match=r"measurements.0.predicted.peak_bytes is -1,099,"):
        load_reports([damaged])


@pytest.mark.parametrize("plot", [[], ["--plot"]])
def test_report_out_in_a_missing_folder_is_one_line(tmp_path, plot) -> None:
    """It was a FileNotFoundError traceback after the work was done."""
    out = tmp_path / "no" / "such" / "report.md"
    run = memplan("report", str(FIXTURE), "--out", str(out), *plot)
    assert run.returncode == 2
    assert run.stderr == f"Error: --out {out}: the folder {out.parent} does not exist\n"
    assert not (tmp_path / "no").exists()


def test_an_unknown_timeline_case_writes_nothing(tmp_path) -> None:
    """--plot --timeline-case nosuch wrote the accuracy figure before failing."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "report.md"
    result = invoke(
        report_command, [str(FIXTURE), "--out", str(out), "--plot", "--timeline-case", "nosuch"]
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: no case named 'nosuch' has a measured memory timeline")
    assert "these have one: fixture-a_b4_s1024_bf16_hf" in result.stderr
    assert list(tmp_path.iterdir()) == []
    result = invoke(report_command, [str(FIXTURE), "--timeline-case", "fixture-a_b4_s1024_bf16_hf"])
    assert result.exit_code == 2
    assert (
        result.stderr == "Error: --timeline-case chooses the timeline of --plot: give --plot too\n"
    )


def test_verify_out_in_a_missing_folder_is_refused_before_any_run(tmp_path, monkeypatch) -> None:
    """The results of a long sweep were lost to a traceback at the end."""
    launcher = FakeLauncher(lambda case: ok_result())
    monkeypatch.setattr(runner, "launch", launcher)
    out = tmp_path / "missing" / "results.json"
    args = ["--model", "qwen3-0.6b", "--batch", "4", "--seq", "1024", "--out", str(out)]
    result = invoke(verify_command, args)
    assert result.exit_code == 2
    assert result.stderr == f"Error: --out {out}: the folder {out.parent} does not exist\n"
    assert launcher.cases == []
