"""The parent side with a fake child: result files, exit codes, crashes, predictions, profiles."""

from __future__ import annotations

import subprocess

import pytest

from memplan.schema import GIB, ProfileTable, TrainSetup, VerifyCase
from memplan.verify import predict, protocol, runner

from .fakes import TINY_LLAMA, FakeLauncher, estimate, ok_result, oom_result


@pytest.fixture
def fake_estimator(monkeypatch):
    calls = []

    def fake(spec, setup, gpu=None):
        calls.append((spec, setup))
        return estimate(20.2, 15.0)

    monkeypatch.setattr(predict, "predict", fake)
    return calls


def make_case(**setup) -> VerifyCase:
    return VerifyCase(
        case="tiny",
        model="tiny-llama",
        model_type="llama",
        hf_config=TINY_LLAMA,
        setup=TrainSetup(batch=2, seq=16, **setup),
    )


def test_ok_result_gets_the_prediction(monkeypatch, fake_estimator):
    launcher = FakeLauncher(lambda case: ok_result(20.0, 15.0))
    monkeypatch.setattr(runner, "launch", launcher)
    m = runner.run_case(make_case())
    assert m.status == "ok"
    assert m.peak_bytes == 20 * GIB
    assert m.error_pct == pytest.approx(1.0)
    assert m.step1_error_pct == pytest.approx(0.0)
    # the spec is rebuilt from the exact config the child built
    spec, setup = fake_estimator[0]
    assert spec.hidden_size == TINY_LLAMA["hidden_size"] and setup == make_case().setup


def test_estimator_failure_keeps_the_measurement(monkeypatch):
    def broken(spec, setup, gpu=None):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(predict, "predict", broken)
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: ok_result()))
    m = runner.run_case(make_case())
    assert m.status == "ok" and m.peak_bytes == 20 * GIB
    assert m.predicted is None
    assert m.prediction_error == "ZeroDivisionError: division by zero"


def test_oom_is_reported_next_to_the_prediction(monkeypatch, fake_estimator):
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: oom_result(78.5)))
    m = runner.run_case(make_case())
    assert m.status == "oom"
    assert m.oom_above_bytes == int(78.5 * GIB)
    assert m.predicted.peak_bytes == int(20.2 * GIB)
    assert m.error_pct is None


def test_child_without_result_is_a_crash(monkeypatch, fake_estimator):
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: (None, -11)))
    m = runner.run_case(make_case())
    assert (m.status, m.error_kind) == ("error", "crash")
    assert m.error == "the worker exited with code -11 without a result: Boom"


def test_exit_code_must_match_the_status(monkeypatch, fake_estimator):
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: (ok_result()[0], 1)))
    m = runner.run_case(make_case())
    assert m.error_kind == "crash"
    assert m.error == "the worker wrote status ok but exited 1"


def test_torchrun_exits_1_for_a_rank_out_of_memory(monkeypatch, fake_estimator):
    """torchrun reports a failed rank with its own exit code, not the worker's."""
    launcher = FakeLauncher(lambda case: (oom_result(78.5)[0], 1))
    monkeypatch.setattr(runner, "launch", launcher)
    case = make_case().model_copy(
        update={"ranks": "torchrun", "setup": TrainSetup(batch=2, seq=16, strategy="ddp", gpus=2)}
    )
    m = runner.run_case(case)
    assert m.status == "oom" and m.oom_above_bytes is not None


def test_timeout(monkeypatch, fake_estimator):
    def hang(argv, *, env, timeout_s):
        raise subprocess.TimeoutExpired(argv, timeout_s)

    monkeypatch.setattr(runner, "launch", hang)
    m = runner.run_case(make_case(), timeout_s=30)
    assert m.error == "the worker did not finish within 30 s"


def test_liger_runs_get_no_prediction(monkeypatch, fake_estimator):
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: ok_result()))
    m = runner.run_case(make_case().model_copy(update={"liger": True}))
    assert m.liger and m.predicted is None and m.prediction_error is None
    assert fake_estimator == []


def test_profile_runs_two_more_processes(monkeypatch, fake_estimator):
    def behaviour(case):
        if case.mode == "measure":
            return ok_result()
        total = 10.0 if case.setup.kernels else 12.0
        table = ProfileTable(steps=2, total_device_ms=total).model_dump()
        return {"status": "ok", "profile": {"self": table}}, protocol.EXIT_OK

    launcher = FakeLauncher(behaviour)
    monkeypatch.setattr(runner, "launch", launcher)
    m = runner.run_case(make_case(kernels=("rms_norm",)), profile=True)
    assert [(c.mode, c.setup.kernels) for c in launcher.cases] == [
        ("measure", ("rms_norm",)),
        ("profile", ()),
        ("profile", ("rms_norm",)),
    ]
    assert m.profile["without_patch"].total_device_ms == 12.0
    assert m.profile["with_patch"].total_device_ms == 10.0


def test_child_environment_finds_this_memplan(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = runner._child_env(make_case())
    assert env["PYTHONPATH"].split(":")[:2] == [runner._PACKAGE_ROOT, "/elsewhere"]


def test_child_environment_sets_the_cases_allocator_setting(monkeypatch):
    monkeypatch.setenv(runner.ALLOC_CONF_ENV, "max_split_size_mb:128")
    assert runner.ALLOC_CONF_ENV not in runner._child_env(make_case())
    expandable = make_case(expandable_segments=True)
    assert runner._child_env(expandable)[runner.ALLOC_CONF_ENV] == "expandable_segments:True"


def test_prediction_is_for_the_gpu_measured_not_the_gpu_option(monkeypatch):
    from memplan.catalog import resolve_gpu

    def a100_result(case):
        fields, code = ok_result()
        env = {**fields["env"], "compute_capability": "8.0", "gpu_total_bytes": str(80 * GIB)}
        return {**fields, "env": env}, code

    monkeypatch.setattr(runner, "launch", FakeLauncher(a100_result))
    case = make_case()
    spec = predict.spec_from_hf_config(TINY_LLAMA, "tiny-llama")
    h100 = resolve_gpu("h100")  # what --gpu said (compute capability 9.0)
    m = runner.run_case(case, spec=spec, gpu=h100)
    on_a100 = predict.predict(
        spec, case.setup, h100.model_copy(update={"compute_capability": (8, 0)})
    )
    # the allocated prediction for the A100's workspace; reserved for the A100's capacity
    assert m.predicted.model_copy(update={"reserved": None}) == on_a100.model_copy(
        update={"reserved": None}
    )
    assert m.predicted.reserved.capacity_bytes < 80 * GIB
    # cuBLAS's default workspace, twice: 32 MiB from Hopper on, 8 MiB + 128 KiB before
    assert predict.predict(spec, case.setup, h100).peak_bytes - m.predicted.peak_bytes == 50_069_504
    # a result written before the worker recorded its GPU falls back to the option
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda c: ok_result()))
    assert runner.run_case(case, spec=spec, gpu=h100).predicted.peak_bytes == (
        predict.predict(spec, case.setup, h100).peak_bytes
    )
