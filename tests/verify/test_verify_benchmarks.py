"""The GPU scripts benchmarks/measure_grid.py and benchmarks/bench_e2e.py, run here with a fake
child process so that the hour on the GPU is not spent finding a typo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memplan.schema import GIB, Report
from memplan.verify import runner

from .fakes import FakeLauncher, ok_result, oom_result

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import bench_e2e  # noqa: E402
import measure_grid  # noqa: E402


@pytest.fixture(
    params=["qwen3-0.6b batch 4", pytest.param("whole grid", marks=pytest.mark.slow)],
)
def grid(request, monkeypatch) -> None:
    """The GRID that grid_cases plans: by default only its qwen3-0.6b rows at batch 4 (planning
    all of it takes about 20 s), under `-m slow` all of it."""
    if request.param == "qwen3-0.6b batch 4":
        rows = [c for c in measure_grid.GRID if (c.model, c.batch) == ("qwen3-0.6b", 4)]
        monkeypatch.setattr(measure_grid, "GRID", rows)


# plans every case of the grid; the run tests below plan its qwen3-0.6b rows at batch 4
@pytest.mark.slow
def test_grid_has_every_setup_twice_half_with_kernels():
    cases = measure_grid.grid_cases(steps=3, only=None)
    assert len(cases) >= 36
    assert all(spec is not None for _, spec in cases)  # the planner worked for every case
    with_kernels = [c for c, _ in cases if c.setup.kernels]
    assert len(with_kernels) * 2 == len(cases)
    names = [c.case for c, _ in cases]
    assert len(set(names)) == len(names)
    setups = [c.setup for c, _ in cases]
    assert {s.precision for s in setups} == {"bf16", "amp-bf16", "amp-fp16", "fp32"}
    assert any(s.grad_checkpointing for s in setups) and any(s.attn == "eager" for s in setups)
    assert any(s.lora_rank for s in setups)
    assert any(c.hf_config["num_hidden_layers"] == 4 for c, _ in cases)


def test_grid_run_saves_every_case_and_writes_the_report(grid, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: ok_result(20.0, 15.0)))
    cases = measure_grid.grid_cases(steps=3, only="qwen3-0.6b_b4_s1024_bf16_(hf|rms)")
    results = tmp_path / measure_grid.RESULTS
    report = measure_grid.run_all(cases, results, budget_s=600, timeout_s=60)
    saved = Report.model_validate_json(results.read_text())
    assert saved == report and len(saved.measurements) == 2
    assert all(m.predicted is not None for m in saved.measurements)
    measure_grid.summarize(report)
    measure_grid.write_report(report, tmp_path, results)
    assert "| none | 1 |" in (tmp_path / measure_grid.REPORT).read_text()


def test_grid_budget_stops_new_cases(grid, monkeypatch, tmp_path, capsys):
    launcher = FakeLauncher(lambda case: ok_result())
    monkeypatch.setattr(runner, "launch", launcher)
    cases = measure_grid.grid_cases(steps=3, only="qwen3-0.6b")
    report = measure_grid.run_all(cases, tmp_path / "r.json", budget_s=-1, timeout_s=60)
    assert report.measurements == [] and launcher.cases == []
    assert "run them with: --only" in capsys.readouterr().out


def test_planner_failure_still_measures(monkeypatch):
    import memplan.verify.cases as cases_module

    def broken(*args, **kwargs):
        raise RuntimeError("catalog bug")

    monkeypatch.setattr(cases_module, "plan_cases", broken)
    case, spec = measure_grid.plan("gemma-2b", 2, 128, {}, kernels="auto", layers=4)
    assert spec is None
    # gemma-2b's config says exact "gelu": geglu (its exact variant) from the shared table.
    assert case.setup.kernels == ("rms_norm", "rope", "geglu", "flce")
    assert case.hf_config["num_hidden_layers"] == 4 and case.model == "gemma-2b-l4"


@pytest.mark.parametrize("liger_installed", [True, False])
def test_e2e_table(monkeypatch, liger_installed):
    def behaviour(case):
        if case.liger:
            return ok_result(26.0, 20.0)
        return (
            oom_result()
            if case.setup.batch == 4 and not case.setup.kernels
            else ok_result(25.0 if case.setup.kernels else 57.0, 20.0)
        )

    monkeypatch.setattr(runner, "launch", FakeLauncher(behaviour))
    measurements = []
    for model, layers, batch, seq in bench_e2e.CASES:
        for variant in bench_e2e.VARIANTS:
            if variant == "liger" and not liger_installed:
                continue
            case, spec = measure_grid.plan(
                model,
                batch,
                seq,
                {},
                kernels="all" if variant == "memplan" else "none",
                layers=layers,
                steps=10,
                liger=variant == "liger",
            )
            measurements.append(runner.run_case(case, spec=spec))
    text = bench_e2e.render(Report(measurements=measurements), liger=None, steps=10)
    assert "| llama-3.2-1b, batch 8, seq 2048 | 57.00 | 16,384 |" in text
    assert "| llama-3-8b-l4, batch 8, seq 2048 |" in text
    if liger_installed:
        # memplan 25.0 vs Liger 26.0 GiB and the same speed: the speed goal is missed
        assert "| 0.962 | 1.000 | no |" in text
        assert "OOM above 78.50" in text  # qwen2.5 and gemma HF at batch 4 in the fake
    else:
        assert "liger-kernel not installed" in text and "| not run |" in text
    memplan_runs = [m for m in measurements if m.setup.kernels]
    assert all("flce" in m.setup.kernels for m in memplan_runs)
    assert all(m.predicted and m.predicted.peak_bytes > GIB for m in memplan_runs)
