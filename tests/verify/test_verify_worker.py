"""The child process's code run in-process on the CPU: the real model build, LoRA, checkpointing,
optimizers and steps of the protocol, with torch.cuda's memory counters replaced by fakes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from memplan.schema import GIB, TrainSetup, VerifyCase
from memplan.verify import protocol, worker
from memplan.verify.allocator_trace import marker_sizes
from tests.traced.tiny import tiny

from .fakes import TINY_LLAMA, FakeCudaMemory


@pytest.fixture
def fake_cuda(monkeypatch):
    memory = FakeCudaMemory()
    memory.install(monkeypatch, torch)
    monkeypatch.setattr(worker, "DEVICE", "cpu")
    return memory


def make_case(**setup) -> VerifyCase:
    fields = {"batch": 2, "seq": 16, **setup}
    return VerifyCase(
        case="tiny",
        model="tiny-llama",
        model_type="llama",
        hf_config=TINY_LLAMA,
        setup=TrainSetup(**fields),
        steps=3,
    )


def test_measures_step1_and_steady_peak(fake_cuda):
    m, code = worker.run(make_case())
    assert code == protocol.EXIT_OK, m.error
    assert m.status == "ok"
    # the fake peak grows at each reading: step 1 is read first, the steady peak after step 3
    assert m.peak_step1_bytes == 11 * GIB
    assert m.peak_bytes == 12 * GIB
    assert m.reserved_bytes == 70 * GIB
    assert m.after_model_bytes == 3 * GIB
    assert m.n_params == m.n_trainable > 0
    assert m.loss is not None and 0 < m.loss < 20
    assert m.tokens_per_s == pytest.approx(2 * 16 / m.step_s)
    assert m.env["gpu"] == "Fake GPU" and m.env["torch"] == torch.__version__


@pytest.mark.parametrize(
    "setup",
    [
        {"precision": "amp-bf16", "attn": "eager"},
        {"precision": "fp32", "optimizer": "sgd-momentum", "grad_checkpointing": True},
        {"precision": "amp-fp16", "optimizer": "adam", "grad_accum": 2},
    ],
    ids=["amp-eager", "fp32-sgd-gc", "fp16-accum"],
)
def test_protocol_options_run(fake_cuda, setup):
    m, code = worker.run(make_case(**setup))
    assert code == protocol.EXIT_OK, m.error
    assert m.status == "ok" and m.loss is not None
    assert m.tokens_per_s == pytest.approx(2 * 16 * m.setup.grad_accum / m.step_s)


def test_lora_trains_only_the_adapters(fake_cuda):
    pytest.importorskip("peft")
    m, code = worker.run(make_case(lora_rank=4, lora_targets=("q_proj", "v_proj")))
    assert code == protocol.EXIT_OK, m.error
    # A (r x in) and B (out x r) of q_proj and v_proj in each of the 2 layers
    h, kv = TINY_LLAMA["hidden_size"], TINY_LLAMA["num_key_value_heads"] * TINY_LLAMA["head_dim"]
    assert m.n_trainable == 2 * (4 * h + h * 4 + 4 * h + kv * 4)
    assert m.n_params > m.n_trainable


def test_out_of_memory_is_a_result_with_its_own_exit_code(fake_cuda, monkeypatch):
    def forward(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "__call__", forward, raising=True)
    m, code = worker.run(make_case())
    assert code == protocol.EXIT_OOM
    assert m.status == "oom"
    assert m.oom_above_bytes == 11 * GIB
    assert m.error == "out of memory in step 1 above 11.00 GiB allocated"


def test_unknown_architecture_is_a_build_error(fake_cuda):
    case = make_case().model_copy(update={"model_type": "not-a-model"})
    m, code = worker.run(case)
    assert code == protocol.EXIT_BUILD
    assert (m.status, m.error_kind) == ("error", "build")
    assert m.error.startswith("the model failed to build: ")


def test_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m, code = worker.run(make_case())
    assert code == protocol.EXIT_NO_GPU
    assert m.error_kind == "no_gpu"
    assert "no CUDA GPU is available" in m.error


def test_failing_step_is_a_run_error(fake_cuda, monkeypatch):
    monkeypatch.setattr(worker, "_make_optimizer", lambda params, name: _Broken())
    m, code = worker.run(make_case())
    assert code == protocol.EXIT_RUN
    assert (m.status, m.error_kind) == ("error", "run")
    assert m.error == "RuntimeError: the optimizer broke"


class _Broken:
    def step(self):
        raise RuntimeError("the optimizer broke\nmore detail")

    def zero_grad(self, set_to_none=True):
        pass


def test_timeline_is_read_from_the_allocator_history(fake_cuda, monkeypatch):
    """The recorded step's trace is faked from the markers the child allocates, with one tensor
    of 1 MiB alive in the forward and freed in the backward."""
    trace: list[dict] = []
    real_empty = torch.empty
    sizes = set(marker_sizes(12))

    def empty(*shape, **kwargs):
        t = real_empty(*shape, **kwargs)
        if len(shape) == 1 and shape[0] in sizes:
            trace.append({"action": "alloc", "addr": shape[0], "size": shape[0]})
            trace.append({"action": "free_requested", "addr": shape[0], "size": shape[0]})
            if len(trace) == 2:  # after the forward marker
                trace.append({"action": "alloc", "addr": 1, "size": 2**20})
            if len(trace) == 5:  # after the backward marker
                trace.append({"action": "free_requested", "addr": 1, "size": 2**20})
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [trace]})
    case = make_case().model_copy(update={"record_timeline": True})
    m, code = worker.run(case)
    assert code == protocol.EXIT_OK, m.error
    events = [(e.phase, e.allocated_bytes) for e in m.timeline_measured]
    assert events == [("forward", 3 * GIB + 2**20), ("backward", 3 * GIB)]


def test_profile_mode(fake_cuda):
    case = make_case().model_copy(update={"mode": "profile"})
    m, code = worker.run(case)
    assert code == protocol.EXIT_OK, m.error
    table = m.profile["self"]
    assert table.steps == 2
    assert m.peak_bytes is None  # a profiled process measures no peak


def test_main_writes_the_result_file(fake_cuda, tmp_path):
    case_path, out_path = tmp_path / "case.json", tmp_path / "out.json"
    case_path.write_text(make_case().model_dump_json())
    code = worker.main([str(case_path), str(out_path)])
    assert code == protocol.EXIT_OK
    assert json.loads(out_path.read_text())["status"] == "ok"


def test_memplan_patch_is_applied_before_the_optimizer(fake_cuda):
    pytest.importorskip("memplan.kernels.rms_norm")
    m, code = worker.run(make_case(kernels=("rms_norm",)))
    assert code == protocol.EXIT_OK, m.error
    assert m.applied["kernels"] == ["rms_norm"]
    # 2 layers x 2 norms + the final norm, and the 2 layers (their residual adds in the norms)
    assert m.applied["modules"] == {"rms_norm": 7}
    assert m.setup.kernels == ("rms_norm",)


def test_the_gpu_measured_is_recorded_for_the_prediction(monkeypatch):
    memory = FakeCudaMemory(capability=(8, 0))
    memory.install(monkeypatch, torch)
    monkeypatch.setattr(worker, "DEVICE", "cpu")
    m, code = worker.run(make_case())
    assert code == protocol.EXIT_OK, m.error
    assert (m.env["compute_capability"], m.env["gpu_total_bytes"]) == ("8.0", str(80 * GIB))


@pytest.fixture
def empty_history(monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [[]]})


def test_timeline_with_many_micro_batches(fake_cuda, empty_history):
    # 5 micro-batches: 13 phase markers (more than the 12 sizes there used to be)
    case = make_case(grad_accum=5).model_copy(update={"record_timeline": True})
    m, code = worker.run(case)
    assert code == protocol.EXIT_OK, m.error
    assert m.status == "ok" and m.timeline_measured == [] and "warnings" not in m.env


def test_a_failed_timeline_keeps_the_measurement(fake_cuda, empty_history, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("bad trace\nmore")

    monkeypatch.setattr(worker, "events_from_trace", broken)
    m, code = worker.run(make_case().model_copy(update={"record_timeline": True}))
    assert code == protocol.EXIT_OK, m.error
    assert (m.status, m.peak_bytes, m.timeline_measured) == ("ok", 12 * GIB, None)
    message = "the memory timeline was not recorded: RuntimeError: bad trace"
    assert m.env["warnings"] == message
    assert capsys.readouterr().err.splitlines() == [f"Warning: {message}"]


def test_fp16_steps_all_skipped_is_a_warning(fake_cuda, monkeypatch):
    real = torch.amp.GradScaler
    # an infinite loss scale makes every gradient inf: the scaler skips every optimizer step
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: real(device, init_scale=math.inf))
    m, code = worker.run(make_case(precision="amp-fp16"))
    assert code == protocol.EXIT_OK, m.error
    assert m.status == "ok"
    assert m.env["warnings"].startswith("the fp16 loss scaler skipped every optimizer step")
    monkeypatch.setattr(torch.amp, "GradScaler", real)
    m, code = worker.run(make_case(precision="amp-fp16"))
    assert code == protocol.EXIT_OK and "warnings" not in m.env


def test_build_trainer_gives_a_warmed_up_protocol_step(fake_cuda):
    trainer = worker.build_trainer(make_case())
    assert trainer.opt.state  # 3 steps ran: AdamW holds its states
    assert trainer.ids.shape == (2, 16)
    trainer.step()
    assert math.isfinite(trainer.loss.item())


@pytest.mark.parametrize(
    "setup",
    [
        {"strategy": "fsdp2", "gpus": 4},
        {"strategy": "fsdp2", "gpus": 8, "reshard_after_forward": False, "precision": "amp-bf16"},
        {"strategy": "fsdp2", "gpus": 2, "grad_checkpointing": True},
        {"strategy": "fsdp2", "gpus": 4, "cpu_offload": True, "precision": "amp-bf16"},
        {"strategy": "ddp", "gpus": 4},
    ],
    ids=["fsdp2", "fsdp2-keep-amp", "fsdp2-gc", "fsdp2-offload-amp", "ddp"],
)
def test_strategies_run_as_accelerate_prepares_them(fake_cuda, setup):
    """FSDP2 over a fake group of `gpus` ranks (rank 0's shards are real tensors), DDP over a
    real one-rank group; the process group is gone when the child returns."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    real_prepare = worker.distributed.prepare
    seen = {}

    def spy(model, *args):
        # what the test checks, read at prepare time: holding the module would keep a DDP
        # reducer, and its process group, alive past the group's destruction
        prepared = real_prepare(model, *args)
        seen["ddp"] = isinstance(prepared, torch.nn.parallel.DistributedDataParallel)
        seen["groups"] = [n for n, m in prepared.named_modules() if isinstance(m, FSDPModule)]
        if seen["groups"]:
            seen["rows"] = prepared.lm_head.weight.to_local().shape[0]
            seen["offloaded"] = {
                p.offload_to_cpu
                for m in prepared.modules()
                if isinstance(m, FSDPModule)
                for g in m._get_fsdp_state()._fsdp_param_groups
                for p in g.fsdp_params
            }
        return prepared

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker.distributed, "prepare", spy)
        m, code = worker.run(make_case(**setup))
    assert code == protocol.EXIT_OK, m.error
    assert m.status == "ok" and m.loss is not None and m.env["world_size"] == str(setup["gpus"])
    assert not dist.is_initialized()
    if setup["strategy"] == "fsdp2":
        # accelerate's wrapping: each decoder layer, the tail [norm, lm_head] (with the tied
        # embedding), then the root
        assert seen["groups"] == [
            "",
            "model.embed_tokens",
            "model.layers.0",
            "model.layers.1",
            "model.norm",
            "lm_head",
        ]
        assert seen["rows"] == TINY_LLAMA["vocab_size"] // setup["gpus"]
        assert seen["offloaded"] == {setup.get("cpu_offload", False)}
    else:
        assert seen["ddp"] and not seen["groups"]


def test_zero_is_measured_over_real_ranks_only(fake_cuda):
    m, code = worker.run(make_case(strategy="zero2", gpus=2))  # no torchrun: simulated ranks
    assert code == protocol.EXIT_BUILD and m.error_kind == "build"
    assert m.error == (
        "MemplanError: zero2 is measured over real ranks only: --ranks torchrun on a machine "
        "with 2 GPUs"
    )


@pytest.mark.parametrize(
    ("strategy", "model_gib", "expected"),
    [
        ("fsdp2", 17, "cuda"),  # gemma-7b in bf16: made on the GPU, prepared from the CPU
        ("fsdp2", 41, "cpu"),  # over half the free memory: never whole on the GPU
        ("fsdp2", None, "cpu"),  # a model type without a family entry: size unknown
        ("ddp", 41, "cuda"),
        (None, 41, "cuda"),
    ],
)
def test_fsdp2_models_are_made_on_the_gpu_when_they_fit_twice(strategy, model_gib, expected):
    setup = TrainSetup(batch=1, seq=16, strategy=strategy, gpus=2 if strategy else 1)
    model_bytes = None if model_gib is None else model_gib * GIB
    assert worker.distributed.init_device(setup, "cuda", model_bytes, 79 * GIB) == expected


def test_the_child_counts_the_parameters_it_builds(fake_cuda):
    m, code = worker.run(make_case(strategy="fsdp2", gpus=2))
    assert code == protocol.EXIT_OK, m.error
    assert worker._param_count(make_case()) == m.n_params


@pytest.mark.parametrize(
    ("field", "module", "fast", "package"),
    [
        ("deltanet_kernels", "fla", "fla", "flash-linear-attention"),
        ("deltanet_conv", "causal_conv1d", "causal_conv1d", "causal-conv1d"),
    ],
)
@pytest.mark.parametrize("imports", [False, True])
def test_a_case_is_refused_where_transformers_would_run_another_deltanet_kernel(
    fake_cuda, monkeypatch, field, module, fast, package, imports
):
    import memplan.advisor

    monkeypatch.setattr(memplan.advisor, "find_spec", lambda name: imports and name == module)
    asked = "torch" if imports else fast
    case = make_case(**{field: asked}).model_copy(
        update={"model_type": "qwen3_5_text", "hf_config": tiny("qwen3_5_text")}
    )
    m, code = worker.run(case)
    assert code == protocol.EXIT_BUILD and m.error_kind == "build"
    assert f"{field}={asked}" in m.error and package in m.error
    # a model without gated DeltaNet layers runs whatever imports
    m, code = worker.run(make_case(deltanet_kernels="torch"))
    assert code == protocol.EXIT_OK, m.error
