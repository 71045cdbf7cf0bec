"""`memplan verify` and `memplan report` with a fake child process: error paths, exit codes,
what is printed and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.schema import GIB, ProfileOp, ProfileTable, Report
from memplan.verify import predict, protocol, runner
from memplan.verify.cli import report_command, verify_command

from .fakes import FakeLauncher, estimate, ok_result, oom_result

FIXTURE = Path(__file__).parents[1] / "data" / "fixture_results.json"
BASE = ["--model", "qwen3-0.6b", "--batch", "4", "--seq", "1024", "--kernels", "none"]


@pytest.fixture
def fake_estimator(monkeypatch):
    monkeypatch.setattr(predict, "predict", lambda spec, setup, gpu=None: estimate(20.2, 15.0))


def use_child(monkeypatch, behaviour) -> FakeLauncher:
    launcher = FakeLauncher(behaviour)
    monkeypatch.setattr(runner, "launch", launcher)
    return launcher


def invoke(command, args):
    return CliRunner().invoke(command, args, catch_exceptions=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "4", "--seq", "8"], "Error: --model is required"),
        (["--model", "qwen3-0.6b", "--seq", "8"], "Error: --batch is required"),
        (BASE + ["--batch", "x"], "Error: --batch must be a positive integer, got 'x'"),
        (BASE + ["--steps", "2"], "Error: the protocol measures at least 3 steps, got --steps 2"),
        (BASE + ["--sweep", "batch"], "Error: --sweep takes NAME=V1,V2,..."),
        (BASE + ["--sweep", "colour=red"], "Error: cannot sweep 'colour'"),
        (BASE + ["--sweep", "batch=1,two"], "Error: --sweep batch: 'two' is not a valid value"),
        (BASE + ["--kernels", "rms_norm,warp_drive"], "Error: unknown kernel 'warp_drive'"),
        (BASE + ["--kernels", "geglu"], "Error: kernel 'geglu' does not apply to qwen3"),
        (BASE + ["--precision", "fp8"], "Error: precision: Input should be"),
        (BASE + ["--cpu-offload"], "Error: --cpu-offload needs --strategy fsdp2"),
        (
            BASE + ["--gpus", "2", "--strategy", "ddp", "--cpu-offload"],
            "Error: --cpu-offload needs --strategy fsdp2",
        ),
        (
            BASE + ["--gpus", "2", "--strategy", "zero3", "--cpu-offload"],
            "Error: --strategy zero3 with --cpu-offload is predicted only, not measured",
        ),
    ],
)
def test_usage_errors_are_one_line_exit_2(monkeypatch, args, message):
    launcher = use_child(monkeypatch, lambda case: ok_result())
    result = invoke(verify_command, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1
    assert launcher.cases == []  # nothing was run


def test_unknown_model_exit_2(monkeypatch):
    use_child(monkeypatch, lambda case: ok_result())
    result = invoke(verify_command, ["--model", "no-such-model-xyz", "--batch", "1", "--seq", "8"])
    assert result.exit_code == 2
    assert (
        result.stderr
        == "Error: unknown model 'no-such-model-xyz' (run `memplan models` for the catalog)\n"
    )


def test_no_gpu_is_one_line_exit_1(monkeypatch, fake_estimator):
    def no_gpu(case):
        fields = {
            "status": "error",
            "error_kind": "no_gpu",
            "error": "no CUDA GPU is available (torch.cuda.is_available() is False)",
        }
        return fields, protocol.EXIT_NO_GPU

    launcher = use_child(monkeypatch, no_gpu)
    result = invoke(verify_command, BASE + ["--sweep", "batch=1,2,4"])
    assert result.exit_code == 1
    assert result.stderr.endswith(
        "Error: no CUDA GPU is available (torch.cuda.is_available() is False)\n"
    )
    assert len(launcher.cases) == 1  # the sweep stops at the first case


def test_model_that_fails_to_build_exit_1(monkeypatch, fake_estimator):
    def broken(case):
        fields = {
            "status": "error",
            "error_kind": "build",
            "error": "the model failed to build: ValueError: bad config",
        }
        return fields, protocol.EXIT_BUILD

    use_child(monkeypatch, broken)
    result = invoke(verify_command, BASE)
    assert result.exit_code == 1
    assert result.stderr == "Error: the model failed to build: ValueError: bad config\n"


def test_oom_is_shown_next_to_the_prediction_exit_3(monkeypatch, fake_estimator, tmp_path):
    use_child(monkeypatch, lambda case: oom_result(78.5))
    out = tmp_path / "r.json"
    result = invoke(verify_command, BASE + ["--out", str(out)])
    assert result.exit_code == protocol.CLI_EXIT_OOM
    assert "out of memory above 78.50 GiB" in result.stdout
    assert "20.20 GiB" in result.stdout  # the prediction beside it
    assert result.stderr == "measured: 1 of 1 cases ran out of memory\n"
    saved = Report.model_validate_json(out.read_text())
    assert saved.measurements[0].status == "oom"


def test_results_table_json_and_file(monkeypatch, fake_estimator, tmp_path):
    launcher = use_child(monkeypatch, lambda case: ok_result(20.0, 15.0))
    out = tmp_path / "results.json"
    result = invoke(verify_command, BASE + ["--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    printed = Report.model_validate_json(result.stdout)
    saved = Report.model_validate_json(out.read_text())
    assert printed == saved
    (m,) = saved.measurements
    assert m.case == "qwen3-0.6b_b4_s1024_bf16_hf"
    assert m.peak_bytes == 20 * GIB and m.predicted.peak_bytes == int(20.2 * GIB)
    assert json.loads(result.stdout)["measurements"][0]["error_pct"] == pytest.approx(1.0)
    assert launcher.cases[0].setup.kernels == ()

    table = invoke(verify_command, BASE)
    assert table.exit_code == 0
    for cell in (
        "qwen3-0.6b_b4_s1024_bf16_hf",
        "15.00 GiB",
        "20.00 GiB",
        "20.20 GiB",
        "+1.00%",
        "22.00 GiB",
        "backward (loss backward)",
        "16,384",
    ):
        assert cell in table.stdout


def test_sweep_runs_every_case_in_order_with_progress(monkeypatch, fake_estimator):
    def behaviour(case):
        return oom_result() if case.setup.batch == 8 else ok_result()

    launcher = use_child(monkeypatch, behaviour)
    result = invoke(verify_command, BASE + ["--sweep", "batch=1,8", "--sweep", "seq=512,1024"])
    assert [(c.setup.batch, c.setup.seq) for c in launcher.cases] == [
        (1, 512),
        (1, 1024),
        (8, 512),
        (8, 1024),
    ]
    assert result.exit_code == protocol.CLI_EXIT_OOM
    assert "measuring" in result.stderr  # the progress bar
    assert "measured: 2 of 4 cases ran out of memory" in result.stderr


def test_a_failed_case_in_a_sweep_exit_1(monkeypatch, fake_estimator):
    def behaviour(case):
        if case.setup.batch == 2:
            return {"status": "error", "error_kind": "run", "error": "RuntimeError: x"}, 6
        return ok_result()

    use_child(monkeypatch, behaviour)
    result = invoke(verify_command, BASE + ["--sweep", "batch=1,2,4"])
    assert result.exit_code == 1
    assert result.stderr.endswith(
        "Error: 1 of 3 cases failed; first: qwen3-0.6b_b2_s1024_bf16_hf: RuntimeError: x\n"
    )


def test_kernels_auto_takes_the_advisors_plan(monkeypatch, fake_estimator):
    launcher = use_child(monkeypatch, lambda case: ok_result())
    args = ["--model", "qwen3-0.6b", "--batch", "4", "--seq", "1024"]
    result = invoke(verify_command, args)
    assert result.exit_code == 0, result.output
    kernels = launcher.cases[0].setup.kernels
    assert "flce" in kernels and launcher.cases[0].setup.flce_chunk is not None


def test_layers_override_builds_a_cut_model(monkeypatch, fake_estimator):
    launcher = use_child(monkeypatch, lambda case: ok_result())
    result = invoke(verify_command, BASE + ["--model", "llama-3-8b", "--layers", "4"])
    assert result.exit_code == 0, result.output
    case = launcher.cases[0]
    assert case.hf_config["num_hidden_layers"] == 4
    assert case.case.startswith("llama-3-8b-l4_b4_s1024")


def test_cpu_offload_measures_fsdp2_with_its_policy(monkeypatch, fake_estimator):
    launcher = use_child(monkeypatch, lambda case: ok_result())
    args = BASE + ["--gpus", "8", "--strategy", "fsdp2", "--cpu-offload"]
    result = invoke(verify_command, args)
    assert result.exit_code == 0, result.output
    case = launcher.cases[0]
    assert case.setup.cpu_offload and case.setup.gpus == 8
    assert "_fsdp2x8_offload_" in case.case


def test_profile_tables(monkeypatch, fake_estimator):
    def behaviour(case):
        if case.mode == "measure":
            return ok_result()
        op = ProfileOp(name="aten::mm", device_ms=5.0, calls=8, share=0.5)
        table = ProfileTable(steps=2, total_device_ms=10.0, ops=[op]).model_dump()
        return {"status": "ok", "profile": {"self": table}}, 0

    use_child(monkeypatch, behaviour)
    result = invoke(verify_command, BASE + ["--profile"])
    assert result.exit_code == 0, result.output
    assert "qwen3-0.6b_b4_s1024_bf16_hf: without patch" in result.stdout
    assert "10.00 ms GPU / step" in result.stdout
    assert "aten::mm" in result.stdout


def test_report_to_stdout_and_file(tmp_path):
    result = invoke(report_command, [str(FIXTURE)])
    assert result.exit_code == 0
    assert result.stdout.startswith("# memplan: predicted against measured peak memory")
    out = tmp_path / "acc.md"
    result = invoke(report_command, [str(FIXTURE), "--out", str(out)])
    assert result.exit_code == 0
    assert "FIXTURE: synthetic numbers" in out.read_text()


def test_report_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "acc.md"
    result = invoke(report_command, [str(FIXTURE), "--out", str(out), "--plot"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "acc_accuracy.png").exists() and (tmp_path / "acc_timeline.png").exists()
    assert "](acc_timeline.png)" in out.read_text()


def test_report_errors(tmp_path):
    result = invoke(report_command, [str(FIXTURE), "--plot"])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: --plot writes PNG files next to the report: give --out report.md\n"
    )
    result = invoke(report_command, [str(tmp_path / "none.json")])
    assert result.exit_code == 1 and result.stderr.startswith("Error: cannot read")


def test_report_recompute_uses_the_current_estimator(monkeypatch):
    monkeypatch.setattr(predict, "predict", lambda spec, setup, gpu=None: estimate(33.0, 1.0))
    monkeypatch.setattr(predict, "spec_from_hf_config", lambda config, name=None: None)
    result = invoke(report_command, [str(FIXTURE), "--recompute"])
    assert result.exit_code == 0
    assert "| fixture-b_b8_s2048_bf16_hf | none | 33.00 | 57.00 |" in result.stdout


def test_commands_are_registered_on_the_main_group():
    from memplan.cli import cli

    result = CliRunner().invoke(cli, ["report", str(FIXTURE)])
    assert result.exit_code == 0 and "## Summary" in result.stdout


def test_no_gpu_in_the_middle_of_a_sweep_keeps_the_cases_measured(monkeypatch, fake_estimator):
    def behaviour(case):
        if case.setup.batch == 3:
            return {"status": "error", "error_kind": "no_gpu", "error": "CUDA is not usable: x"}, 4
        return ok_result()

    launcher = use_child(monkeypatch, behaviour)
    out = Path("r.json")
    with CliRunner().isolated_filesystem():
        result = invoke(verify_command, BASE + ["--sweep", "batch=1,2,3,4", "--out", str(out)])
        saved = Report.model_validate_json(out.read_text())
    assert result.exit_code == 1
    assert [m.setup.batch for m in saved.measurements] == [1, 2]
    assert len(launcher.cases) == 3
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert error_lines == [
        "Error: CUDA is not usable: x; stopped at case 3 of 4 (2 measured, written to r.json)"
    ]
    assert "Traceback" not in result.stderr
    assert "qwen3-0.6b_b2_s1024_bf16_hf" in result.stdout  # the measured cases are shown


@pytest.mark.parametrize(
    "content",
    [
        "{}",
        '{"measurements": []}',
        '{"case": "x", "model": "m", "setup": {"batch": 1, "seq": 8}, "peak_bytes": 1}',
        '{"_protocol": "p", "llama32_1b_b8_s2048": {"peak_gib": 20.1}}',
    ],
    ids=["empty", "no-measurements", "one-measurement", "reference-file"],
)
def test_report_refuses_a_file_without_measurements(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    result = invoke(report_command, [str(path)])
    assert result.exit_code == 1
    assert result.stderr == f"Error: {path} is not a memplan results file (no measurements)\n"
    assert result.stdout == ""


def test_report_recompute_predicts_for_the_gpu_measured(monkeypatch, tmp_path):
    gpus = []

    def fake(spec, setup, gpu=None):
        gpus.append(gpu)
        return estimate(33.0, 1.0)

    monkeypatch.setattr(predict, "predict", fake)
    monkeypatch.setattr(predict, "spec_from_hf_config", lambda config, name=None: None)
    report = Report.model_validate_json(FIXTURE.read_text())
    total = 85 * 2**30
    env = {
        "gpu": "NVIDIA A100-SXM4-80GB",
        "compute_capability": "8.0",
        "gpu_total_bytes": str(total),
    }
    first = report.measurements[0]
    report.measurements[0] = first.model_copy(update={"env": {**first.env, **env}})
    path = tmp_path / "r.json"
    path.write_text(report.model_dump_json())
    result = invoke(report_command, [str(path), "--recompute"])
    assert result.exit_code == 0, result.output
    assert (gpus[0].name, gpus[0].compute_capability, gpus[0].memory_bytes) == (
        "NVIDIA A100-SXM4-80GB",
        (8, 0),
        total,
    )
    assert gpus[1] is None  # the fixture's other results say nothing of their GPU


def test_warnings_of_the_child_are_shown(monkeypatch, fake_estimator, tmp_path):
    def behaviour(case):
        fields, code = ok_result()
        return {
            **fields,
            "env": {**fields["env"], "warnings": "the timeline was not recorded"},
        }, code

    use_child(monkeypatch, behaviour)
    out = tmp_path / "r.json"
    result = invoke(verify_command, BASE + ["--out", str(out)])
    assert result.exit_code == 0, result.output
    warning = "qwen3-0.6b_b4_s1024_bf16_hf: the timeline was not recorded"
    assert result.stderr == f"Warning: {warning}\n"
    report = invoke(report_command, [str(out)])
    assert f"- {warning.replace(': ', ': warning: ', 1)}" in report.stdout
