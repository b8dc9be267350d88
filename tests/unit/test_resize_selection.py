"""Tests of the ZERO-resizing policy, all pure functions: unit selection (priority with its fairness
guard, random), the priority statistics (`update_gradient_stats`, `priority_scores`, `update_drop_age`), the planner
(`units_to_drop`, `plan_resize` with per-block overrides, `parse_rank_gammas`, `parse_block_gammas`)
and the plan itself (`ResizePlan`: lookups, `compute_counts`, dict / JSON round trips).

Run: ``python -m pytest tests/unit/test_resize_selection.py -q`` (a few seconds; no megatron-core).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from megahet.policy.resize_planner import (
    parse_block_gammas,
    parse_rank_gammas,
    plan_resize,
    units_to_drop,
)
from megahet.policy.selection import (
    GradientStats,
    priority_scores,
    select_priority,
    select_random,
    update_drop_age,
    update_gradient_stats,
)
from megahet.tensor_parallel.plan import ResizePlan, block_name, parse_block_name

INF = math.inf


def _one_line(err: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


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
    _one_line(err, "priority temperature must be >= 0", "-1.0")


def test_priority_errors() -> None:
    with pytest.raises(ValueError) as err:
        select_priority(np.zeros(4), np.zeros(4, int), n_drop=4, max_drop_steps=5)
    _one_line(err, "cannot drop 4 of 4 units", "keep at least one")
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
    _one_line(err, "priority score must be one of variance, snr, signal, taylor", "'l1'")


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
    _one_line(err, "cannot drop 4 of 4 units")


# --- units_to_drop / plan_resize ---------------------------------------------------------------


@pytest.mark.parametrize(
    "units, gamma, expected",
    [
        (64, 0.5, 32),
        (64, 0.0, 0),
        (64, 0.3, 19),  # floor(19.2)
        (4, 0.5, 2),
        (4, 0.3, 1),  # floor(1.2)
        (4, 0.74, 2),
        (4, 0.75, 3),
        (10, 0.3, 3),  # 0.3 * 10 = 3.0000000000000004 in floats
        (100, 0.29, 29),  # 0.29 * 100 = 28.999999999999996 in floats: still 29
        (10, 0.7, 7),
        (2, 0.99, 1),
        (1, 0.9, 0),  # keep at least one unit
    ],
)
def test_units_to_drop_is_floor_of_gamma_times_units(units: int, gamma: float, expected: int) -> None:
    assert units_to_drop(units, gamma) == expected


@pytest.mark.parametrize(
    "units, gamma, multiple, kept",
    [
        (3584, 0.135, 8, 3104),  # floor(483.8) dropped -> 3101 kept, rounded up to 388 x 8
        (3584, 0.135, 64, 3136),  # 49 x 64
        (3584, 0.125, 64, 3136),  # already a multiple: floor(gamma * units) unchanged
        (3584, 0.5, 128, 1792),
        (3584, 0.01, 64, 3584),  # 35 dropped would leave 3549: rounds up to every unit (no resize)
        (100, 0.5, 64, 64),  # units not a multiple: kept still rounded up to one
        (100, 0.9, 64, 64),  # keeps 64 rather than 10
        (8, 0.9, 1, 1),
    ],
)
def test_units_to_drop_keeps_a_multiple_of_units(units: int, gamma: float, multiple: int, kept: int) -> None:
    assert units - units_to_drop(units, gamma, multiple) == kept


def test_units_to_drop_rejects_a_multiple_below_one() -> None:
    with pytest.raises(ValueError) as err:
        units_to_drop(8, 0.5, 0)
    _one_line(err, "unit multiple must be >= 1")


def test_plan_resize_aligns_mlp_blocks_only() -> None:
    """Attention units are whole heads (already GEMM-aligned): only MLP blocks round to the multiple."""
    block_units = {("attn", 1): 16, ("mlp", 1): 3584}
    plan = plan_resize(block_units, {(0, 0): 0.135}, lambda b, r, n: tuple(range(n)), mlp_multiple=64)
    assert len(plan.dropped(("attn", 1), 0, 0)) == 2  # floor(0.135 * 16), not rounded to 64
    assert len(plan.dropped(("mlp", 1), 0, 0)) == 3584 - 3136


@pytest.mark.parametrize("gamma", [1.0, 1.5, -0.1])
def test_units_to_drop_rejects_gamma_outside_0_1(gamma: float) -> None:
    with pytest.raises(ValueError) as err:
        units_to_drop(8, gamma)
    _one_line(err, "gamma must be in [0, 1)")


def test_plan_resize_drops_floor_gamma_units_per_block_with_overrides() -> None:
    block_units = {("attn", 1): 4, ("mlp", 1): 64, ("attn", 2): 4, ("mlp", 2): 64}
    gammas = {(0, 0): 0.5, (1, 0): 0.3, (0, 1): 0.0}
    calls = []

    def choose(block, rank, n_drop):
        calls.append((block, rank, n_drop))
        return tuple(range(n_drop))[::-1]  # unsorted on purpose

    plan = plan_resize(block_units, gammas, choose, overrides={("mlp", 2): 0.125, ("attn", 2): 0.0})
    expected = {
        ("attn", 1): {(0, 0): 2, (1, 0): 1},  # floor(0.5 * 4), floor(0.3 * 4)
        ("mlp", 1): {(0, 0): 32, (1, 0): 19},  # floor(0.5 * 64), floor(0.3 * 64)
        ("mlp", 2): {(0, 0): 8, (1, 0): 8},  # the override applies to every resized rank
        ("attn", 2): {},  # override 0: nothing dropped there
    }
    for block, ranks in expected.items():
        assert {rank: len(units) for rank, units in plan.blocks[block].items()} == ranks, block
        for rank, n in ranks.items():
            assert plan.dropped(block, *rank) == tuple(range(n))[::-1]
        assert plan.dropped(block, 0, 1) == ()  # gamma 0: no entry
    # choose() is asked only for ranks and blocks that drop something, with the count to drop.
    assert sorted(calls) == sorted((b, r, n) for b, ranks in expected.items() for r, n in ranks.items())
    assert all(rank != (0, 1) for _, rank, _ in calls)


def test_plan_resize_without_resized_ranks_is_empty() -> None:
    plan = plan_resize({("mlp", 1): 8}, {(0, 0): 0.0}, lambda *a: pytest.fail("choose called"))
    assert plan.is_empty
    plan = plan_resize({("mlp", 1): 8}, {(0, 0): 0.1}, lambda *a: pytest.fail("choose called"))
    assert plan.is_empty  # floor(0.8) = 0


# --- parse_rank_gammas / parse_block_gammas ----------------------------------------------------


def test_parse_rank_gammas() -> None:
    assert parse_rank_gammas("0:0.5", dp_size=2, tp_size=2) == {(0, 0): 0.5, (1, 0): 0.5}
    assert parse_rank_gammas("1.0:0.25", dp_size=2, tp_size=2) == {(1, 0): 0.25}
    assert parse_rank_gammas(" 0:0.5 , 1.1:0.25,", dp_size=2, tp_size=2) == {
        (0, 0): 0.5,
        (1, 0): 0.5,
        (1, 1): 0.25,
    }
    assert parse_rank_gammas("0:0.5,0.0:0.1", dp_size=2, tp_size=1) == {(0, 0): 0.1, (1, 0): 0.5}
    assert parse_rank_gammas("1:0", dp_size=1, tp_size=2) == {(0, 1): 0.0}
    assert parse_rank_gammas(None, 2, 2) == {} and parse_rank_gammas("", 2, 2) == {}


@pytest.mark.parametrize(
    "text, needles",
    [
        ("2:0.5", ["'2:0.5'", "names no rank of DP 2 x TP 2"]),
        ("2.0:0.5", ["names no rank"]),
        ("-1:0.5", ["names no rank"]),
        ("0:1.0", ["gamma must be in [0, 1)"]),
        ("0:-0.25", ["gamma must be in [0, 1)"]),
        ("0:nan", ["gamma must be in [0, 1)"]),
        ("x:0.5", ["bad resize entry 'x:0.5'", "TP_RANK:GAMMA or DP_RANK.TP_RANK:GAMMA"]),
        ("0", ["bad resize entry '0'"]),
        ("0:", ["bad resize entry"]),
        ("0:half", ["bad resize entry"]),
        ("0.0.0:0.5", ["bad resize entry"]),
    ],
)
def test_parse_rank_gammas_errors(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_rank_gammas(text, dp_size=2, tp_size=2)
    _one_line(err, *needles)


def test_parse_block_gammas() -> None:
    assert parse_block_gammas("mlp:3=0.25, attn:1=0") == {("mlp", 3): 0.25, ("attn", 1): 0.0}
    assert parse_block_gammas(None) == {} and parse_block_gammas("") == {}


@pytest.mark.parametrize(
    "text, needles",
    [
        ("mlp:3", ["bad block override 'mlp:3'"]),
        ("ffn:1=0.5", ["bad block override", "mlp:LAYER=GAMMA or attn:LAYER=GAMMA"]),
        ("mlp:x=0.5", ["bad block override"]),
        ("mlp:-1=0.5", ["bad block override"]),
        ("mlp:1=1.5", ["gamma must be in [0, 1)"]),
        ("mlp:1=abc", ["bad block override"]),
    ],
)
def test_parse_block_gammas_errors(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_block_gammas(text)
    _one_line(err, *needles)


# --- ResizePlan --------------------------------------------------------------------------------


def test_plan_lookups_and_sorting() -> None:
    plan = ResizePlan.from_dict({"blocks": {"mlp:1": {"0,1": [7, 3]}, "attn:2": {"1,0": [1]}}})
    assert plan.dropped(("mlp", 1), dp_rank=0, tp_rank=1) == (3, 7)
    assert plan.dropped(("mlp", 1), dp_rank=1, tp_rank=1) == ()
    assert plan.dropped(("mlp", 2), dp_rank=0, tp_rank=1) == ()
    assert plan.dropped(("attn", 2), 1, 0) == (1,)
    assert not plan.is_empty
    assert ResizePlan().is_empty
    assert ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": []}}}).is_empty
    assert ResizePlan.from_dict({}).is_empty


def test_plan_round_trips_through_dict_and_json() -> None:
    plan = plan_resize(
        {("attn", 1): 4, ("mlp", 1): 16, ("mlp", 12): 16},
        {(0, 0): 0.5, (1, 1): 0.25, (1, 0): 0.0},
        lambda block, rank, n: select_random(16 if block[0] == "mlp" else 4, n, seed=(block[1], *rank)),
    )
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain JSON types
    assert set(data["blocks"]) == {"attn:1", "mlp:1", "mlp:12"}
    assert set(data["blocks"]["mlp:1"]) == {"0,0", "1,1"}  # gamma-0 rank absent
    assert ResizePlan.from_dict(data) == plan
    assert ResizePlan.from_json(plan.to_json()) == plan
    assert plan.to_json() == ResizePlan.from_json(plan.to_json()).to_json()  # canonical text
    # Entries that drop nothing are not written.
    sparse = ResizePlan({("mlp", 1): {(0, 0): (), (0, 1): (2,)}})
    assert sparse.to_dict() == {"blocks": {"mlp:1": {"0,1": [2]}}}


def test_compute_counts() -> None:
    plan = ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": [1, 2], "1,0": [1], "2,0": [2, 3], "0,1": [0]}}})
    # Unit u of TP rank 0: how many of the 3 DP replicas compute it.
    assert plan.compute_counts(("mlp", 1), tp_rank=0, dp_size=3, num_units=5) == [3, 1, 1, 2, 3]
    assert plan.compute_counts(("mlp", 1), tp_rank=1, dp_size=3, num_units=5) == [2, 3, 3, 3, 3]
    assert plan.compute_counts(("attn", 1), tp_rank=0, dp_size=3, num_units=2) == [3, 3]
    # Only the replicas within dp_size count.
    assert plan.compute_counts(("mlp", 1), tp_rank=0, dp_size=1, num_units=5) == [1, 0, 0, 1, 1]
    # Every replica dropping a unit: count 0 (imputed).
    both = ResizePlan.from_dict({"blocks": {"attn:3": {"0,0": [1], "1,0": [1, 2]}}})
    assert both.compute_counts(("attn", 3), 0, 2, 4) == [2, 0, 1, 2]
    # Weighted by each replica's micro-batches (uneven data-parallel shares): the micro-batches computing it.
    assert plan.compute_counts(("mlp", 1), 0, 3, 5, weights=(5, 2, 1)) == [8, 1, 2, 7, 8]


def test_block_names() -> None:
    assert block_name(("mlp", 3)) == "mlp:3"
    assert parse_block_name("attn:12") == ("attn", 12)
    for bad in ("mlp", "mlp:", "ffn:1", "mlp:one", "attn:-1", ":1"):
        with pytest.raises(ValueError) as err:
            parse_block_name(bad)
        _one_line(err, "bad block name", "'mlp:<layer>' or 'attn:<layer>'")


@pytest.mark.parametrize("units", [[3, 3], [-1, 2]])
def test_plan_from_dict_rejects_duplicate_or_negative_units(units) -> None:
    with pytest.raises(ValueError, match="distinct non-negative"):
        ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": units}}})
