"""The affine speed model (issue 47): each rank's layer time is fixed + per unit, t = c (phi + u), fitted
from the samples at different unit counts that plan changes give, and balanced on by every planner.

Synthetic ranks with known fixed and per-unit times (written here, not with the estimator's formulas):
the fitted speeds and phi, the exact balanced plan, and a closed loop of measure -> estimate -> plan that
converges to that plan and stays there, where the proportional model (time / work) spirals."""

from __future__ import annotations

import random

import pytest

from megahet.policy.detector import AffineSpeedEstimator, AffineTime, SpeedEstimator, units_of_work
from megahet.policy.planner import balance, plan_migrate_only
from megahet.runtime.balancer import compute_efficiency

FIXED = 0.4
"""Fixed layer work in units of U (the issue's ViT on a slow host measured about this)."""


def _layer_time(units: float, slowdown: float, fixed: float = FIXED, per_unit: float = 0.1) -> float:
    """A rank that is `slowdown` times slower than a nominal one at everything: its fixed work and its units."""
    return slowdown * (fixed * per_unit + units * per_unit)


def _balanced_share(slowdown: float, fixed: float = FIXED) -> float:
    """The slow rank's units that make both ranks' layer times equal, solved by bisection on the times."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        slow, fast = _layer_time(mid, slowdown, fixed), _layer_time(2 - mid, 1.0, fixed)
        lo, hi = (mid, hi) if slow < fast else (lo, mid)
    return lo


def test_a_pair_of_plans_gives_the_fixed_work_and_the_true_speeds():
    est = AffineSpeedEstimator(tp_size=2, window=3)
    for _ in range(3):
        est.update([1.0, 1.0], [_layer_time(1.0, 1.0), _layer_time(1.0, 4.0)])
    assert est.speeds() == pytest.approx([1.0, 0.25])  # even split: no pair needed
    assert est.phis() == [0.0, 0.0]
    for _ in range(2):  # 0.6 of rank 1's units moved to rank 0
        est.update([1.6, 0.4], [_layer_time(1.6, 1.0), _layer_time(0.4, 4.0)])
    assert est.phis() == pytest.approx([FIXED, FIXED])
    assert est.speeds() == pytest.approx([1.0, 0.25])
    # fixed work in units of the fastest rank's U-time: the slow rank's is 4x
    assert est.fixed() == pytest.approx([FIXED, 4 * FIXED])


def test_the_proportional_estimate_drifts_where_the_affine_one_does_not():
    """The issue's numbers: with fixed work, time / work reads a quarter-speed rank slower the more it gives away."""
    old, new = SpeedEstimator(2, window=3), AffineSpeedEstimator(2, window=3)
    for units in ([1.0, 1.0], [1.6, 0.4], [1.685, 0.315]):
        for _ in range(3):
            times = [_layer_time(units[0], 1.0), _layer_time(units[1], 4.0)]
            old.update(units, times)
            new.update(units, times)
    assert old.speeds()[1] < 0.17  # 0.25 * 0.315 * 2.085 / (1.685 * 0.715)
    assert new.speeds()[1] == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["migrate", "semi"])
@pytest.mark.parametrize("slowdown", [2.0, 4.0, 8.0])
def test_closed_loop_converges_to_the_balanced_plan_without_spiralling(mode, slowdown):
    """Measure -> estimate -> plan, 30 steps: the plan reaches the share that equalizes the ranks' times
    (within a grid step of the hysteresis) and never moves again; the proportional model, on the same ranks,
    moves too much and keeps the slow rank the slower one."""

    def run(estimator) -> list[float]:
        target, history = None, []
        for _ in range(30):
            units = target.work(2) if target else [1.0, 1.0]
            estimator.update(units, [_layer_time(units[0], 1.0), _layer_time(units[1], slowdown)])
            fixed = estimator.fixed() if isinstance(estimator, AffineSpeedEstimator) else None
            speeds = estimator.unit_speeds() if fixed else estimator.speeds()
            target = balance(speeds, mode, target, tolerance=0.3, fixed=fixed)
            history.append(target.work(2)[1])
        return history

    affine = run(AffineSpeedEstimator(2, window=3))
    ideal = _balanced_share(slowdown)
    assert affine[-1] == pytest.approx(ideal, abs=0.03)
    assert len(set(affine[-20:])) == 1  # settled: no re-plan in the last 20 steps
    proportional = run(SpeedEstimator(2, window=3))[-1]
    slow, fast = _layer_time(proportional, slowdown), _layer_time(2 - proportional, 1.0)
    assert slow / fast > 1.05 and abs(proportional - ideal) > 0.03


def test_noisy_times_still_give_the_plan_within_a_few_percent():
    rng = random.Random(3)
    est, target = AffineSpeedEstimator(2, window=5), None
    for _ in range(40):
        units = target.work(2) if target else [1.0, 1.0]
        noise = [rng.uniform(0.97, 1.03) for _ in range(2)]
        est.update(units, [_layer_time(units[0], 1.0) * noise[0], _layer_time(units[1], 4.0) * noise[1]])
        target = balance(est.unit_speeds(), "migrate", target, fixed=est.fixed())
    assert est.speeds()[1] == pytest.approx(0.25, rel=0.1)
    assert target.work(2)[1] == pytest.approx(_balanced_share(4.0), abs=0.03)


def test_the_plan_of_known_speeds_and_fixed_work_equalizes_the_times():
    """The planner with the fixed work in units of the fastest rank's U-time: both ranks' times are equal."""
    speeds, fixed = [1.0, 0.25], [FIXED, 4 * FIXED]
    work = plan_migrate_only(speeds, fixed=fixed).work(2)
    times = [_layer_time(work[0], 1.0), _layer_time(work[1], 4.0)]
    assert times[0] == pytest.approx(times[1])
    assert work[1] == pytest.approx(_balanced_share(4.0), abs=1e-6)


def test_a_speed_change_at_a_plan_change_gives_no_pair():
    rank = AffineTime(window=3)
    for _ in range(3):
        rank.update(1.0, 1.0)
    for _ in range(2):  # fewer units but slower: the time went up, against the work
        rank.update(0.5, 2.0)
    assert list(rank.pairs) == []
    rank.update(1.0, 4.0)  # back to 1 unit: a valid pair against the 0.5-unit run (t 2 -> 4)
    assert list(rank.pairs) == [pytest.approx(0.0)]


def test_state_round_trips_and_old_speed_samples_load_as_the_same_speeds():
    est = AffineSpeedEstimator(2, window=3)
    for units in ([1.0, 1.0], [1.0, 1.0], [1.6, 0.4], [1.6, 0.4]):
        est.update(units, [_layer_time(units[0], 1.0), _layer_time(units[1], 4.0)])
    copy = AffineSpeedEstimator(2, window=3)
    copy.load_state_dict(est.state_dict())
    assert copy.state_dict() == est.state_dict() and copy.speeds() == est.speeds()
    old = AffineSpeedEstimator(2, window=3)
    old.load_state_dict([[2.0, 2.0], [0.5, 0.5]])  # a checkpoint of the proportional model: work / time
    assert old.speeds() == pytest.approx([1.0, 0.25])
    with pytest.raises(ValueError, match="saved speeds are for 3 TP ranks"):
        old.load_state_dict([[], [], []])


def test_units_of_work_and_efficiency_with_fixed_work():
    assert units_of_work([3.0, 1.0], [1.5, 0.5]) == pytest.approx([1.5, 0.5])
    assert units_of_work([0.0, 0.0], [1.0, 1.0]) == [-1.0, -1.0]  # nothing measured
    # Balanced under the affine model (equal times at the balanced share): efficiency 1. The proportional
    # split (0.4 of U on the quarter-speed rank) leaves it the slower one: the affine efficiency says how much.
    share = _balanced_share(4.0)
    for units, expected in (
        ([2 - share, share], 1.0),
        ([1.6, 0.4], _layer_time(2 - share, 1.0) / _layer_time(0.4, 4.0)),
    ):
        busy = [_layer_time(units[0], 1.0), _layer_time(units[1], 4.0)]
        assert compute_efficiency(units, busy, phi=[FIXED, FIXED]) == pytest.approx(expected)
    assert expected < 0.85


def test_ranks_with_different_fixed_work_keep_their_own():
    """A virtual device on a host faster than its rate is charged its FLOPs only (no fixed work) while its
    peer runs really (fixed work 0.4): each rank's own pairs give its own phi, and both speeds are exact.
    When the slow rank recovers it is still charged its FLOPs only: its phi 0 still holds (CI once saw
    the group's phi given to it instead make its peer look 0.79 as fast and move work back too far)."""
    est = AffineSpeedEstimator(2, window=3)

    def step(units, slowdown):
        est.update(units, [_layer_time(units[0], 1.0), _layer_time(units[1], slowdown, fixed=0.0)])

    for _ in range(3):
        step([1.0, 1.0], 4.0)
    for _ in range(3):
        step([1.6, 0.4], 4.0)
    assert est.phis() == pytest.approx([FIXED, 0.0])
    assert est.unit_speeds() == pytest.approx([1.0, 0.25])  # per U: 0.1 s against 0.4 s
    assert est.speeds() == pytest.approx([1.0, 0.35])  # the even split: 0.14 s against 0.4 s
    for _ in range(3):  # recovered, same plan
        step([1.6, 0.4], 1.0)
    assert est.phis() == pytest.approx([FIXED, 0.0])
    assert est.speeds() == pytest.approx([0.1 / 0.14, 1.0])  # at the even split: 0.14 s against 0.1 s
    # the plan that equalizes 0.1 (0.4 + u0) and 0.1 u1: rank 0 hands 0.2 of U to rank 1
    assert balance(est.unit_speeds(), "migrate", fixed=est.fixed()).work(2) == pytest.approx([0.8, 1.2])
