"""The data-parallel share policy (megahet/policy/dp_shares.py, issue 16's first step): replica speeds
from rank speeds, micro-batches per replica, the sample accounting of an uneven split and the loss
scale that keeps every sample's weight.

Run: ``python -m pytest tests/unit/test_dp_shares.py -q`` (seconds; pure functions).
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from megahet.policy.dp_shares import (
    dp_shares,
    even_shares,
    replica_loss_scale,
    replica_speeds,
    share_slices,
    step_time,
)


def test_replica_speed_is_its_slowest_stage_of_tp_means() -> None:
    speeds = {(0, 0, 0): 1.0, (0, 0, 1): 0.5, (0, 1, 0): 1.0, (0, 1, 1): 1.0,  # replica 0: stage 0 mean 0.75
              (1, 0, 0): 0.5, (1, 0, 1): 0.5, (1, 1, 0): 1.0, (1, 1, 1): 1.0}  # fmt: skip
    assert replica_speeds(speeds) == [0.75, 0.5]
    assert replica_speeds(speeds, tp_balanced=False) == [0.5, 0.5]  # without TP balancing: slowest rank


@pytest.mark.parametrize(
    "speeds, message",
    [({(0, 0, 0): 0.0}, "positive and finite"), ({(0, 0, 0): float("nan")}, "positive and finite"),
     ({(1, 0, 0): 1.0}, "numbered 0..D-1"), ({}, "no rank speeds")],
)  # fmt: skip
def test_replica_speeds_refuse_bad_input(speeds, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replica_speeds(speeds)


def test_alike_replicas_split_evenly() -> None:
    assert dp_shares([1.0, 0.97, 1.0, 0.99], 8) == even_shares(8, 4) == (2, 2, 2, 2)


def _best_max_time(speeds, total) -> float:
    """The smallest slowest-replica time over every split of `total` into positive counts."""
    d = len(speeds)
    return min(
        step_time(c, speeds) for c in itertools.product(range(1, total - d + 2), repeat=d) if sum(c) == total
    )


@pytest.mark.parametrize(
    "speeds, total",
    [([1.0, 0.5], 8), ([1.0, 0.25], 8), ([1.0, 1.0, 0.5, 0.25], 16), ([0.3, 1.0, 0.7], 9), ([1.0, 0.1], 4)],
)
def test_uneven_shares_minimize_the_slowest_replica(speeds, total: int) -> None:
    shares = dp_shares(speeds, total)
    assert sum(shares) == total and min(shares) >= 1
    assert step_time(shares, speeds) == pytest.approx(_best_max_time(speeds, total))
    assert step_time(shares, speeds) < step_time(even_shares(total, len(speeds)), speeds) or total % len(
        speeds
    )


def test_hysteresis_keeps_the_current_shares_and_alike_speeds_return_to_even() -> None:
    shares = dp_shares([1.0, 0.5], 12)  # (8, 4)
    assert shares == (8, 4)
    # (8, 4) -> (7, 5) cuts the slowest replica's time from 8 to 7.14, by 10.7 %
    assert dp_shares([1.0, 0.7], 12, current=shares, hysteresis=0.15) == shares
    assert dp_shares([1.0, 0.7], 12, current=shares, hysteresis=0.05) == (7, 5)
    assert dp_shares([1.0, 0.5], 12, current=(7, 5), hysteresis=0.05) == (8, 4)
    # a tie (same slowest time) is no reason to move samples
    tie = ({dp_shares([1.0, 0.5], 8)} ^ {(5, 3), (6, 2)}).pop()  # both take 6
    assert dp_shares([1.0, 0.5], 8, current=tie, hysteresis=0.0) == tie
    assert dp_shares([1.0, 0.98], 12, current=shares, hysteresis=0.5) == (6, 6)  # recovered: even again


@pytest.mark.parametrize(
    "call, message",
    [(lambda: dp_shares([1.0, 1.0, 1.0], 2), "cannot give each of 3 replicas one"),
     (lambda: dp_shares([1.0, -1.0], 4), "positive and finite"),
     (lambda: dp_shares([1.0, 0.5], 4, current=(3, 2)), "summing to 4"),
     (lambda: share_slices([2, 0]), "at least one micro-batch"),
     (lambda: even_shares(5, 2), "do not split evenly")],
)  # fmt: skip
def test_bad_shares_are_one_line_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("shares", [(2, 2), (3, 1), (1, 3), (5, 2, 1), (1, 1, 6)])
def test_every_sample_once_per_global_batch_in_the_even_runs_order(shares) -> None:
    """Sample accounting over 5 global batches of M micro-batches of 4 samples: the replicas' slices,
    taken in replica order, are exactly the global batch, each sample once."""
    micro, total = 4, sum(shares)
    global_batch = micro * total
    for batch in range(5):
        seen = []
        for r, mbs in enumerate(share_slices(shares)):
            assert len(mbs) == shares[r]
            for mb in mbs:
                seen += range(batch * global_batch + mb * micro, batch * global_batch + (mb + 1) * micro)
        assert seen == list(range(batch * global_batch, (batch + 1) * global_batch))


@pytest.mark.parametrize("shares", [(3, 1), (1, 3), (2, 2), (5, 2, 1)])
def test_loss_scale_gives_the_even_splits_gradient(shares) -> None:
    """As the schedule and DP do it: a replica's micro-batch gradients, each divided by its own count n_r
    and scaled, summed; then averaged over replicas. Equals the mean over all M micro-batches."""
    rng = np.random.default_rng(0)
    total, dp = sum(shares), len(shares)
    grads = rng.standard_normal((total, 7))  # one gradient per micro-batch
    replicas = [
        replica_loss_scale(n, total, dp) * grads[list(mbs)].sum(axis=0) / n
        for n, mbs in zip(shares, share_slices(shares))
    ]
    np.testing.assert_allclose(np.mean(replicas, axis=0), grads.mean(axis=0), rtol=1e-12, atol=1e-15)
    assert replica_loss_scale(total // dp, total, dp) == 1.0 or total % dp


def _best_whole_step(speeds, fixed, total) -> float:
    """The smallest slowest-replica whole step (micro-batches plus fixed work) over every split."""
    d = len(speeds)
    splits = (c for c in itertools.product(range(1, total - d + 2), repeat=d) if sum(c) == total)
    return min(step_time(c, speeds, fixed) for c in splits)


@pytest.mark.parametrize("seed", range(12))
def test_shares_with_fixed_work_minimize_the_slowest_whole_step(seed: int) -> None:
    """Issue 31: a replica's fixed work (its optimizer step) counts; the split is optimal against brute
    force over every split, and a replica with more fixed work never gets more micro-batches."""
    rng = random.Random(seed)
    d, total = rng.choice([2, 3]), rng.choice([6, 8, 12])
    speeds = [rng.uniform(0.3, 1.0) for _ in range(d)]
    fixed = [rng.uniform(0.0, 3.0) for _ in range(d)]
    shares = dp_shares(speeds, total, healthy_gap=0.0, fixed=fixed)
    assert sum(shares) == total and min(shares) >= 1
    assert step_time(shares, speeds, fixed) == pytest.approx(_best_whole_step(speeds, fixed, total))
    alike = dp_shares([1.0] * d, total, healthy_gap=0.0, fixed=[1.0] * (d - 1) + [3.0])
    assert alike[-1] < min(alike[:-1])  # equal speeds: the replica with more fixed work runs fewer


def test_equal_fixed_work_keeps_alike_replicas_even_and_bad_fixed_work_is_refused() -> None:
    assert dp_shares([1.0, 0.98], 8, fixed=[2.0, 2.0]) == (4, 4)
    assert dp_shares([1.0, 1.0], 8, fixed=[0.0, 2.0]) == (5, 3)  # 5 + 0 against 3 + 2: whole steps equal
    with pytest.raises(ValueError, match="fixed work must be 2 finite times >= 0"):
        dp_shares([1.0, 0.5], 8, fixed=[1.0, -1.0])
