"""Command-line errors of pretrain_gpt.py and pretrain_vit.py: a bad input ends the process with a
non-zero status and one last stderr line `megahet: error: ...` naming the problem, before any
process group starts.

Each Python process that imports megatron-core costs ~7 s, so two processes run concurrently:
`python pretrain_gpt.py` end to end (WORLD_SIZE=3, RANK=0 and --parallel.tp 2: the check must come
before rank 0 waits for ranks that never come), and one driver that imports the scripts' `run_cli` /
`SPEC` (GPT and ViT) and runs every case in-process, catching SystemExit. In the driver, starting
the process groups is replaced by a sentinel, so a case that slipped through the checks is reported
instead of starting to train.

Run: ``python -m pytest tests/test_cli_errors.py -q`` (about 10-15 s on 2 idle cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megahet.launch import free_port

REPO = Path(__file__).resolve().parents[1]
PREFIX = "megahet: error:"
TIMEOUT_S = 120  # a check that came after the process group start would wait (for 10 min) here

_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import megahet.training
    import pretrain_gpt, pretrain_vit

    class Reached(Exception):
        pass

    def no_process_groups(*args, **kwargs):
        raise Reached("initialize_parallel reached: the input passed every check")

    megahet.training.initialize_parallel = no_process_groups
    cases = json.loads(sys.argv[1])
    results = {}
    for name, (script, argv, env) in cases.items():
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            if script == "gpt":
                pretrain_gpt.run_cli(pretrain_gpt.SPEC, argv)
            else:
                pretrain_vit.run_cli(pretrain_vit.SPEC, argv, defaults=pretrain_vit.default_config())
            results[name] = {"kind": "returned"}
        except SystemExit as exit_:
            results[name] = {"kind": "exit", "code": exit_.code if isinstance(exit_.code, int) else None,
                             "message": str(exit_.code)}
        except Reached as err:
            results[name] = {"kind": "reached", "message": str(err)}
        except BaseException as err:
            results[name] = {"kind": "exception", "message": f"{type(err).__name__}: {err}"}
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    print("RESULTS " + json.dumps(results))
    """
)


def _cases(tmp: Path) -> dict[str, tuple[str, list[str], dict[str, str]]]:
    """name -> (script, argv, extra environment)."""
    (tmp / "data.bin").write_bytes(b"")
    (tmp / "data.idx").write_bytes(b"")
    (tmp / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    (tmp / "fp16.json").write_text(json.dumps({"fp16": {"enabled": True}}))
    (tmp / "broken.yaml").write_text("model:\n  num_layers: [4\n")
    one = {"WORLD_SIZE": "1"}
    return {
        "tp_heads": ("gpt", ["--parallel.tp", "3"], one),
        "world_size": ("gpt", ["--parallel.tp", "2"], {"WORLD_SIZE": "3"}),
        "zero2_pp": ("gpt", ["--parallel.pp", "2", "--parallel.zero_stage", "2"], {"WORLD_SIZE": "2"}),
        "zero2_pp_from_ds_config": (
            "gpt",
            ["--parallel.pp", "2", "--deepspeed_config", str(tmp / "zero2.json")],
            {"WORLD_SIZE": "2"},
        ),
        "fp16_ds_config": ("gpt", ["--deepspeed", str(tmp / "fp16.json")], one),
        "missing_data_path": (
            "gpt",
            ["--data.data_path", str(tmp / "nope"), "--data.tokenizer_model", str(tmp / "tok.model")],
            one,
        ),
        "missing_tokenizer": (
            "gpt",
            ["--data.data_path", str(tmp / "data"), "--data.tokenizer_model", str(tmp / "missing.model")],
            one,
        ),
        "data_path_without_tokenizer": ("gpt", ["--data.data_path", str(tmp / "data")], one),
        "unknown_key": ("gpt", ["--model.num_layer", "2"], one),
        "unknown_section": ("vit", ["--optimizer.lr", "2"], one),
        "bad_type": ("gpt", ["--train.lr", "fast"], one),
        "missing_config_file": ("gpt", ["--config", str(tmp / "missing.yaml")], one),
        "malformed_yaml": ("vit", ["--config", str(tmp / "broken.yaml")], one),
        "zero_micro_batch": ("gpt", ["--train.micro_batch_size", "0"], one),
        "negative_global_batch": ("vit", ["--train.global_batch_size=-64"], one),
        "vit_patch_size": ("vit", ["--model.patch_size", "5"], one),
        "vit_tp_heads": ("vit", ["--parallel.tp", "3"], {"WORLD_SIZE": "3"}),
        "vit_rope": ("vit", ["--model.position_embedding_type", "rope"], one),
        "gqa_tp": ("gpt", ["--model.num_query_groups", "1", "--parallel.tp", "2"], {"WORLD_SIZE": "2"}),
        "packing_micro_batch": ("gpt", ["--data.packing", "documents"], one),
        "packing_local_attention": (
            "gpt",
            ["--data.packing", "documents", "--train.micro_batch_size", "1", "--model.attention", "local"],
            one,
        ),
        "packing_token_cap": (
            "gpt",
            [
                "--data.packing",
                "documents",
                "--train.micro_batch_size",
                "1",
                "--train.global_batch_tokens",
                "100",
            ],
            {"WORLD_SIZE": "2"},
        ),
        "packing_zero2": (
            "gpt",
            ["--data.packing", "documents", "--train.micro_batch_size", "1", "--parallel.zero_stage", "2"],
            {"WORLD_SIZE": "2"},
        ),
        "packing_doc_cost": (
            "gpt",
            ["--data.packing", "documents", "--train.micro_batch_size", "1", "--data.doc_cost", "1,2"],
            one,
        ),
        "packing_replica_caps": (
            "gpt",
            [
                "--data.packing",
                "documents",
                "--train.micro_batch_size",
                "1",
                "--data.replica_max_tokens",
                "128",
            ],
            {"WORLD_SIZE": "2"},
        ),
        "packing_vit": ("vit", ["--data.packing", "documents", "--train.micro_batch_size", "1"], one),
        # Control: valid input reaches the (replaced) process-group start.
        "valid_gpt": ("gpt", ["--train.train_iters", "1", "--logging.wandb", "false"], one),
    }


# name -> substrings the error must contain
EXPECTED = {
    "tp_heads": ["parallel.tp 3", "model.num_attention_heads 4"],
    "world_size": ["world size 3", "TP*PP"],
    "zero2_pp": ["ZeRO stage 2", "pp=2", "parallel.zero_stage"],
    "zero2_pp_from_ds_config": ["ZeRO stage 2", "pp=2"],
    "fp16_ds_config": ["fp16"],
    "missing_data_path": ["data.data_path", "nope.bin", "not found"],
    "missing_tokenizer": ["data.tokenizer_model", "missing.model", "not found"],
    "data_path_without_tokenizer": ["data.data_path", "data.tokenizer_model"],
    "unknown_key": ["unknown config key", "model.num_layer"],
    "unknown_section": ["unknown config key", "optimizer.lr"],
    "bad_type": ["train.lr", "float", "fast"],
    "missing_config_file": ["missing.yaml", "not found"],
    "malformed_yaml": ["broken.yaml", "YAML"],
    "zero_micro_batch": ["train.micro_batch_size", "positive"],
    "negative_global_batch": ["train.global_batch_size", "positive", "-64"],
    "vit_patch_size": ["model.image_size 28", "model.patch_size 5"],
    "vit_tp_heads": ["parallel.tp 3", "model.num_attention_heads"],
    "vit_rope": ["model.position_embedding_type", "ViT"],
    "gqa_tp": ["parallel.tp 2", "model.num_query_groups 1"],
    "packing_micro_batch": ["data.packing=documents", "train.micro_batch_size 1"],
    "packing_local_attention": ["model.attention=local", "document", "sdpa"],
    "packing_token_cap": ["train.global_batch_tokens 100", "256 = the replicas' token caps"],
    "packing_zero2": ["ZeRO-2", "parallel.zero_stage=1"],
    "packing_doc_cost": ["data.doc_cost", "A,B,C"],
    "packing_vit": ["data.packing", "ViT"],
    "packing_replica_caps": ["data.replica_max_tokens '128'", "2 token caps"],
}


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled", **extra)
    return env


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess | dict]:
    """Start both processes at once; returns their results (driver: parsed per case)."""
    tmp = tmp_path_factory.mktemp("cli")
    port = str(free_port())
    rank0 = {
        "WORLD_SIZE": "3",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    procs = {
        "driver": subprocess.Popen(
            [sys.executable, "-c", _DRIVER, json.dumps(_cases(tmp))],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "gpt_world_size": subprocess.Popen(
            [sys.executable, "pretrain_gpt.py", "--parallel.tp", "2", "--logging.wandb", "false"],
            cwd=REPO,
            env=_env(**rank0),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    out: dict[str, subprocess.CompletedProcess | dict] = {}
    try:
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                pytest.fail(f"{name} did not end in {TIMEOUT_S} s (a check after the process-group start?)")
            out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    driver = out["driver"]
    assert driver.returncode == 0, driver.stderr[-3000:]
    lines = [line for line in driver.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, driver.stdout[-2000:] + driver.stderr[-2000:]
    out["cases"] = json.loads(lines[-1][len("RESULTS ") :])
    return out


# --- end to end ----------------------------------------------------------------------------------


def test_gpt_world_size_error_end_to_end(runs) -> None:
    """`WORLD_SIZE=3 RANK=0 python pretrain_gpt.py --parallel.tp 2`: fails at once, no hang."""
    proc = runs["gpt_world_size"]
    assert proc.returncode != 0
    last = _last_line(proc.stderr)
    assert last.startswith(PREFIX), proc.stderr[-3000:]
    assert "world size 3" in last and "TP*PP = 2*1" in last
    assert "Traceback" not in proc.stderr


# --- in the driver -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_error_is_one_line_naming_the_problem(runs, case: str) -> None:
    result = runs["cases"][case]
    assert result["kind"] == "exit", result  # SystemExit, not a traceback nor a started run
    # sys.exit(<str>) exits with status 1 and prints the string as stderr's last line.
    assert result["code"] is None, result
    message = result["message"]
    assert message.startswith(PREFIX), message
    assert "\n" not in message, message
    for needle in EXPECTED[case]:
        assert needle in message, (needle, message)


def test_valid_input_passes_the_checks(runs) -> None:
    """The control case: without an error the run reaches the process-group start."""
    assert runs["cases"]["valid_gpt"]["kind"] == "reached", runs["cases"]["valid_gpt"]


def test_help_lists_every_section_and_exits_zero():
    """`--help` prints the generated option list (with field docs) instead of failing."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"],
        check=False,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for key in ("--model.num_layers", "--parallel.tp", "--train.lr", "--data.data_path", "--resize.gamma"):
        assert key in out.stdout
    assert "Tensor-parallel size" in out.stdout  # a field docstring
