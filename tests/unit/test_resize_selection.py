"""Tests of the ZERO-resizing policy, all pure functions: unit selection (priority with its fairness
guard, random) and the priority statistics (`update_gradient_stats`, `priority_scores`,
`update_drop_age`). The planner and the plan: tests/unit/test_resize_plan.py.

Run: ``python -m pytest tests/unit/test_resize_selection.py -q`` (a few seconds; no megatron-core).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from one_line import one_line

from megahet.policy.selection import (
    GradientStats,
    priority_scores,
    select_priority,
    select_random,
    update_drop_age,
    update_gradient_stats,
)

INF = math.inf


# --- select_priority ---------------------------------------------------------------------------


def test_priority_drops_the_lowest_scores() -> None:
    scores = np.array([5.0, 1.0, 3.0, 0.5, INF, 2.0, 4.0])
    age = np.zeros(7, int)
    assert select_priority(scores, age, n_drop=3, max_drop_steps=10) == (1, 3, 5)
    assert select_priority(scores, age, n_drop=1, max_drop_steps=10) == (3,)
    assert select_priority(scores, age, n_drop=0, max_drop_steps=10) == ()
    # Never-measured units (+inf) come last: the 6 measured ones go first, then the inf one.
    assert select_priority(scores, age, n_drop=6, max_drop_steps=10) == (0, 1, 2, 3, 5, 6)


def test_priority_result_is_sorted_by_unit_not_by_score() -> None:
    scores = np.array([0.3, 0.1, 0.2, 9.0])
    assert select_priority(scores, np.zeros(4, int), 3, 10) == (0, 1, 2)


def test_priority_ties_break_by_unit_index() -> None:
    scores = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    age = np.zeros(6, int)
    assert select_priority(scores, age, n_drop=3, max_drop_steps=10) == (0, 1, 3)
    # All never measured (a fresh run): the first units by index.
    assert select_priority(np.full(6, INF), age, n_drop=2, max_drop_steps=10) == (0, 1)
    # A tie across the cut: the lower indexes win, whatever their position in the array.
    scores = np.array([2.0, 1.0, 2.0, 1.0, 2.0])
    assert select_priority(scores, np.zeros(5, int), n_drop=3, max_drop_steps=10) == (0, 1, 3)


def test_priority_fairness_guard_keeps_units_dropped_too_long() -> None:
    scores = np.array([0.0, 0.1, 0.2, 0.3, 0.4])
    # Unit 0 has been dropped max_drop_steps times in a row: kept although it scores lowest.
    age = np.array([5, 0, 0, 0, 0])
    assert select_priority(scores, age, n_drop=2, max_drop_steps=5) == (1, 2)
    # One step short of the limit: still eligible.
    age = np.array([4, 4, 0, 0, 0])
    assert select_priority(scores, age, n_drop=2, max_drop_steps=5) == (0, 1)
    # The guard leaves fewer candidates than asked: fewer are dropped, never a guarded one.
    age = np.array([9, 5, 6, 0, 7])
    assert select_priority(scores, age, n_drop=3, max_drop_steps=5) == (3,)
    assert select_priority(scores, np.full(5, 5), n_drop=3, max_drop_steps=5) == ()


def test_priority_guard_over_steps_rotates_a_persistently_unimportant_unit() -> None:
    """Driven like the controller (select, then age the dropped units every step): the lowest-score
    unit is dropped exactly max_drop_steps steps in a row, kept one step, then dropped again."""
    scores = np.array([0.0, 1.0, 2.0, 3.0])
    age = np.zeros(4, int)
    history = []
    for _ in range(9):
        drop = select_priority(scores, age, n_drop=1, max_drop_steps=3)
        history.append(drop)
        mask = np.zeros(4, bool)
        mask[list(drop)] = True
        age = update_drop_age(age, mask)
    assert history == [(0,), (0,), (0,), (1,), (0,), (0,), (0,), (1,), (0,)]


def test_priority_aging_rotates_stale_units_and_keeps_the_count() -> None:
    """Selections every 10 steps, 3 of 4 units dropped (a 4x straggler), fixed (stale) scores: without
    aging the same three units stay dropped until the guard; with aging every unit is computed within
    a few selections, the most important most often, and every selection still drops three."""

    def run(age_scale: float) -> list[tuple[int, ...]]:
        scores, age, history = np.array([1.0, 1.2, 1.5, 2.0]), np.zeros(4, int), []
        for _ in range(8):
            drop = select_priority(scores, age, n_drop=3, max_drop_steps=50, age_scale=age_scale)
            history.append(drop)
            mask = np.zeros(4, bool)
            mask[list(drop)] = True
            for _ in range(10):
                age = update_drop_age(age, mask)
        return history

    assert set(run(age_scale=0.0)[:5]) == {(0, 1, 2)}  # unit 3 alone trains for 50 steps
    aged = run(age_scale=10.0)
    assert all(len(drop) == 3 for drop in aged)
    kept = Counter(u for drop in aged for u in {0, 1, 2, 3} - set(drop))
    assert set(kept) == {0, 1, 2, 3} and kept[3] == max(kept.values())


def _drop_share(scores, temperature: float, draws: int = 3000, **kw) -> np.ndarray:
    """How often each unit is dropped (n_drop=1) over `draws` seeds."""
    count = np.zeros(len(scores))
    for seed in range(draws):
        (u,) = select_priority(
            np.array(scores), np.zeros(len(scores), int), 1, 50, temperature=temperature, seed=seed, **kw
        )
        count[u] += 1
    return count / draws


def test_priority_temperature_samples_units_in_proportion_to_score_power() -> None:
    """t > 0: P(drop u) is proportional to score_u^(-1/t): scores 1 and 4 at t=1 give 0.8 / 0.2, at
    t=2 2/3 / 1/3; a large t is uniform (random selection); t=0 always drops the lowest."""
    assert _drop_share([1.0, 4.0], 1.0) == pytest.approx([0.8, 0.2], abs=0.025)
    assert _drop_share([1.0, 4.0], 2.0) == pytest.approx([2 / 3, 1 / 3], abs=0.025)
    assert _drop_share([1.0, 2.0, 4.0], 1e6) == pytest.approx([1 / 3] * 3, abs=0.025)
    assert _drop_share([1.0, 4.0], 0.0, draws=50).tolist() == [1.0, 0.0]


def test_priority_temperature_is_reproducible_and_handles_unmeasured_units() -> None:
    scores, age = np.array([0.0, 1.0, 3.0, np.inf, 2.0, np.inf]), np.zeros(6, int)
    draw = functools.partial(select_priority, scores, age, 3, 50, temperature=1.0)
    assert draw(seed=(1234, 10, 1, 0)) == draw(seed=(1234, 10, 1, 0))  # every rank draws the same
    assert len({draw(seed=s) for s in range(20)}) > 1
    # Never measured: every unit alike (uniform), whatever the scale of the infinities.
    assert _drop_share([np.inf] * 3, 1.0) == pytest.approx([1 / 3] * 3, abs=0.025)
    # An unmeasured unit counts as the highest measured score, a zero score as the lowest positive one.
    assert _drop_share([0.0, 1.0, np.inf, 4.0], 1.0) == pytest.approx(
        _drop_share([1.0, 1.0, 4.0, 4.0], 1.0), abs=0.03
    )


def test_priority_temperature_honours_the_guard_and_the_count() -> None:
    scores, age = np.array([1.0, 1.0, 5.0, 9.0]), np.array([50, 0, 0, 0])  # unit 0: dropped too long
    for seed in range(50):
        drop = select_priority(scores, age, 2, 50, temperature=1.0, seed=seed)
        assert len(drop) == 2 and 0 not in drop
    with pytest.raises(ValueError) as err:
        select_priority(scores, age, 2, 50, temperature=-1.0)
    one_line(err, "priority temperature must be >= 0", "-1.0")


def test_priority_errors() -> None:
    with pytest.raises(ValueError) as err:
        select_priority(np.zeros(4), np.zeros(4, int), n_drop=4, max_drop_steps=5)
    one_line(err, "cannot drop 4 of 4 units", "keep at least one")
    with pytest.raises(ValueError):
        select_priority(np.zeros(4), np.zeros(4, int), n_drop=-1, max_drop_steps=5)


# --- gradient statistics / update_drop_age ----------------------------------------------------


def test_priority_scores_need_two_measurements_and_measure_variance() -> None:
    stats = GradientStats.empty(3, 2)
    assert np.isinf(priority_scores(stats)).all()  # never measured: never preferred for dropping
    g1 = np.array([[1.0, 0.0], [2.0, 2.0], [5.0, 5.0]])
    stats = update_gradient_stats(stats, g1, np.array([True, True, False]), decay=0.5)
    assert stats.count.tolist() == [1, 1, 0]
    assert np.isinf(priority_scores(stats)).all()  # one sample has no variance
    g2 = np.array([[-1.0, 0.0], [2.0, 2.0], [5.0, 5.0]])
    stats = update_gradient_stats(stats, g2, np.array([True, True, True]), decay=0.5)
    scores = priority_scores(stats)
    # unit 0 flips sign: mean (0, 0), E||g||^2 = 1 -> variance 1; unit 1 is constant -> 0.
    assert scores[0] == pytest.approx(1.0) and scores[1] == pytest.approx(0.0) and np.isinf(scores[2])
    assert stats.count.tolist() == [2, 2, 1]


def test_gradient_stats_are_emas_and_dropped_units_keep_theirs() -> None:
    stats = GradientStats(
        torch.tensor([[2.0], [4.0]]), torch.tensor([4.0, 16.0]), torch.tensor([3, 3]), torch.zeros(2)
    )
    mean = stats.mean
    out = update_gradient_stats(stats, np.array([[6.0], [100.0]]), np.array([True, False]), decay=0.75)
    assert out.mean[:, 0].tolist() == [0.75 * 2 + 0.25 * 6, 4.0]
    assert out.sq.tolist() == [0.75 * 4 + 0.25 * 36, 16.0]
    assert out.count.tolist() == [4, 3]
    assert out is stats and out.mean is mean  # updated in place: no new buffer per step


def test_gradient_stats_stay_float32_tensors_and_round_trip_a_checkpoint() -> None:
    stats = GradientStats.empty(3, 4)
    stats = update_gradient_stats(stats, torch.randn(3, 4, dtype=torch.float64), np.ones(3, bool), 0.9)
    assert (stats.mean.dtype, stats.sq.dtype, stats.count.dtype) == (torch.float32, torch.float32, torch.long)
    numpy_saved = {k: v.numpy() for k, v in dataclasses.asdict(stats).items() if k != "taylor"}  # older ones
    for saved in (dataclasses.asdict(stats), numpy_saved):
        back = GradientStats.from_saved(saved)
        assert all(torch.equal(getattr(back, k), getattr(stats, k)) for k in ("mean", "sq", "count"))
        assert torch.equal(back.taylor, stats.taylor if "taylor" in saved else torch.zeros(3))


def test_priority_drops_the_least_varying_units_on_a_constructed_example() -> None:
    """Units 1 and 3 receive the same gradient every step; 0 and 2 alternate; priority drops 1 and 3."""
    stats = GradientStats.empty(4, 3)
    rng = np.random.default_rng(0)
    steady = rng.normal(size=(4, 3))
    for t in range(6):
        grad = steady.copy()
        grad[[0, 2]] *= (-1) ** t
        stats = update_gradient_stats(stats, grad, np.ones(4, bool), decay=0.8)
    drop = select_priority(priority_scores(stats), np.zeros(4, int), n_drop=2, max_drop_steps=10)
    assert drop == (1, 3)


@pytest.mark.parametrize(
    ("score", "expected"),
    [("variance", (0, 2)), ("signal", (0, 2)), ("snr", (1, 3))],
)
def test_each_priority_score_drops_its_own_least_important_units(score, expected) -> None:
    """Units 1 and 3 get a large, noisy gradient (mean 1 per element, sd 3); units 0 and 2 a small
    steady one (0.1 per element). Variance and signal (||E g||^2) drop the small steady pair; snr (the
    steady share) drops the noisy pair, whose Adam updates mostly cancel out."""
    stats = GradientStats.empty(4, 64)
    rng = np.random.default_rng(0)
    for _ in range(40):
        grad = np.full((4, 64), 0.1)
        grad[[1, 3]] = 1.0 + 3.0 * rng.normal(size=(2, 64))
        stats = update_gradient_stats(stats, grad, np.ones(4, bool), decay=0.9)
    scores = priority_scores(stats, score)
    assert select_priority(scores, np.zeros(4, int), n_drop=2, max_drop_steps=10) == expected
    if score == "snr":
        assert scores[[0, 2]] == pytest.approx(1.0) and (scores[[1, 3]] < 0.5).all()  # a share in [0, 1]


def test_taylor_score_ranks_units_by_the_loss_change_of_removing_them() -> None:
    """Same gradients, different weights: (g . w)^2 is zero for a zero unit (removing it changes
    nothing) and largest for weights aligned with the gradient; without weights the term stays put."""
    stats = GradientStats.empty(3, 4)
    grad = np.ones((3, 4))
    weight = np.array([[0.0] * 4, [1.0, -1.0, 2.0, 0.0], [1.0] * 4])  # g . w = 0, 2, 4
    for _ in range(3):
        stats = update_gradient_stats(stats, grad, np.ones(3, bool), decay=0.5, weight=weight)
    assert stats.taylor.tolist() == pytest.approx([0.0, 4.0, 16.0])
    stats = update_gradient_stats(stats, 2 * grad, np.ones(3, bool), decay=0.5)
    assert stats.taylor.tolist() == pytest.approx([0.0, 4.0, 16.0])
    scores = priority_scores(stats, "taylor")
    assert select_priority(scores, np.zeros(3, int), n_drop=1, max_drop_steps=10) == (0,)


def test_priority_score_names_the_choices() -> None:
    with pytest.raises(ValueError) as err:
        priority_scores(GradientStats.empty(2, 2), "l1")
    one_line(err, "priority score must be one of variance, snr, signal, taylor", "'l1'")


def test_update_drop_age_counts_consecutive_drops_and_resets() -> None:
    age = np.zeros(4, int)
    age = update_drop_age(age, np.array([True, True, False, False]))
    assert age.tolist() == [1, 1, 0, 0]
    age = update_drop_age(age, np.array([True, False, True, False]))
    assert age.tolist() == [2, 0, 1, 0]
    age = update_drop_age(age, np.array([True, False, True, False]))
    assert age.tolist() == [3, 0, 2, 0]
    age = update_drop_age(age, np.array([False, False, True, False]))
    assert age.tolist() == [0, 0, 3, 0]


# --- select_random -----------------------------------------------------------------------------


def test_random_selection_is_reproducible_from_its_seed() -> None:
    a = select_random(64, 16, seed=(1234, 10, 2, 1, 0, 0))
    b = select_random(64, 16, seed=(1234, 10, 2, 1, 0, 0))
    assert a == b
    assert len(a) == 16 and len(set(a)) == 16 and list(a) == sorted(a)
    assert all(0 <= u < 64 for u in a)
    assert select_random(64, 16, seed=7) == select_random(64, 16, seed=7)


def test_random_selection_differs_between_seeds() -> None:
    picks = {select_random(64, 16, seed=(1234, step, 1, 1, 0, 0)) for step in range(8)}
    assert len(picks) == 8  # C(64, 16) ~ 5e14: a repeat would mean the seed is ignored
    assert select_random(64, 16, seed=1) != select_random(64, 16, seed=2)
    # Every unit is eventually picked across seeds (no fixed subset).
    seen = set().union(*(select_random(8, 2, seed=s) for s in range(200)))
    assert seen == set(range(8))


def test_random_selection_edges() -> None:
    assert select_random(4, 0, seed=0) == ()
    assert len(select_random(4, 3, seed=0)) == 3
    with pytest.raises(ValueError) as err:
        select_random(4, 4, seed=0)
    one_line(err, "cannot drop 4 of 4 units")
