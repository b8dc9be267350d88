"""Elastic restart on fewer devices: a node is lost, torchrun restarts the job on the one left, and
megahet reshards the last checkpoint (optimizer state included) and trains on, on the loss curve.

Two launches (about 2 min on 2 cores):
1. the reference: pretrain_gpt at TP=2 x DP=2 (4 ranks, one torchrun), STEPS steps, saving every 4;
2. the elastic job: two torchrun agents ("nodes" of 2 ranks each) joined by the c10d rendezvous with
   `--nnodes 1:2 --max-restarts 1`, the same command line, `--train.save D --train.load D`. Once its
   step-4 checkpoint is complete, node B (its agent and ranks) is SIGKILLed. Node A's ranks fail on the
   lost peers, its agent restarts them in a world of 2, and megahet resumes: TP 2 x DP 1, every rank
   reading its own slices of the TP 2 x DP 2 checkpoint (weights, fp32 masters, Adam moments: the two
   saved DP ranks' ZeRO fragments) and the LR schedule, with nothing written.
The elastic job's losses after the restart must follow the reference within fp32 reduction noise (DP 1
sums the micro-batch gradients in another order than DP 2), and the run must end at STEPS.

Run: ``python -m pytest tests/distributed/test_elastic_restart.py -q``
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import GPT_MODEL, REPO, _kill_launch, compare_steps, free_port, read_records, short_run, torchrun

STEPS = 12
COMMON = [*GPT_MODEL, *short_run(STEPS), "--parallel.tp", "2", "--train.save_interval", "4"]
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _node(out: Path, name: str, port: int, args: list[str]) -> subprocess.Popen:
    """One elastic "node": a torchrun agent with 2 ranks, in a session of its own (killable as one)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1:2", "--nproc_per_node", "2", "--max_restarts", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic",
        # both nodes join the first round; after the loss the survivor waits 3 s for others, then goes on;
        # the store's reads wait up to 300 s (60 by default: a busy 2-core host starting 4 ranks missed it)
        "--rdzv_conf", "join_timeout=120,last_call_timeout=3,read_timeout=300",
        "--monitor_interval", "0.5",
        str(REPO / "pretrain_gpt.py"), *args,
    ]  # fmt: skip
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=out, env=_env(), stdout=log, stderr=log, start_new_session=True)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait(condition, what: str, procs: list[subprocess.Popen], out: Path, deadline: float) -> None:
    while not condition():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("node_*.log")))
            raise AssertionError(f"elastic job: {what} did not happen:\n{logs}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> dict:
    out = tmp_path_factory.mktemp("elastic")
    common = [*COMMON, *gpt_data]
    reference = [*common, "--train.save", str(out / "ref"), "--logging.metrics_file", str(out / "ref.jsonl")]
    torchrun(str(REPO / "pretrain_gpt.py"), 4, reference, cwd=out, timeout=TIMEOUT)

    ck, metrics = out / "ck", out / "elastic.jsonl"
    args = [*common, "--train.save", str(ck), "--train.load", str(ck), "--logging.metrics_file", str(metrics)]
    port = free_port()
    deadline = time.monotonic() + TIMEOUT
    node_a = _node(out, "node_a", port, args)
    node_b = None
    try:
        # node A hosts the rendezvous store (the first agent to bind the endpoint does): the node lost
        # must be another one, as on real clusters, where losing the rendezvous host ends the job
        _wait(lambda: _listening(port), "node A's rendezvous store", [node_a], out, deadline)
        node_b = _node(out, "node_b", port, args)
        latest = ck / "latest"
        _wait(lambda: latest.is_file() and latest.read_text() == "iter_0000004", "a step-4 checkpoint",
              [node_a, node_b], out, deadline)  # fmt: skip
        lost_at = time.monotonic()
        _kill_launch(node_b)  # node B is lost: its agent and both its ranks
        node_b.wait()
        node_a.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (node_a, node_b):
            if proc is not None and proc.poll() is None:
                _kill_launch(proc)
    finished = time.monotonic()
    log = (out / "node_a.log").read_text()
    assert node_a.returncode == 0, log[-4000:]
    return {"out": out, "log": log, "lost_at": lost_at, "finished": finished, "ck": ck, "metrics": metrics}


def test_shrinks_to_the_devices_left_and_stays_on_the_loss_curve(elastic: dict) -> None:
    log = elastic["log"]
    assert "this world of 2 ranks runs TP 2 x PP 1 x DP 1: resharding it with its optimizer state" in log, (
        log[-3000:]
    )
    assert "megahet gpt: world 2 = TP 2 x PP 1 x DP 1" in log
    reference, records = read_records(elastic["out"] / "ref.jsonl"), read_records(elastic["metrics"])
    # every rank read its own slices of the step-4 checkpoint: nothing resharded was written beside it
    assert "read its own slices of" in log and "resharded from TP 2 x PP 1 x DP 2" in log, log[-3000:]
    saved = sorted(p.name for p in elastic["ck"].glob("iter_*"))
    assert not any(name.startswith("iter_0000004_") for name in saved), saved
    assert "iter_0000004" in saved and f"iter_{STEPS:07d}" in saved
    assert max(records) == STEPS
    compare_steps("elastic_shrink", records, reference, range(5, STEPS + 1), what=" at DP 1 vs DP 2")
    restart_s = elastic["finished"] - elastic["lost_at"]
    print(f"elastic shrink 4 -> 2 ranks: lost node to the end of training {restart_s:.1f} s")
