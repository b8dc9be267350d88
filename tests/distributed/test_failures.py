"""Failures end a job quickly and clearly (real torchrun launches of pretrain_gpt.py, about 40 s).

1. A dead rank: rank 3 of a TP=2 x DP=2 job is SIGKILLed in the middle of training. The job must end
   within DEAD_RANK_BOUND_S (docs/checkpoints.md's bound; the distributed timeout, 10 min by default,
   is what a hang would take), with a non-zero status, torchrun's summary naming rank 3, and
   megahet's own line from every survivor that prints one naming rank 3 alone, at least one of them
   (megahet/failures.py: from the failed collective, or from the launcher's SIGTERM when a survivor
   had not reached one). The job starts on a quiet machine (the bound is widened, saying so, when it
   stays busy).
2. A bad input on several ranks: a missing checkpoint folder with 2 ranks prints its one-line error
   once, not once per rank.

Run: ``python -m pytest tests/distributed/test_failures.py -q -s`` (-s prints the measured exit time)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import (
    GPT_MODEL,
    REPO,
    _kill_launch,
    free_port,
    launch_env,
    torchrun_cmd,
    wait_until_quiet,
)

from benchmarks.contention import rank_pid

DEAD_RANK_BOUND_S = 5.0
"""How soon after a rank's death the job ends, as docs/checkpoints.md claims (measured 0.5-0.7 s)."""
COMMON = [
    *GPT_MODEL,
    "--train.micro_batch_size", "2",
    "--train.global_batch_size", "8",
    "--train.log_interval", "1",
    "--train.eval_interval", "1000",
    "--logging.wandb", "false",
]  # fmt: skip


def _steps(metrics: Path) -> int:
    """The last step logged so far by a running job (a line still being written is left for the next read)."""
    if not metrics.is_file():
        return 0
    text = metrics.read_text()
    complete = text[: text.rfind("\n") + 1].splitlines()
    return max((json.loads(line)["step"] for line in complete if line), default=0)


def test_a_dead_rank_ends_the_job_quickly_naming_it(tmp_path: Path, gpt_data: list[str]) -> None:
    busy = wait_until_quiet(before="the dead-rank job")
    bound = DEAD_RANK_BOUND_S * (1 + busy) if busy >= 1 else DEAD_RANK_BOUND_S
    if bound > DEAD_RANK_BOUND_S:
        print(f"dead rank: {busy:.1f} other runnable processes: the bound is widened to {bound:.0f} s")
    metrics = tmp_path / "metrics.jsonl"
    args = [*COMMON, *gpt_data, "--parallel.tp", "2", "--train.train_iters", "100000"]
    cmd = [*torchrun_cmd(4, free_port()), str(REPO / "pretrain_gpt.py"), *args]
    cmd += ["--logging.metrics_file", str(metrics)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while _steps(metrics) < 3:  # mid-training
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        victim = rank_pid(3, launcher=proc.pid)
        assert victim is not None, "rank 3's process not found"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=bound + 60)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            _kill_launch(proc)
    print(f"dead rank: the job ended {elapsed:.1f} s after rank 3 was killed")
    assert proc.returncode != 0
    assert elapsed < bound, f"the job took {elapsed:.1f} s to end after rank 3 died (bound {bound:.0f} s)"
    assert re.search(r"rank\s*: 3 \(local_rank: 3\)", output) and "SIGKILL" in output, output[-3000:]
    ours = [line for line in output.splitlines() if line.startswith("megahet: error: rank")]
    assert ours, f"no survivor printed megahet's line naming the dead rank:\n{output[-3000:]}"
    for line in ours:
        assert ": rank 3 died (" in line and "--train.load" in line, line
    print(f"dead rank: {len(ours)} survivors named rank 3")


def test_a_bad_input_is_printed_once_not_per_rank(tmp_path: Path, gpt_data: list[str]) -> None:
    missing = tmp_path / "no_such_checkpoint"
    cmd = [*torchrun_cmd(2, free_port()), str(REPO / "pretrain_gpt.py"), *COMMON, *gpt_data]
    cmd += ["--train.train_iters", "2", "--train.load", str(missing)]
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=180
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megahet: error:")]
    assert proc.returncode != 0
    assert len(errors) == 1, proc.stderr[-3000:]
    assert str(missing) in errors[0] and "train.load" in errors[0]


@pytest.mark.parametrize("state", ["running", "zombie", "reaped"])
def test_dead_ranks_are_found_by_pid(state: str) -> None:
    """A killed rank is dead before its launcher reaps it (a zombie), and only ranks of this host count."""
    from megahet.failures import dead_ranks

    child = subprocess.Popen(["sleep", "30"])
    if state != "running":
        child.kill()
        if state == "reaped":
            child.wait()
        else:
            while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                time.sleep(0.01)
    try:
        peers = [("this", os.getpid()), ("this", child.pid), ("other", child.pid)]
        assert dead_ranks(peers, "this") == ([] if state == "running" else [1])
    finally:
        child.kill()
        child.wait()


def test_a_peer_still_exiting_is_waited_for() -> None:
    """A survivor's collective fails as soon as the killed rank's sockets close, which is before its
    process shows as gone: the message waits a moment for it rather than blaming another host."""
    import threading

    from megahet.failures import _wait_for_dead

    child = subprocess.Popen(["sleep", "30"])
    killer = threading.Timer(0.3, child.kill)
    killer.start()
    try:
        assert _wait_for_dead([("this", os.getpid()), ("this", child.pid)], "this", grace_s=10.0) == [1]
        assert _wait_for_dead([("this", os.getpid())], "this", grace_s=0.1) == []
    finally:
        killer.cancel()
        child.kill()
        child.wait()
