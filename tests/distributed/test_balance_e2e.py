"""End to end: an emulated 4x straggler is detected, the balancer migrates work away within a few
steps, and the plan returns to the even split when the straggler recovers (2-rank TP=2 ViT,
`--balance.mode migrate`, virtual devices with a speed schedule; real pretrain_vit.py launch)."""

from __future__ import annotations

import json

import pytest
from harness import torchrun

SLOW_FROM, SLOW_UNTIL, STEPS = 6, 24, 36


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("balance_e2e")
    metrics = out / "metrics.jsonl"
    profile = f"schedule:0=1,1;{SLOW_FROM}=1,0.25;{SLOW_UNTIL}=1,1"
    args = (
        f"--parallel.tp 2 --device.profile {profile} --device.rate_gflops 5 --balance.mode migrate "
        f"--train.train_iters {STEPS} --train.log_interval 1 --train.eval_interval {STEPS} --train.eval_iters 2 "
        f"--logging.wandb false --logging.metrics_file {metrics} --logging.log_dir {out}"
    ).split()
    torchrun("../../pretrain_vit.py", 2, args, cwd=out, timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _balanced_work(r: dict) -> bool:
    return r["block_gflops_max"] == r["block_gflops_min"]


def test_straggler_detected_and_work_migrated_within_a_few_steps(records):
    by_step = {r["step"]: r for r in records}
    assert len(by_step) == STEPS
    assert all(
        _balanced_work(by_step[s]) and by_step[s]["plan_changes_max"] == 0 for s in range(1, SLOW_FROM + 1)
    )
    # The speed samples of step SLOW_FROM + 1 on are slow; the median of 5 flips after 3 of them.
    reacted = next(s for s in range(SLOW_FROM + 1, STEPS) if not _balanced_work(by_step[s]))
    assert reacted <= SLOW_FROM + 5, reacted
    assert by_step[reacted]["migration_mb_step_max"] > 0
    # While migrated, the slow rank's charged busy time is close to the fast one's (it was 4x).
    unbalanced = by_step[SLOW_FROM + 1]
    assert unbalanced["busy_s_max"] > 3.5 * unbalanced["busy_s_min"]
    for s in range(reacted + 1, SLOW_UNTIL):
        assert by_step[s]["busy_s_max"] < 1.35 * by_step[s]["busy_s_min"], (s, by_step[s])


def test_plan_returns_to_even_when_the_straggler_recovers(records):
    by_step = {r["step"]: r for r in records}
    recovered = next(s for s in range(SLOW_UNTIL + 1, STEPS + 1) if _balanced_work(by_step[s]))
    assert recovered <= SLOW_UNTIL + 5, recovered
    assert all(_balanced_work(by_step[s]) for s in range(recovered, STEPS + 1))
    assert by_step[STEPS]["plan_changes_max"] == 2  # migrate once, return once: no flapping
    assert by_step[STEPS]["migration_mb_step_max"] == 0
