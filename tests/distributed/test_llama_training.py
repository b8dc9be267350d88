"""The Llama shape in the real training path (pretrain_gpt.py, TP=2, 2 ranks, gloo): rotary positions,
RMSNorm, SwiGLU, 2 key/value groups for 4 query heads (one group per TP rank), untied output layer, no
biases, with the SEMI balancer on and TP rank 1 on a virtual device 4x slow from step 4 to step 14 (at a
nominal 1 GFLOP/s: at 5 this host's real compute outran the charge on a slow day, rank 1 read 0.7x, not 0.25x,
and SEMI resized instead of migrating, at the commit before too).

Launch 1 (24 steps, saving at step 10, in the middle of the slow phase): the balancer moves query heads
(their group's k/v rows sent along) and SwiGLU units to rank 0 while rank 1 is slow and the loss falls.
Launch 2 resumes from the step-10 checkpoint (the migrated plan, statistics and optimizer state) and
must follow launch 1's loss curve from step 11 on (while no lossy resizing has run).

Run: python -m pytest tests/distributed/test_llama_training.py -q   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from harness import LLAMA_MODEL, compare, torchrun

STEPS, SLOW_FROM, SLOW_UNTIL, SAVE = 24, 4, 14, 10


def _launch(out: Path, gpt_data: list[str], name: str, extra: list[str]) -> list[dict]:
    metrics = out / f"{name}.jsonl"
    args = [
        *LLAMA_MODEL, *gpt_data, "--parallel.tp", "2", "--balance.mode", "semi",
        "--device.profile", f"schedule:0=1,1;{SLOW_FROM}=1,0.25;{SLOW_UNTIL}=1,1", "--device.rate_gflops", "1",
        "--train.train_iters", str(STEPS), "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
        "--train.lr", "3e-3", "--train.lr_warmup_iters", "2", "--train.log_interval", "1",
        "--train.eval_interval", "100", "--train.eval_iters", "1", "--logging.wandb", "false",
        "--logging.metrics_file", str(metrics), "--logging.log_dir", str(out / "runs"), *extra,
    ]  # fmt: skip
    torchrun("../../pretrain_gpt.py", 2, args, cwd=out, timeout=300)
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def runs(gpt_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("llama_training")
    save = ["--train.save", str(out / "ck"), "--train.save_interval", str(SAVE)]
    first = _launch(out, gpt_data, "first", save)
    tag = f"iter_{SAVE:07d}"  # resume from the step-SAVE checkpoint, not the last one
    shutil.copytree(out / "ck" / tag, out / "ck_mid" / tag)
    (out / "ck_mid" / "latest").write_text(tag)
    resumed = _launch(out, gpt_data, "resumed", ["--train.load", str(out / "ck_mid")])
    return {"first": first, "resumed": resumed}


def test_the_balancer_moves_llama_units_off_the_slow_rank_and_the_loss_falls(runs) -> None:
    by_step = {r["step"]: r for r in runs["first"]}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert all(by_step[s]["moved_tp1"] == 0 for s in range(1, SLOW_FROM + 1))
    moved = [by_step[s]["moved_tp1"] for s in range(SLOW_FROM + 1, SLOW_UNTIL + 1)]
    assert max(moved) > 0.3, moved  # rank 1 hands over a good part of its heads and units
    losses = [by_step[s]["loss"] for s in range(1, STEPS + 1)]
    assert statistics.mean(losses[-4:]) < statistics.mean(losses[:3]) - 0.5, losses


def test_resume_in_the_middle_of_migration_follows_the_loss_curve(runs) -> None:
    """Migration is lossless, so the two runs agree whatever units each migrates; but as rank 1 recovers,
    SEMI may *resize* it (lossy, a mild gap) at a step its measured speeds decide, differently in each run
    (seen: gamma 0.27 at step 23 in one run only, 1.2e-4 off in the loss). So the curves are compared up
    to the first resized step of either run, which must come after the slow phase."""
    first = {r["step"]: r for r in runs["first"]}
    resumed = {r["step"]: r for r in runs["resumed"]}
    assert sorted(resumed) == list(range(SAVE + 1, STEPS + 1))
    assert first[SAVE]["moved_tp1"] > 0 and resumed[SAVE + 1]["moved_tp1"] == first[SAVE + 1]["moved_tp1"]
    resized = [
        s for s in sorted(resumed) if any(r[s][f"gamma_tp{t}"] > 0 for r in (first, resumed) for t in (0, 1))
    ]
    steps = [s for s in sorted(resumed) if s < min(resized, default=STEPS + 1)]
    assert steps[-1] >= SLOW_UNTIL, resized
    for key in ("loss", "grad_norm"):
        compare(
            "llama resume", f"{key} steps {SAVE + 1}-{steps[-1]}",
            torch.tensor([resumed[s][key] for s in steps], dtype=torch.float64),
            torch.tensor([first[s][key] for s in steps], dtype=torch.float64),
        )  # fmt: skip
