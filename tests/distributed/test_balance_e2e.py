"""End to end: an emulated 4x straggler is detected, the balancer migrates work away within a few
steps, and the plan returns to the even split when the straggler recovers (2-rank TP=2 ViT,
`--balance.mode migrate`, virtual devices with a speed schedule; real pretrain_vit.py launch). The
virtual device only slows its rank down: what the balancer and the console see is each rank's measured
own compute (compute regions minus collective waits), never the device's charge. The per-rank
telemetry (speed, plan, compute efficiency) and the `--balance.trace` JSONL + PNG follow it.

The run starts on a quiet machine (it waits up to 30 s for one). Measured times are checked per phase,
by their median over the phase's steps, with margins from the emulated speeds: another job that slows
a step or two (a shared 2-core machine) moves no decision, and the checks still fail without the
balancer (the straggler's 4x stays in every step)."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest
from harness import torchrun, wait_until_quiet

WARM_UP = 3
"""The first steps of a process are its warm-up (lazy initialization, first allocations): the balancer
takes no sample of the first, and on a busy host alike ranks read 0.91-0.93 of each other for about
three (issue 47's busy runs). The calm phase is checked after it."""
SLOW_FROM, SLOW_UNTIL, STEPS = WARM_UP + 6, WARM_UP + 24, WARM_UP + 36
SLOW = 0.25  # the straggler's emulated speed: a gap of 0.75
HEALTHY_GAP = 0.2
"""The test's balance.healthy_gap: far below the straggler's gap, far above what calm ranks measure apart
on a busy 2-core machine (they share its cores with whatever else runs), so noise never moves work."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("balance_e2e")


@pytest.fixture(scope="module")
def records(run_dir) -> list[dict]:
    out = run_dir
    metrics = out / "metrics.jsonl"
    profile = f"schedule:0=1,1;{SLOW_FROM}=1,{SLOW};{SLOW_UNTIL}=1,1"
    args = (
        f"--parallel.tp 2 --device.profile {profile} --device.rate_gflops 5 --balance.mode migrate "
        f"--balance.healthy_gap {HEALTHY_GAP} "
        f"--train.train_iters {STEPS} --train.log_interval 1 --train.eval_interval {STEPS} --train.eval_iters 2 "
        f"--logging.wandb false --logging.metrics_file {metrics} --logging.log_dir {out} "
        f"--balance.trace {out / 'trace.jsonl'}"
    ).split()
    wait_until_quiet(before="the balance run")
    torchrun("../../pretrain_vit.py", 2, args, cwd=out, timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _balanced_work(r: dict) -> bool:
    return r["block_gflops_max"] == r["block_gflops_min"]


def _median(by_step: dict, steps, key) -> float:
    return statistics.median(key(by_step[s]) for s in steps)


def _spread(r: dict) -> float:
    return r["compute_max_s"] / r["compute_min_s"]


def test_straggler_detected_and_work_migrated_within_a_few_steps(records):
    by_step = {r["step"]: r for r in records}
    assert len(by_step) == STEPS
    assert all(
        _balanced_work(by_step[s]) and by_step[s]["plan_changes_max"] == 0 for s in range(1, SLOW_FROM + 1)
    )
    # Record `step` is step index step - 1: from record SLOW_FROM + 1 on the samples are slow; the
    # median of 3 flips after 2 of them and the plan applies at the next step.
    reacted = next(s for s in range(SLOW_FROM + 1, STEPS) if not _balanced_work(by_step[s]))
    assert reacted <= SLOW_FROM + 3, reacted
    assert by_step[reacted]["migration_mb_step_max"] > 0
    # The measured own compute shows the straggler 4x (its peer's waits are not compute), and while
    # migrated the slow rank's compute is close to the fast one's.
    # Margins from the emulated speed: 4x slow is measured above 3.5x (within 1 - 0.875); balanced, the
    # two ranks' compute is within 1.35x (an ideal migration leaves 1.0x: the fixed non-GEMM compute
    # of a rank doing fewer units is the rest).
    unbalanced = by_step[SLOW_FROM + 1]
    assert unbalanced["compute_max_s"] > 0.875 / SLOW * unbalanced["compute_min_s"]
    assert unbalanced["device_charge_s_max"] > 0.875 / SLOW * unbalanced["device_charge_s_min"]
    migrated = range(reacted + 1, SLOW_UNTIL)
    print(
        f"migrated compute spread (max / min) per step: {[round(_spread(by_step[s]), 3) for s in migrated]}"
    )
    assert _median(by_step, migrated, _spread) < 1.35
    # Before the straggler, the two ranks' measured compute agrees within the healthy gap.
    spread = [_spread(by_step[s]) for s in range(2, SLOW_FROM + 1)]
    print(f"calm compute spread (max / min) per step: {[round(x, 3) for x in spread]}")
    assert statistics.median(spread) < 1 / (1 - HEALTHY_GAP), spread


def test_plan_returns_to_even_when_the_straggler_recovers(records):
    by_step = {r["step"]: r for r in records}
    recovered = next(s for s in range(SLOW_UNTIL + 1, STEPS + 1) if _balanced_work(by_step[s]))
    assert recovered <= SLOW_UNTIL + 7, recovered
    assert all(_balanced_work(by_step[s]) for s in range(recovered, STEPS + 1))
    # Migrate once; return in at most three steps as the measured speeds climb back (a rank doing few
    # units carries the same fixed non-GEMM compute, so it first looks somewhat slower): no flapping,
    # the migrated share only falls.
    assert 2 <= by_step[STEPS]["plan_changes_max"] <= 4
    moved = [by_step[s]["moved_tp1"] for s in range(SLOW_UNTIL, STEPS + 1)]
    assert all(a >= b for a, b in itertools.pairwise(moved)), moved
    assert by_step[STEPS]["migration_mb_step_max"] == 0


def test_console_and_wandb_metrics_show_each_ranks_speed_plan_and_efficiency(records):
    by_step = {r["step"]: r for r in records}
    # Measured, not charged: alike ranks agree within a few percent (the calm phase's median).
    calm = range(WARM_UP + 3, SLOW_FROM + 1)  # records: the estimates of steps WARM_UP ... SLOW_FROM - 1
    assert _median(by_step, calm, lambda r: r["speed_tp1"]) == pytest.approx(1.0, abs=0.05)
    assert _median(by_step, calm, lambda r: r["balance_eff"]) == pytest.approx(1.0, abs=0.05)
    slow = by_step[SLOW_FROM + 1]
    assert slow["balance_eff"] < 0.5  # 4x apart: ideal 1.6 / 4 = 0.4
    late = range(SLOW_UNTIL - 8, SLOW_UNTIL)  # migrated, the speeds measured on the migrated work
    assert _median(by_step, late, lambda r: r["speed_tp1"]) == pytest.approx(0.25, rel=0.1)
    balanced = by_step[SLOW_UNTIL - 1]
    assert balanced["speed_tp0"] == 1.0
    # Rank 1 hands units to rank 0 (moved > 0 for an owner, < 0 for its helper); nothing dropped.
    assert balanced["moved_tp1"] > 0.3 and balanced["moved_tp0"] == pytest.approx(-balanced["moved_tp1"])
    assert balanced["gamma_tp0"] == balanced["gamma_tp1"] == 0.0
    assert _median(by_step, late, lambda r: r["balance_eff"]) > 0.85
    assert by_step[STEPS]["moved_tp1"] == 0.0


def test_trace_records_every_step_and_is_drawn(records, run_dir):
    rows = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    # DP 1: the replica's micro-batches every step (what the layout planner's calibration divides by)
    assert all(len(r["microbatches"]) == 1 and r["microbatches"] == rows[0]["microbatches"] for r in rows)
    assert rows[0]["microbatches"][0] >= 1
    for r in rows:  # the step time covers the slowest rank's compute
        assert r["step_s"] >= max(r["busy_s"][0]) > 0
    assert rows[SLOW_FROM]["busy_s"][0][1] > 3.5 * rows[SLOW_FROM]["busy_s"][0][0]
    migrated = rows[SLOW_UNTIL - 2]
    assert migrated["sent"][0][1] > 0.3 and migrated["sent"][0][1] == pytest.approx(migrated["hosted"][0][0])
    assert (run_dir / "trace.png").stat().st_size > 10_000
