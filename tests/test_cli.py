"""The command line: results on stdout, one `Error:` line on stderr with exit 2 (usage) or 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

VERSIONS_WARNING = "Warning: memplan was not validated with "


def memplan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_advise_prints_the_verdict_first() -> None:
    run = memplan("advise", "--model", "gemma-7b", "--batch", "8", "--seq", "4096")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("gemma-7b, batch 8 x seq 4096 on H100 80GB SXM (the default GPU)")
    assert "does not fit" in lines[0]
    first = lines.index(next(line for line in lines if line.startswith("Do this first:")))
    code = next(i for i, line in enumerate(lines) if "memplan.apply(model, kernels=" in line)
    assert first < 10 and first < code <= first + 3
    # the tables only under --verbose
    assert "What makes it fit" not in run.stdout and "Kernel sets compared" not in run.stdout
    verbose = memplan("advise", "--model", "gemma-7b", "--batch", "8", "--seq", "4096", "-v")
    assert "What makes it fit" in verbose.stdout and "Kernel sets compared" in verbose.stdout


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
        (
            ["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--gpu-mem", "1"],
            2,
            "outside PyTorch's allocator",
        ),
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
        (
            ["--model", "gemma-7b", "--batch", "1", "--seq", "1", "--transformers", "latest"],
            2,
            "--transformers must be a transformers release such as 5.17.0",
        ),
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


# Two processes that import transformers per case; test_catalog.py's
# test_invalid_hub_id_makes_no_request checks the message in this one.
@pytest.mark.slow
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


# Two processes, one of which imports transformers; tests/traced/test_advise.py's default run
# checks a config transformers refuses (an unknown model_type) through the command line.
@pytest.mark.slow
def test_unknown_architecture(tmp_path) -> None:
    """A model_type without a family entry is traced from its transformers code (here a config
    transformers refuses: one Error line); --method analytic names the registry's families."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    args = ("advise", "--model", str(tmp_path), "--batch", "1", "--seq", "8")
    run = memplan(*args, "--method", "analytic")
    assert run.returncode == 1
    assert run.stderr.startswith("Error:") and "llama" in run.stderr
    run = memplan(*args)
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1
    assert run.stderr.startswith("Error: transformers could not build bert from this config")


def test_models_lists_the_catalog() -> None:
    run = memplan("models")
    assert run.returncode == 0 and "gemma-7b" in run.stdout and "qwen3-30b-a3b" in run.stdout


def test_a_huge_batch_is_refused_and_the_largest_accepted_answered() -> None:
    run = memplan("advise", "--model", "gemma-7b", "--batch", "99999999999999", "--seq", "4096")
    assert run.returncode == 2
    assert run.stderr.startswith("Error: --batch is the micro-batch") and "1,048,576" in run.stderr
    batch = str(2**20)
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


def test_a_bare_memplan_prints_the_help_and_exits_0() -> None:
    """It printed "Error: Usage: ..." and exited 2."""
    run = memplan()
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.startswith("Usage: memplan [OPTIONS] COMMAND [ARGS]...")
    assert "advise" in run.stdout and "-h, --help" in run.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["advise", "--model", "gemma-7b", "--batch", "8", "--seq", "4096", "-v"],
        ["models"],
        ["gpus", "--json"],
    ],
)
def test_a_reader_that_stops_early_is_not_an_error(args) -> None:
    """`memplan advise ... | head -1` exited 1: rich exits 1 when stdout's reader is gone."""
    child = subprocess.Popen(
        [sys.executable, "-m", "memplan", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child.stdout.close()  # the reader leaves before the first line is written
    assert child.wait(timeout=120) == 0
    # nothing on stderr but the one line advise prints outside the validated versions
    lines = child.stderr.read().decode().splitlines()
    assert [line for line in lines if not line.startswith(VERSIONS_WARNING)] == []


def test_gpus_json_lists_the_catalog() -> None:
    run = memplan("gpus", "--json")
    assert run.returncode == 0, run.stderr
    gpus = json.loads(run.stdout)
    assert gpus["h100-80gb"]["default"] is True and gpus["t4"]["default"] is False
    assert gpus["t4"]["compute_capability"] == [7, 5]
    assert gpus["h200"]["memory_bytes"] == 150_754_820_096
    assert "[default]" in memplan("gpus").stdout


def test_the_readme_shows_what_advise_prints() -> None:
    """The README's gemma-7b example is this command's output, as printed into a pipe."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("`memplan advise --model gemma-7b --batch 8 --seq 4096` prints:\n\n")
    block = readme[start:].split("\n\n", 1)[1]
    shown = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        shown.append(line[4:])
    run = memplan("advise", "--model", "gemma-7b", "--batch", "8", "--seq", "4096")
    printed = [line.rstrip() for line in run.stdout.rstrip("\n").splitlines()]
    assert "\n".join(shown).rstrip("\n") == "\n".join(printed)


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
