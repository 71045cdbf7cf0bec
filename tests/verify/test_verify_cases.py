"""Planning cases (sweeps, kernels, plans, layer cuts), the timeline reader, the real child
process without a GPU, and the Python API."""

from __future__ import annotations

import pytest
import torch

import memplan
from memplan.errors import MemplanError, UsageError
from memplan.schema import GIB, MemoryEvent, Plan, TrainSetup, VerifyCase
from memplan.verify import predict, runner
from memplan.verify.allocator_trace import downsample, events_from_trace, marker_sizes
from memplan.verify.cases import parse_kernels, parse_sweeps, plan_cases
from memplan.verify.protocol import case_name

from .fakes import TINY_LLAMA, FakeLauncher, estimate, ok_result


def test_parse_sweeps():
    sweeps = parse_sweeps(
        ["batch=1,2", "grad-checkpointing=off,on", "kernels=none,rms_norm+flce,auto"]
    )
    assert sweeps == {
        "batch": [1, 2],
        "grad_checkpointing": [False, True],
        "kernels": [(), ("rms_norm", "flce"), "auto"],
    }
    with pytest.raises(UsageError, match="--sweep batch is given twice"):
        parse_sweeps(["batch=1", "batch=2"])


def test_parse_kernels_orders_names():
    assert parse_kernels("flce,rms_norm") == ("rms_norm", "flce")
    assert parse_kernels("none") == () and parse_kernels("ALL") == "all"


def test_case_names():
    setup = TrainSetup(
        batch=2,
        seq=512,
        precision="amp-bf16",
        grad_checkpointing=True,
        attn="eager",
        lora_rank=8,
        kernels=("rms_norm", "flce"),
        flce_chunk=1024,
    )
    assert case_name("org/model", setup) == (
        "org--model_b2_s512_amp-bf16_gc_eager_lora8-q_proj+v_proj_rms+flce_chunk1024"
    )
    assert case_name("m", TrainSetup(batch=1, seq=8), liger=True) == "m_b1_s8_bf16_liger"
    sharded = TrainSetup(batch=1, seq=8, strategy="fsdp2", gpus=64, reshard_after_forward=False)
    assert case_name("m", sharded) == "m_b1_s8_bf16_fsdp2x64_keep_hf"
    fla = TrainSetup(batch=1, seq=8, deltanet_kernels="fla", deltanet_conv="causal_conv1d")
    assert case_name("m", fla) == "m_b1_s8_bf16_fla_causal-conv1d_hf"


def test_plan_overrides_kernels_micro_batch_and_checkpointing():
    plan = Plan(
        kernels=("rms_norm", "flce"),
        flce_chunk=2048,
        micro_batch=2,
        grad_accum=4,
        grad_checkpointing=True,
    )
    (item,) = plan_cases("qwen3-0.6b", batch=8, seq=1024, plan=plan, kernels="none")
    s = item.case.setup
    assert (s.batch, s.grad_accum, s.grad_checkpointing) == (2, 4, True)
    assert (s.kernels, s.flce_chunk) == (("rms_norm", "flce"), 2048)


def test_layer_sweep_and_unknown_option():
    items = plan_cases("llama-3.2-1b", batch=1, seq=64, kernels="none", sweeps={"layers": [2, 4]})
    assert [i.spec.num_hidden_layers for i in items] == [2, 4]
    assert [i.case.case for i in items] == [
        "llama-3.2-1b-l2_b1_s64_bf16_hf",
        "llama-3.2-1b-l4_b1_s64_bf16_hf",
    ]
    with pytest.raises(UsageError, match="unknown setup option colour"):
        plan_cases("llama-3.2-1b", batch=1, seq=64, colour="red")


def test_config_objects_are_accepted():
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama", **{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    )
    (item,) = plan_cases(config, batch=1, seq=8, kernels="none")
    assert item.spec.hidden_size == 32 and item.case.model_type == "llama"


def test_events_from_trace_tracks_allocated_bytes_between_markers():
    fwd, bwd = marker_sizes(2)
    trace = [
        {"action": "alloc", "addr": 10, "size": 100},  # before any marker
        {"action": "segment_alloc", "addr": 0, "size": 2**21},  # not a tensor
        {"action": "alloc", "addr": 1, "size": fwd},
        {"action": "free_requested", "addr": 1, "size": fwd},
        {"action": "alloc", "addr": 11, "size": 512},
        {"action": "free_completed", "addr": 10, "size": 100},  # counted at free_requested
        {"action": "alloc", "addr": 1, "size": bwd},
        {"action": "free_requested", "addr": 1, "size": bwd},
        {"action": "free_requested", "addr": 11, "size": 512},
        {"action": "alloc", "addr": 12, "size": fwd},  # a tensor of a marker's size, later
    ]
    events = events_from_trace(trace, baseline_bytes=1000, phases=["forward", "backward"])
    assert [(e.phase, e.allocated_bytes) for e in events] == [
        ("before", 1100),
        ("forward", 1612),
        ("backward", 1100),
        ("backward", 1100 + fwd),
    ]


def test_marker_sizes_for_any_number_of_phases():
    # grad_accum 5: 2 markers per micro-batch + optimizer, zero_grad, end = 13 (was a ValueError)
    sizes = marker_sizes(13)
    assert len(set(sizes)) == 13 and all(s % 512 == 0 for s in sizes)
    assert marker_sizes(12) == sizes[:12]  # the same sizes for the first phases
    primes = [s // 512 for s in marker_sizes(200)]
    assert primes[0] == 1021 and primes == sorted(set(primes))
    assert all(all(p % d for d in range(2, int(p**0.5) + 1)) for p in primes)


def test_downsample_keeps_the_shape_and_the_peak():
    events = [
        MemoryEvent(index=i, phase="forward", allocated_bytes=(i * 7919) % 1000)
        for i in range(10_000)
    ]
    kept = downsample(events, max_points=100)
    assert len(kept) <= 100
    assert max(e.allocated_bytes for e in kept) == 999
    assert min(e.allocated_bytes for e in kept) == 0
    assert [e.index for e in kept] == sorted(e.index for e in kept)
    assert downsample(events[:50], max_points=100) == events[:50]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_real_child_process_without_gpu():
    case = VerifyCase(
        case="tiny",
        model="tiny",
        model_type="llama",
        hf_config=TINY_LLAMA,
        setup=TrainSetup(batch=1, seq=8),
    )
    m = runner.run_case(case, predict=False, timeout_s=300)
    assert (m.status, m.error_kind) == ("error", "no_gpu")
    assert m.error == "no CUDA GPU is available (torch.cuda.is_available() is False)"


def test_python_api(monkeypatch):
    launcher = FakeLauncher(lambda case: ok_result(20.0, 15.0))
    monkeypatch.setattr(runner, "launch", launcher)
    monkeypatch.setattr(predict, "predict", lambda spec, setup, gpu=None: estimate(20.2, 15.0))
    report = memplan.verify(
        "qwen3-0.6b",
        batch=4,
        seq=1024,
        kernels="none",
        grad_checkpointing=True,
        sweeps={"seq": [512, 1024]},
    )
    assert [m.setup.seq for m in report.measurements] == [512, 1024]
    assert all(m.setup.grad_checkpointing for m in report.measurements)
    assert report.measurements[0].error_pct == pytest.approx(1.0)
    assert report.measurements[0].peak_bytes == 20 * GIB


def test_python_api_raises_for_a_single_failed_case(monkeypatch):
    fields = {"status": "error", "error_kind": "build", "error": "the model failed to build: X"}
    monkeypatch.setattr(runner, "launch", FakeLauncher(lambda case: (fields, 5)))
    with pytest.raises(MemplanError, match="the model failed to build: X"):
        memplan.verify("qwen3-0.6b", batch=1, seq=8, kernels="none")


def test_lora_targets_default_to_the_architecture_s_projections():
    def targets(model: str, **options) -> tuple[str, ...]:
        (item,) = plan_cases(model, batch=1, seq=64, kernels="none", lora_rank=8, **options)
        return item.case.setup.lora_targets

    assert targets("phi-3-mini") == ("qkv_proj",)  # fused q/k/v: no q_proj or v_proj
    assert targets("llama-3.2-1b") == ("q_proj", "v_proj")
    assert targets("llama-3.2-1b", lora_targets=("o_proj",)) == ("o_proj",)


def test_python_sweeps_are_checked_and_parsed_as_on_the_command_line():
    with pytest.raises(UsageError, match="cannot sweep 'batchs'; sweepable: batch, seq"):
        plan_cases("qwen3-0.6b", batch=1, seq=64, kernels="none", sweeps={"batchs": [1, 2]})
    with pytest.raises(UsageError, match="sweep 'batch' takes a non-empty list of values"):
        plan_cases("qwen3-0.6b", batch=1, seq=64, kernels="none", sweeps={"batch": 4})
    items = plan_cases(
        "qwen3-0.6b",
        batch=1,
        seq=64,
        sweeps={"kernels": ["none", "rms_norm+swiglu", ("rms_norm",)]},
    )
    assert [i.case.setup.kernels for i in items] == [(), ("rms_norm", "swiglu"), ("rms_norm",)]
    with pytest.raises(UsageError, match="unknown kernel 'warp'"):
        plan_cases("qwen3-0.6b", batch=1, seq=64, sweeps={"kernels": ["rms_norm+warp"]})


@pytest.mark.parametrize(
    "sweep",
    [
        {"batch": [4, 8]},
        {"grad_accum": [1, 2]},
        {"grad_checkpointing": [False, True]},
        {"flce_chunk": [512, 1024]},
    ],
)
def test_a_plan_with_a_sweep_of_what_it_decides_is_refused(sweep):
    plan = Plan(kernels=("rms_norm", "flce"), flce_chunk=2048, micro_batch=2, grad_accum=4)
    with pytest.raises(UsageError, match=f"a plan decides .*: sweep {next(iter(sweep))} without"):
        plan_cases("qwen3-0.6b", batch=8, seq=1024, plan=plan, sweeps=sweep)
    # what a plan leaves open can still be swept
    items = plan_cases("qwen3-0.6b", batch=8, seq=1024, plan=plan, sweeps={"seq": [512, 1024]})
    assert [(i.case.setup.batch, i.case.setup.seq) for i in items] == [(2, 512), (2, 1024)]


def test_layer_cut_of_a_model_given_by_path_is_named_after_its_folder(tmp_path):
    import json

    folder = tmp_path / "mymodel"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    items = plan_cases(str(folder), batch=1, seq=8, kernels="none", sweeps={"layers": [1, 2]})
    assert [(i.case.case, i.case.model) for i in items] == [
        ("mymodel-l1_b1_s8_bf16_hf", "mymodel-l1"),
        ("mymodel-l2_b1_s8_bf16_hf", "mymodel-l2"),
    ]
    assert [i.case.hf_config["num_hidden_layers"] for i in items] == [1, 2]
    (item,) = plan_cases(str(folder), batch=1, seq=8, kernels="none")
    assert (item.case.case, item.case.model) == ("mymodel_b1_s8_bf16_hf", "mymodel")


def test_python_api_keeps_the_cases_measured_before_the_gpu_went_missing(monkeypatch):
    from memplan.verify.api import NoGpuError

    def behaviour(case):
        if case.setup.batch == 3:
            return {"status": "error", "error_kind": "no_gpu", "error": "CUDA is not usable: x"}, 4
        return ok_result()

    launcher = FakeLauncher(behaviour)
    monkeypatch.setattr(runner, "launch", launcher)
    monkeypatch.setattr(predict, "predict", lambda spec, setup, gpu=None: estimate(20.2, 15.0))
    with pytest.raises(NoGpuError, match=r"^CUDA is not usable: x; stopped at case 3 of 4$") as e:
        memplan.verify(
            "qwen3-0.6b", batch=1, seq=64, kernels="none", sweeps={"batch": [1, 2, 3, 4]}
        )
    assert [m.setup.batch for m in e.value.report.measurements] == [1, 2]
    assert len(launcher.cases) == 3  # the sweep stops at the first case without a GPU


@pytest.mark.parametrize(
    ("model", "layers"), [("llama-4-scout-17b-16e", 1), ("gpt-oss-20b", 2), ("smollm3-3b", 3)]
)
def test_a_layer_cut_builds_in_transformers(model, layers):
    """transformers checks per-layer lists (Llama 4's no_rope_layers and moe_layers) against the
    layer count: the cut config must pass."""
    from transformers import AutoConfig

    from memplan.catalog import resolve_model

    config = dict(predict.with_layers(resolve_model(model), layers).hf_config)
    built = AutoConfig.for_model(config.pop("model_type"), **config)
    assert built.num_hidden_layers == layers
    assert len(built.layer_types) == layers


def test_sdpa_asked_of_a_model_transformers_builds_eager_only_is_planned_eager():
    (planned,) = plan_cases("gpt-oss-20b", batch=1, seq=128, kernels="none", layers=2)
    assert planned.case.setup.attn == "eager"
    assert "eager" in planned.case.case


def test_cases_take_the_deltanet_kernels_transformers_will_run(monkeypatch):
    import memplan.advisor

    def planned(*importable: str) -> tuple[str, str]:
        monkeypatch.setattr(memplan.advisor, "find_spec", lambda name: name in importable)
        (item,) = plan_cases("qwen3.5-0.8b", batch=1, seq=64, kernels="none", layers=4)
        return item.case.setup.deltanet_kernels, item.case.setup.deltanet_conv

    assert planned("fla") == ("fla", "torch") and planned() == ("torch", "torch")
    assert planned("causal_conv1d") == ("torch", "causal_conv1d")
    monkeypatch.setattr(memplan.advisor, "find_spec", lambda name: name == "fla")
    (item,) = plan_cases(
        "qwen3.5-0.8b", batch=1, seq=64, kernels="none", layers=4, deltanet_kernels="torch"
    )
    assert item.case.setup.deltanet_kernels == "torch"  # what the caller asks wins
