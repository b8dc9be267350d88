"""The context-parallel placement planner (issue 45, megahet/policy/cp_placement.py): every token placed
once, in causal order; documents that fit stay whole when that is no slower; speeds shift the work; the
plan is deterministic; it is close to the best of a brute force on small cases; the baselines are what
megatron-core's rules give. Expected values are counted by hand here, not with the planner's helpers.

Run: ``python -m pytest tests/unit/test_cp_placement.py -q`` (a second).
"""

from __future__ import annotations

import itertools
import random

import pytest

from megahet.policy.cp_placement import (
    CPPlan,
    block_plan,
    cp_times,
    dynamic_cp_plan,
    power_of_two_plan,
    slice_cost,
    static_cp_plan,
)
from megahet.policy.packing import DocCost

COST = DocCost(a=1e-6, b=1e-3, c=0.0)  # attention dominates past s = 1000 tokens


def _long_tail(seed: int, n: int = 24) -> list[int]:
    """Most documents short, a tail up to ~32x the median."""
    rng = random.Random(seed)
    return [int(256 * 2 ** rng.choice([0, 0, 0, 0, 1, 1, 2, 3, 5])) + rng.randrange(64) for _ in range(n)]


def _planners(lengths, speeds, cap=None):
    cp = len(speeds)
    return {
        "static": static_cp_plan(lengths, cp),
        "power_of_two": power_of_two_plan(lengths, cp, cap or max(lengths), COST, speeds),
        "block": block_plan(lengths, COST, speeds, cap, block=128, kv_seconds=1e-6),
        "dynamic": dynamic_cp_plan(lengths, COST, speeds, cap, block=128, kv_seconds=1e-6),
    }


def _covers_in_order(plan: CPPlan) -> None:
    """Each document's slices, in order, tile [0, length) with no gap and no overlap."""
    for doc, length in enumerate(plan.lengths):
        pieces = sorted((s.start, s.stop) for s in plan.slices if s.doc == doc)
        assert pieces[0][0] == 0 and pieces[-1][1] == length, (doc, pieces)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces)), (doc, pieces)
        assert all(s.rank in range(plan.cp) for s in plan.slices)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 0.5), (1.0, 1.0, 1.0, 0.5)])
def test_every_token_is_placed_once_in_causal_order(seed, speeds):
    lengths = _long_tail(seed)
    for name, plan in _planners(lengths, speeds).items():
        _covers_in_order(plan)
        assert sum(plan.tokens()) == sum(lengths), name


def test_slice_costs_add_up_to_the_document_and_kv_counts_by_hand():
    """The cost of a document's slices sums to a s^2 + b s whatever the cuts; head-tail over 2 ranks of
    8 tokens is [0,2) r0, [2,4) r1, [4,6) r1, [6,8) r0: rank 0 (up to token 8) receives rank 1's 4 tokens,
    rank 1 (up to token 6) receives rank 0's [0,2)."""
    for cuts in ([0, 100], [0, 10, 37, 100], [0, 1, 2, 99, 100]):
        assert sum(slice_cost(COST, a, b) for a, b in itertools.pairwise(cuts)) == pytest.approx(
            COST.a * 100**2 + COST.b * 100
        )
    plan = static_cp_plan([8], 2)
    assert [(s.start, s.stop, s.rank) for s in plan.slices] == [(0, 2, 0), (2, 4, 1), (4, 6, 1), (6, 8, 0)]
    assert plan.kv_tokens() == [4, 2]
    assert plan.tokens() == [4, 4]
    # rank 0 computes query rows 0-1 and 6-7: a (2^2 - 0) + a (8^2 - 6^2); rank 1 the middle
    work = [COST.a * (4 + 64 - 36) + 4 * COST.b, COST.a * (36 - 4) + 4 * COST.b]
    assert cp_times(plan, COST, [1.0, 0.5], kv_seconds=0.1) == pytest.approx(
        [work[0] + 0.4, work[1] / 0.5 + 0.2]
    )


def test_short_documents_stay_whole_and_exchange_nothing():
    """Many short documents balance as wholes: nothing is cut, no K/V crosses ranks."""
    lengths = [200, 180, 170, 160, 150, 140, 130, 120] * 2
    plan = dynamic_cp_plan(lengths, COST, [1.0, 1.0], block=64, kv_seconds=1e-6)
    assert all(plan.whole()) and plan.kv_tokens() == [0, 0]
    times = cp_times(plan, COST, [1.0, 1.0], 1e-6)
    assert max(times) / (sum(times) / 2) < 1.05


def test_a_long_document_spreads_and_one_over_the_cap_must():
    """One long document among short ones is cut (alone on one rank it would dominate the step); a
    document over the per-rank cap is cut whatever it costs; more tokens than the ranks hold is an error."""
    lengths = [8192, 256, 256, 256]
    plan = dynamic_cp_plan(lengths, COST, [1.0, 1.0], block=512, kv_seconds=1e-7)
    assert not plan.whole()[0] and all(plan.whole()[1:])
    capped = dynamic_cp_plan([3000, 100], DocCost(a=0.0, b=1.0, c=0.0), [1.0, 1.0], cap=2000, block=500)
    assert max(capped.tokens()) <= 2000 and not capped.whole()[0]
    with pytest.raises(ValueError, match="do not fit"):
        dynamic_cp_plan([3000, 2000], COST, [1.0, 1.0], cap=2000)


def test_speeds_shift_the_work():
    """A rank at half speed gets about half the work, and the predicted times stay even."""
    lengths = _long_tail(3, n=40)
    plan = dynamic_cp_plan(lengths, COST, [1.0, 0.5], block=128, kv_seconds=1e-7)
    work = [sum(slice_cost(COST, s.start, s.stop) for s in plan.slices_of(r)) for r in range(2)]
    assert work[1] / work[0] == pytest.approx(0.5, abs=0.08)
    times = cp_times(plan, COST, [1.0, 0.5], 1e-7)
    assert max(times) / min(times) < 1.1
    static = cp_times(static_cp_plan(lengths, 2), COST, [1.0, 0.5], 1e-7)
    assert max(static) / max(times) > 1.3  # the even split waits for the slow rank


def test_the_plan_is_deterministic():
    lengths = _long_tail(11)
    plans = [
        dynamic_cp_plan(list(lengths), COST, (1.0, 0.7, 0.7, 1.0), block=128, kv_seconds=1e-6)
        for _ in range(3)
    ]
    assert plans[0] == plans[1] == plans[2]


def test_power_of_two_rule_gives_a_document_the_next_power_of_two_of_ranks():
    """megatron-core's hybrid CP: s / cap of 0.5, 1.5, 3 -> 1, 2 and 4 ranks."""
    plan = power_of_two_plan([512, 1536, 3072], cp=4, cap=1024, cost=COST)
    ranks = [len({s.rank for s in plan.slices if s.doc == d}) for d in range(3)]
    assert ranks == [1, 2, 4]


def _best_by_brute_force(lengths, speeds, kv_seconds) -> float:
    """The fastest step over every choice, per document, of one rank (whole) or all ranks (head-tail)."""
    cp, best = len(speeds), float("inf")
    for choice in itertools.product(range(cp + 1), repeat=len(lengths)):
        work, received = [0.0] * cp, [0] * cp
        for n, c in zip(lengths, choice):
            if c < cp:
                work[c] += COST.a * n * n + COST.b * n
                continue
            k = 2 * cp
            bounds = [n * i // k for i in range(k + 1)]
            for i in range(k):
                work[min(i, k - 1 - i)] += COST.a * (bounds[i + 1] ** 2 - bounds[i] ** 2) + COST.b * (
                    bounds[i + 1] - bounds[i]
                )
            for r in range(cp):  # head-tail: rank r's last chunk ends at bounds[k - r]
                end = bounds[k - r]
                received[r] += end - sum(
                    bounds[i + 1] - bounds[i] for i in range(k) if min(i, k - 1 - i) == r
                )
        best = min(best, max(w / v + t * kv_seconds for w, v, t in zip(work, speeds, received)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_close_to_a_brute_force_on_small_cases(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([128, 256, 512, 2048, 4096]) for _ in range(6)]
    speeds = rng.choice([(1.0, 1.0), (1.0, 0.5)])
    plan = dynamic_cp_plan(lengths, COST, speeds, block=128, kv_seconds=1e-7)
    mine = max(cp_times(plan, COST, speeds, 1e-7))
    assert mine <= 1.1 * _best_by_brute_force(lengths, speeds, 1e-7), (lengths, speeds)
