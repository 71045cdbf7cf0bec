"""The command line: results on stdout, one `Error:` line on stderr with exit 2 (usage) or 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def memplan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_advise_prints_the_plan() -> None:
    run = memplan("advise", "--model", "gemma-7b", "--batch", "8", "--seq", "4096")
    assert run.returncode == 0, run.stderr
    assert "does not fit" in run.stdout
    assert "What makes it fit" in run.stdout
    assert "Plan:" in run.stdout


def test_advise_json_is_the_advice_model() -> None:
    from memplan.schema import Advice

    run = memplan("advise", "--model", "llama-3.2-1b", "--batch", "2", "--seq", "512", "--json")
    advice = Advice.model_validate(json.loads(run.stdout))
    assert advice.peak_bytes == advice.estimate.peak_bytes > 0


def test_advise_path_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys; from memplan.cli import main\n"
        "try:\n    main(['advise', '--model', 'gemma-7b', '--batch', '8', '--seq', '4096'])\n"
        "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["--model", "nope", "--batch", "1", "--seq", "8"], 2, "unknown model"),
        (["--model", "gemma", "--batch", "1", "--seq", "8"], 2, "ambiguous"),
        (["--model", "gemma-7b", "--batch", "0", "--seq", "8"], 2, "positive integer"),
        (["--model", "gemma-7b", "--batch", "x", "--seq", "8"], 2, "positive integer"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "8", "--gpu", "tpu"], 2, "unknown GPU"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "8", "--gpu-mem", "lots"], 2, "memory"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "8", "--kernels", "x"], 2, "kernel"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "8", "--precision", "x"], 2, "x"),
        (["--model", "/no/such/config.json", "--batch", "1", "--seq", "8"], 1, "no such"),
        (["--batch", "1"], 2, "--model"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--gpu-mem", "24"], 2, "a unit"),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--gpu-mem", "1"], 2, "context"),
        (
            ["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--lora-rank", "8"]
            + ["--lora-targets", "foo"],
            2,
            "gemma has no LoRA target foo",
        ),
        (
            ["--model", "phi-3-mini", "--batch", "1", "--seq", "1", "--lora-rank", "8"]
            + ["--lora-targets", "q_proj,v_proj"],
            2,
            "its layers have qkv_proj, o_proj",
        ),
        (
            ["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--lora-targets", "q_proj"],
            2,
            "--lora-targets needs --lora-rank",
        ),
        (
            ["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--flce-chunk", "100"]
            + ["--kernels", "none"],
            2,
            "--flce-chunk",
        ),
        (
            [
                "--model",
                "gemma-7b",
                "--batch",
                "1",
                "--seq",
                "1",
                "--kernels",
                "cross_entropy,flce",
            ],
            2,
            "pick one",
        ),
        (["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--kernels", ","], 2, "no kernel"),
    ],
)
def test_bad_input_is_one_line(args, code, message) -> None:
    run = memplan("advise", *args)
    assert run.returncode == code
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0]
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["advise", "verify"])
def test_an_unknown_model_name_is_a_usage_error(command) -> None:
    """A name that is no catalog name, no path and no hub id exited 1 where an unknown --gpu
    exits 2 (errors.py: an unknown name is a usage error); verify resolves it the same way."""
    run = memplan(command, "--model", "no-such-model", "--batch", "1", "--seq", "8")
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "Error: unknown model 'no-such-model' (run `memplan models` for the catalog)"
    ]


@pytest.mark.parametrize("offline", ["0", "1"])
def test_a_malformed_hub_id_is_a_usage_error(offline) -> None:
    """'org/bad name' is no repository id: refused before any request, offline or not, exit
    2 (a well-formed id the hub does not give stays exit 1: tests/test_catalog.py). Two '/' or
    more read as a missing relative path, exit 1 like other missing paths."""
    env = {**os.environ, "HF_HUB_OFFLINE": offline}
    run = memplan("advise", "--model", "org/bad name", "--batch", "1", "--seq", "8", env=env)
    assert run.returncode == 2
    assert len(run.stderr.splitlines()) == 1
    assert "unknown model 'org/bad name'" in run.stderr
    assert "(not a valid repository id)" in run.stderr
    run = memplan("advise", "--model", "ckpt/run1/final", "--batch", "1", "--seq", "8", env=env)
    assert run.returncode == 1
    assert run.stderr == "Error: no such file or folder: ckpt/run1/final\n"


def test_unknown_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    run = memplan("advise", "--model", str(tmp_path), "--batch", "1", "--seq", "8")
    assert run.returncode == 1
    assert run.stderr.startswith("Error:") and "llama" in run.stderr


def test_models_lists_the_catalog() -> None:
    run = memplan("models")
    assert run.returncode == 0 and "gemma-7b" in run.stdout and "qwen3-30b-a3b" in run.stdout


def test_a_huge_batch_does_not_hang() -> None:
    batch = "99999999999999"
    run = memplan("advise", "--model", "gemma-7b", "--batch", batch, "--seq", "4096", "--json")
    assert run.returncode == 0, run.stderr
    setup = json.loads(run.stdout)["suggestions"][0]["setup"]
    assert setup["batch"] * setup["grad_accum"] == int(batch)


def test_lora_on_a_fused_qkv_model_defaults_to_qkv_proj() -> None:
    run = memplan(
        "advise", "--model", "phi-3-mini", "--batch", "1", "--seq", "512", "--lora-rank", "16"
    )
    assert run.returncode == 0, run.stderr
    assert "LoRA r=16 on qkv_proj" in run.stdout
    assert "qkv_proj" in memplan("advise", "--help").stdout


def test_models_json_has_what_the_table_shows() -> None:
    """`memplan models --json` gave only the configs: no hub id, no parameter count."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "memplan", "models", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    listing = json.loads(run.stdout)
    entry = listing["llama-3.2-1b"]
    assert entry["hf_id"] == "meta-llama/Llama-3.2-1B"
    assert entry["params"] == 1_235_814_400
    assert entry["config"]["hidden_size"] == 2048
