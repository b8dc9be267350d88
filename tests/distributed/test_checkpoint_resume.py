"""Checkpoint save / resume on 2 ranks with the real pretrain_gpt training path (workers/ckpt_train.py).

Three launches and one CLI process (about 60 s on 2 cores):
1. uninterrupted: `plain` (DP=2, ZeRO-1) and `resized` (TP=2, TP rank 0 resized at gamma 0.5,
   priority selection re-planned every 3 steps), 8 steps each, saving every 2 steps;
2. killed: `plain` slowed down, with `--train.save D --train.load D` (an empty D starts fresh),
   SIGKILLed (launcher and every rank) as soon as its first checkpoint is complete;
3. resumed: the killed command again (it resumes from D's latest), `resized` resumed from a copy of
   its step-4 checkpoint, and that checkpoint loaded into runs with no resize plan and with another
   plan (no steps: the weights must be the saved ones - the stored layout is plan-independent);
4. `python pretrain_gpt.py --train.load D` with a truncated file in D: one line naming the file.
The resumed per-step losses, gradient norms, LRs, final validation loss and weights must equal the
uninterrupted run's (fp32 tolerance; they are bit-identical in practice).

Run: ``python -m pytest tests/distributed/test_checkpoint_resume.py -q``
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import (
    GPT_MODEL,
    HERE,
    REPO,
    _kill_launch,
    compare,
    free_port,
    launch_env,
    read_records,
    torchrun,
    torchrun_cmd,
)

STEPS = 8
COMMON = [
    *GPT_MODEL,
    "--train.train_iters", str(STEPS),
    "--train.micro_batch_size", "2",
    "--train.global_batch_size", "8",
    "--train.lr_warmup_iters", "2",
    "--train.log_interval", "1",
    "--train.eval_interval", "100",
    "--train.eval_iters", "2",
    "--logging.wandb", "false",
]  # fmt: skip
PLAIN = "--parallel.tp 1 --parallel.zero_stage 1"
RESIZED = "--parallel.tp 2 --resize.gamma 0:0.5 --resize.selection priority --resize.reselect_interval 3"


def _run(name: str, out: Path, extra: str, *, save: str | None = None, load: str | None = None) -> str:
    args = f"{name}={extra} --logging.metrics_file {out / (name + '.jsonl')}"
    args += f" --train.save {out / save} --train.save_interval 2" if save else ""
    return args + (f" --train.load {out / load}" if load else "")


def killed_launch(
    out: Path, common: list[str], extra: str = PLAIN, ckpt: str = "ck_plain", timeout: float = 240
) -> None:
    """Start the slowed run `extra` (saving to and loading from `ckpt`) and SIGKILL it (every process) once
    its first checkpoint is complete."""
    env = launch_env()
    run = _run("killed", out, extra, save=ckpt, load=ckpt)
    cmd = [
        *torchrun_cmd(2, free_port()),
        str(HERE / "workers/ckpt_train.py"),
        "--out",
        str(out),
        "--slow",
        "0.5",
    ]
    with open(out / "killed.log", "w") as log:
        proc = subprocess.Popen([*cmd, "--job", run, "--", *common], cwd=out, env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + timeout
            while not (out / ckpt / "latest").is_file():
                assert proc.poll() is None, (out / "killed.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint before the timeout"
                time.sleep(0.02)
        finally:
            _kill_launch(proc)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _copy_step(src: Path, dst: Path, tag: str) -> None:
    dst.mkdir()
    shutil.copytree(src / tag, dst / tag)
    (dst / "latest").write_text(tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    common = [*COMMON, *gpt_data]
    full = [
        "--job",
        _run("full_plain", out, PLAIN, save="full_plain"),
        "--job",
        _run("full_resized", out, RESIZED, save="full_resized"),
    ]
    torchrun("workers/ckpt_train.py", 2, ["--out", str(out), *full, "--", *common], cwd=out)
    killed_launch(out, common)
    _copy_step(out / "full_resized", out / "ck_resized", "iter_0000004")
    _copy_step(out / "full_resized", out / "ck_plans", "iter_0000004")
    resumed = [
        *("--job", _run("resumed_plain", out, PLAIN, save="ck_plain", load="ck_plain")),
        *("--job", _run("resumed_resized", out, RESIZED, save="ck_resized", load="ck_resized")),
        *("--job", _run("noplan", out, "--parallel.tp 2 --train.train_iters 4", load="ck_plans")),
        *(
            "--job",
            _run("otherplan", out, RESIZED + " --resize.gamma 1:0.25 --train.train_iters 4", load="ck_plans"),
        ),
    ]
    torchrun("workers/ckpt_train.py", 2, ["--out", str(out), *resumed, "--", *common], cwd=out)
    return out


def _rank(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}_rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("kind", ["plain", "resized"])
def test_resume_continues_the_loss_curve(runs: Path, kind: str) -> None:
    full, resumed = read_records(runs / f"full_{kind}.jsonl"), read_records(runs / f"resumed_{kind}.jsonl")
    start = _rank(runs, f"resumed_{kind}", 0)["start"]
    assert 2 <= start < STEPS and sorted(resumed) == list(range(start + 1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        actual = torch.tensor([resumed[s][key] for s in sorted(resumed)], dtype=torch.float64)
        expected = torch.tensor([full[s][key] for s in sorted(resumed)], dtype=torch.float64)
        compare(f"resume_{kind}", f"{key}, steps {start + 1}..{STEPS}", actual, expected, rtol=1e-5)
    compare(
        f"resume_{kind}",
        "final val_loss",
        torch.tensor(resumed[STEPS]["val_loss"]),
        torch.tensor(full[STEPS]["val_loss"]),
    )
    for rank in (0, 1):
        final = _rank(runs, f"resumed_{kind}", rank)
        assert final["iteration"] == STEPS
        compare(
            f"resume_{kind}",
            f"final weights, rank {rank}",
            final["tensors"],
            _rank(runs, f"full_{kind}", rank)["tensors"],
        )
    # the resumed stage was built without initializing its weights (they were loaded), the fresh one with
    assert (
        _rank(runs, f"full_{kind}", 0)["initialized"] and not _rank(runs, f"resumed_{kind}", 0)["initialized"]
    )
    if kind == "plain":  # the killed run logged steps up to its checkpoint at least
        assert max(read_records(runs / "killed.jsonl")) >= start


@pytest.mark.parametrize("name", ["noplan", "otherplan"])
def test_weights_are_plan_independent(runs: Path, name: str) -> None:
    """The step-4 checkpoint of the resized run loads into a run without / with another plan as saved."""
    for rank in (0, 1):
        saved = torch.load(
            runs / "ck_plans" / "iter_0000004" / f"mp_rank_{rank:02d}_model_states.pt", weights_only=False
        )
        loaded = _rank(runs, name, rank)
        assert loaded["iteration"] == 4 and not loaded["initialized"]
        module = {k: v for k, v in saved["module"].items() if torch.is_tensor(v)}
        compare("plan_independent", f"{name} weights, rank {rank}", loaded["tensors"], module, rtol=0, atol=0)


def test_truncated_checkpoint_is_a_one_line_error(runs: Path, gpt_data: list[str]) -> None:
    latest = runs / "ck_plain" / (runs / "ck_plain" / "latest").read_text()
    victim = latest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", WANDB_MODE="disabled")
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *COMMON, *gpt_data, "--train.load", str(runs / "ck_plain")],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("megahet: error: train.load:") and str(victim) in last and "truncated" in last, (
        last
    )
