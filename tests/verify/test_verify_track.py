"""`memplan.track` with a fake memory reader."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import MemplanError
from memplan.schema import GIB, Plan

from .fakes import estimate


class FakeReader:
    def __init__(self, peak: int) -> None:
        self.peak = peak
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_allocated(self) -> int:
        return self.peak

    def peak_reserved(self) -> int:
        return self.peak + GIB


def test_measured_peak_against_the_plan(capsys):
    reader = FakeReader(20 * GIB)
    plan = Plan(kernels=("flce",), predicted_peak_bytes=int(20.4 * GIB))
    with memplan.track(plan, reader=reader) as t:
        assert reader.resets == 1  # reset on entry, before the loop runs
        assert t.result is None
    assert t.measured_peak_bytes == 20 * GIB
    assert t.result.reserved_bytes == 21 * GIB
    assert t.error_pct == pytest.approx(2.0)
    assert t.result.status == "ok"
    assert capsys.readouterr().err == (
        "memplan.track: measured peak 20.00 GiB, predicted 20.40 GiB (+2.0%)\n"
    )


def test_predictions_from_advice_estimate_and_bytes():
    e = estimate(10.0, 8.0)
    with memplan.track(e, reader=FakeReader(10 * GIB), quiet=True) as t:
        pass
    assert t.error_pct == pytest.approx(0.0, abs=1e-6)
    with memplan.track(5 * GIB, reader=FakeReader(10 * GIB), quiet=True) as t:
        pass
    assert t.error_pct == pytest.approx(-50.0)
    with memplan.track(reader=FakeReader(10 * GIB), quiet=True) as t:
        pass
    assert t.error_pct is None and t.summary() == "memplan.track: measured peak 10.00 GiB"


def test_out_of_memory_is_recorded_and_raised(capsys):
    class OutOfMemoryError(RuntimeError):  # what torch raises, by name
        pass

    with pytest.raises(OutOfMemoryError):
        with memplan.track(int(30 * GIB), reader=FakeReader(79 * GIB)) as t:
            raise OutOfMemoryError("CUDA out of memory")
    assert t.result.status == "oom"
    assert capsys.readouterr().err == (
        "memplan.track: measured peak out of memory above 79.00 GiB, predicted 30.00 GiB\n"
    )


def test_other_exceptions_pass_through():
    with pytest.raises(KeyError):
        with memplan.track(reader=FakeReader(GIB), quiet=True) as t:
            raise KeyError("x")
    assert t.result.status == "error"


def test_bad_plan_type():
    with pytest.raises(MemplanError, match="memplan.track takes a Plan"):
        memplan.track("auto")


def test_no_gpu_without_a_reader(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemplanError, match="no CUDA GPU is available"):
        with memplan.track():
            pass


def test_nested_blocks_are_refused_and_the_outer_still_measures():
    with memplan.track(reader=FakeReader(GIB), quiet=True) as outer:
        with pytest.raises(MemplanError, match="cannot be nested"):
            with memplan.track(reader=FakeReader(GIB), quiet=True):
                pass
    assert outer.result.status == "ok" and outer.measured_peak_bytes == GIB
    with memplan.track(reader=FakeReader(GIB), quiet=True) as again:  # the count is back to 0
        pass
    assert again.result.status == "ok"


class _FaultyReader(FakeReader):
    def peak_allocated(self) -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_blocks_own_error_is_the_one_raised(capsys):
    with pytest.raises(ValueError, match="the loop's own"):
        with memplan.track(GIB, reader=_FaultyReader(GIB)) as t:
            raise ValueError("the loop's own error")
    assert t.result.status == "error" and t.result.measured_peak_bytes is None
    assert t.result.error_pct is None
    assert "peak could not be read" in capsys.readouterr().err


def test_error_pct_only_for_a_block_that_ran_to_its_end():
    with pytest.raises(RuntimeError):
        with memplan.track(int(30 * GIB), reader=FakeReader(79 * GIB), quiet=True) as t:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert t.result.status == "oom" and t.result.error_pct is None
