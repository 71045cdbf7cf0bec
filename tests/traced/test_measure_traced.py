"""benchmarks/measure_traced.py with a fake child process: predictions are written before any
case runs, and every measurement carries its traced prediction."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memplan.schema import Report
from memplan.verify import runner
from tests.verify.fakes import FakeLauncher, ok_result

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import measure_traced  # noqa: E402


def test_cases_cover_six_unregistered_model_types_plain_and_lora() -> None:
    from memplan.catalog import SUPPORTED_MODEL_TYPES

    cases = measure_traced.verify_cases(None)
    types = {c.model_type for c in cases}
    assert len(types) >= 6 and not types & set(SUPPORTED_MODEL_TYPES)
    for model_type in types:
        lora = [c.setup.lora_rank for c in cases if c.model_type == model_type]
        assert None in lora and 16 in lora
    assert len({c.case for c in cases}) == len(cases)


def test_predicts_first_then_measures(monkeypatch, tmp_path) -> None:
    order: list[str] = []
    real_predict = measure_traced.predict

    def predict(cases, gpu):
        order.append("predict")
        return real_predict(cases, gpu)

    def child(case):
        order.append("measure")
        return ok_result(20.0, 15.0)

    monkeypatch.setattr(measure_traced, "predict", predict)
    monkeypatch.setattr(runner, "launch", FakeLauncher(child))
    code = measure_traced.main(
        ["--out-dir", str(tmp_path), "--only", "^gpt2_b16", "--parallel", "2"]
    )
    assert code == 0 and order == ["predict", "measure", "measure"]
    predictions = json.loads((tmp_path / measure_traced.PREDICTIONS).read_text())
    report = Report.model_validate_json((tmp_path / measure_traced.RESULTS).read_text())
    assert [m.case for m in report.measurements] == list(predictions["predictions"])
    assert all(m.predicted and m.predicted.method == "traced" for m in report.measurements)
    assert "median |error|" in (tmp_path / measure_traced.REPORT).read_text()
    # measuring from predictions made earlier
    order.clear()
    code = measure_traced.main(
        [
            "--out-dir",
            str(tmp_path / "again"),
            "--only",
            "^gpt2_b16_s1024_bf16_hf",
            "--predictions",
            str(tmp_path / measure_traced.PREDICTIONS),
        ]
    )
    assert code == 0 and order == ["measure"]
