"""The DeepSpeed launcher, started for real: pretrain_gpt under `deepspeed` follows torchrun exactly.

The job: a tiny GPT, DP=2 with ZeRO-1, 5 steps, the same seed. Reference: `torchrun --nproc_per_node 2`.
- one host: `deepspeed --hostfile HF --no_ssh_check --master_addr 127.0.0.1` with HF = `localhost
  slots=2`. A hostfile makes the runner check passwordless ssh to its first host even when that host
  is the only one (then it launches locally, without ssh): --no_ssh_check skips the check, and
  --master_addr the `ssh HOST hostname -I` it would otherwise run to find rank 0's address;
- two hosts without ssh: `deepspeed --hostfile HF --no_ssh --node_rank N --master_addr 127.0.0.1`, once
  per "host", HF listing two hosts of 1 slot. With --no_ssh the names are only labels (node N runs the
  slots of HF's Nth line; nothing resolves them), so any names do; --master_addr is required (without
  it the runner still runs `ssh FIRST_HOST hostname -I`).
Per-step losses and gradient norms and the final validation loss must equal torchrun's (allowed:
1e-6 absolute; measured: bit-identical). test_multinode.py runs both launchers across two hosts.

Run: python -m pytest tests/distributed/test_launchers.py -q   (about 35 s on 2 idle CPU cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import (
    GPT_MODEL,
    compare,
    deepspeed_cmd,
    launch,
    metrics_curves,
    metrics_job,
    short_run,
    torchrun_curves,
)

STEPS = 5
SCRIPT = "../../pretrain_gpt.py"  # relative to tests/distributed, as the harness takes workers
TRAIN = [*short_run(STEPS, eval_iters=1, lr="5e-3"), "--parallel.zero_stage", "1"]
WORLD = "world 2 = TP 1 x PP 1 x DP 2"  # pretrain_gpt's first line, printed by rank 0


def job_args(gpt_data: list[str], out: Path, name: str) -> tuple[list[str], Path]:
    """pretrain_gpt's arguments for run `name` in `out`, and its metrics file."""
    return metrics_job(out, name, [*GPT_MODEL, *TRAIN, *gpt_data])


def check_same(test: str, label: str, run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    """Every curve equals the reference's within 1e-6 absolute (recorded for the terminal summary)."""
    for key, expected in reference.items():
        compare(test, f"{label} {key}", run[key], expected, rtol=0.0, atol=1e-6)


@pytest.fixture(scope="module")
def reference(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("launchers_torchrun")
    return torchrun_curves(SCRIPT, 2, [*GPT_MODEL, *TRAIN, *gpt_data], STEPS, cwd=out, timeout=240)


def test_deepspeed_launcher_with_a_hostfile_matches_torchrun(reference, gpt_data, tmp_path: Path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    args, metrics = job_args(gpt_data, tmp_path, "deepspeed")

    def launchers(port: int) -> list[list[str]]:
        return [deepspeed_cmd(hostfile, "127.0.0.1", port, "--no_ssh_check")]

    (output,) = launch(launchers, SCRIPT, 2, args, cwd=tmp_path, timeout=240)
    assert WORLD in output, f"deepspeed launch did not print '{WORLD}'"
    check_same(
        "deepspeed hostfile vs torchrun", "deepspeed 1 host x 2", metrics_curves(metrics, STEPS), reference
    )


def test_deepspeed_no_ssh_two_hosts_match_torchrun(reference, gpt_data, tmp_path: Path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    args, metrics = job_args(gpt_data, tmp_path, "deepspeed_no_ssh")

    def launchers(port: int) -> list[list[str]]:  # one launcher per host, as each node would run it
        return [deepspeed_cmd(hostfile, "127.0.0.1", port, "--no_ssh", f"--node_rank={n}") for n in (0, 1)]

    outputs = launch(launchers, SCRIPT, 2, args, cwd=tmp_path, timeout=240)
    assert WORLD in outputs[0], f"node 0 (rank 0) did not print '{WORLD}'"
    check_same(
        "deepspeed no_ssh vs torchrun", "deepspeed 2 hosts x 1", metrics_curves(metrics, STEPS), reference
    )
