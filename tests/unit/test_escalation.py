"""The escalation ladder (megahet/policy/escalation.py, issue 46), pure: the per-collective cost model of a
time-sliced rank (the collectives each layout joins, the predicted step of each TP x DP layout, the shares a
slower replica gets, the speeds per rank from the balancers'), and the ladder's decisions: a gap the
inside-layout plan closes does not escalate; a per-collective slowness it cannot close escalates once
staying has lost what the move costs (break-even), at once when the saving is large, never in a short
episode or when it does not pay; patience is a floor; the way back breaks even the same way; hysteresis;
every decision carries its numbers; bad settings get one-line errors.

Run: ``python -m pytest tests/unit/test_escalation.py -q`` (a second).
"""

from __future__ import annotations

import pytest

from megahet.policy.escalation import (
    EscalationLadder,
    Measured,
    Observation,
    layout_choices,
    predict_step_s,
    rank_speeds,
    step_collectives,
    tp_groups,
)
from megahet.policy.mesh import coords_of, rank_of


def _measured(**changes) -> Measured:
    """Two ranks of 4 layers, 4 micro-batches a step: 0.1 s of compute each, rank 1 2 ms late to each
    collective, a calm collective 0.3 ms, the optimizer 10 ms."""
    base = {"speeds": (1.0, 1.0), "compute_s": (0.1, 0.1), "delays_s": (0.0, 0.002), "calm_wait_s": 0.0003,
            "optimizer_s": 0.01, "micro_batches": 4, "layers": 4}  # fmt: skip
    return Measured(**{**base, **changes})


def test_the_collectives_a_layout_joins_are_the_ones_counted():
    assert step_collectives(tp=2, dp=1, layers=4) == (30, 2)  # 6 a layer + 6 a micro-batch; the grad norm
    assert step_collectives(tp=1, dp=2, layers=4) == (0, 3)  # ZeRO-1's reduction, gather and norm
    assert step_collectives(tp=2, dp=2, layers=8) == (54, 5)


def test_a_time_sliced_rank_costs_tp_every_collective_and_dp_three():
    m = _measured()
    tp, shares_tp = predict_step_s(m, tp=2)
    dp, shares_dp = predict_step_s(m, tp=1)
    late = 0.0003 + 0.002
    assert tp == pytest.approx(4 * (0.2 / 4 / 2 + 30 * late) + 2 * late + 0.01) and shares_tp == (4,)
    assert dp == pytest.approx(2 * 0.05 + 3 * late + 0.01) and shares_dp == (2, 2)
    best, other = layout_choices(m, (1, 2))
    assert (best.tp, best.dp, other.tp) == (1, 2, 2) and best.describe() == "TP 1 x DP 2 (shares 2/2)"


def test_a_slower_replica_gets_fewer_micro_batches_and_an_unbalanced_tp_group_runs_at_its_slowest():
    m = _measured(speeds=(1.0, 0.5), delays_s=(0.0, 0.0))  # 0.15 s of work at speed 1
    dp, shares = predict_step_s(m, tp=1)
    assert shares == (3, 1) and dp == pytest.approx(3 * 0.15 / 4 + 3 * 0.0003 + 0.01)
    balanced, _ = predict_step_s(m, tp=2)
    unbalanced, _ = predict_step_s(m, tp=2, balanced=False)
    per_mb = 30 * 0.0003
    assert balanced == pytest.approx(4 * (0.15 / 4 / 1.5 + per_mb) + 2 * 0.0003 + 0.01)
    assert unbalanced == pytest.approx(4 * (0.15 / 4 / 1.0 + per_mb) + 2 * 0.0003 + 0.01)
    with pytest.raises(ValueError, match="TP 3 does not divide 2 ranks"):
        predict_step_s(m, tp=3)


def test_a_straggler_is_slow_or_late():
    assert not _measured(delays_s=(0.0, 0.0001)).straggler(healthy_gap=0.05, delay_floor_s=0.0005)
    assert _measured(delays_s=(0.0, 0.001)).straggler(healthy_gap=0.05, delay_floor_s=0.0005)
    assert _measured(speeds=(1.0, 0.9), delays_s=(0.0, 0.0)).straggler(healthy_gap=0.05, delay_floor_s=0.0005)
    with pytest.raises(ValueError, match="one positive speed"):
        _measured(speeds=(1.0,))


def test_rank_speeds_split_a_replica_speed_over_its_tp_ranks():
    speeds = rank_speeds(tp=2, dp=2, replicas=(1.0, 0.5), groups=[[1.0, 0.5], None])
    assert speeds == pytest.approx((1.0, 0.5, 0.375, 0.375))  # 2/3, 1/3 of 1; 1/2, 1/2 of 0.5
    assert rank_speeds(tp=2, dp=1, replicas=None, groups=[[0.5, 1.0]]) == pytest.approx((0.5, 1.0))
    assert rank_speeds(tp=1, dp=2, replicas=(1.0, 0.25), groups=None) == pytest.approx((1.0, 0.25))
    assert rank_speeds(tp=2, dp=1, replicas=None, groups=[None]) is None  # nothing measured yet


def test_strided_tp_groups_are_megatron_cores_dp_first_order_and_coords_invert():
    assert tp_groups(4, 2) == [[0, 1], [2, 3]] and tp_groups(4, 2, strided=True) == [[0, 2], [1, 3]]
    assert tp_groups(8, 4, strided=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for tp, dp, pp in ((2, 2, 1), (2, 3, 2), (4, 2, 1), (1, 4, 2)):
        for strided in (False, True):
            for rank in range(tp * dp * pp):
                d, s, t = coords_of(rank, tp, dp, strided)
                assert rank_of(d, s, t, tp, dp, strided) == rank
    assert coords_of(1, tp=2, dp=2, strided=True) == (
        1,
        0,
        0,
    )  # megatron-core: TP group [1, 3], DP group [0, 1]
    speeds = rank_speeds(tp=2, dp=2, replicas=(1.0, 0.5), groups=[None, None], strided=True)
    assert speeds == pytest.approx((1.0, 0.5, 1.0, 0.5))  # replica 1 holds ranks 1 and 3


def test_two_late_ranks_are_placed_in_one_tp_group():
    """Ranks 1 and 3 of 4 are 2 ms late to each collective: consecutive TP groups (0,1 | 2,3) put one in each
    replica, so both replicas are late to every TP collective; strided ones (0,2 | 1,3) keep replica 0 calm,
    and it takes most of the micro-batches."""
    m = _measured(speeds=(1.0,) * 4, compute_s=(0.1,) * 4, delays_s=(0.0, 0.002, 0.0, 0.002), micro_batches=8)
    consecutive, shares = predict_step_s(m, tp=2)
    strided, placed = predict_step_s(m, tp=2, strided=True)
    assert shares == (4, 4) and placed[0] > placed[1] and strided < 0.8 * consecutive
    choices = layout_choices(m, (2, 4))
    assert [(c.tp, c.strided) for c in choices] == [(2, True), (2, False), (4, False)]
    assert choices[0].describe() == f"TP 2 x DP 2 (shares {placed[0]}/{placed[1]}), TP groups 0,2 | 1,3"
    assert [(c.tp, c.strided) for c in layout_choices(m, (2, 4), placed=False)] == [(2, False), (4, False)]
    # one late rank: both placements predict alike, and the consecutive groups come first
    one = layout_choices(_measured(speeds=(1.0,) * 4, compute_s=(0.1,) * 4, delays_s=(0, 0, 0, 0.002)), (2,))
    assert one[0].step_s == one[1].step_s and not one[0].strided


def _run(ladder, episodes, inside=1.3, other=0.9, move=1.0, steps_left=1000):
    """Feed the ladder one straggler flag per step (0.4 s a step to gain by default, a move of 1 s); its
    decisions."""
    return [
        ladder.decide(Observation(step, flag, inside, other, move, steps_left - step))
        for step, flag in enumerate(episodes)
    ]


def test_a_gap_the_inside_plan_closes_does_not_escalate():
    ladder = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    decisions = _run(
        ladder, [True] * 10, inside=1.0, other=0.97
    )  # SEMI reaches within 3 % of the other layout
    assert all(d.action == "stay" for d in decisions)
    assert "less than 5%" in decisions[-1].reason


def test_a_persistent_per_collective_straggler_escalates_once_at_break_even():
    ladder = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    decisions = _run(ladder, [True] * 10)
    actions = [d.action for d in decisions]
    # 0.4 s lost a step: 0.4, 0.8 stay under the move's 1 s, 1.2 reaches it (ski rental)
    assert actions == ["stay", "stay", "move"] + ["stay"] * 7
    assert "not yet lost" in decisions[1].reason
    move = decisions[2]
    assert (
        move.gain_s == pytest.approx(0.4 * 200) and move.move_s == 1.0 and move.lost_s == pytest.approx(1.2)
    )
    assert "move" in move.line() and "80.0 s" in move.line() and "lost 1.2 s" in move.line()


def test_a_large_saving_against_a_cheap_move_moves_at_once_and_patience_is_a_floor():
    assert _run(EscalationLadder(1, 200, 0.05), [True], inside=3.0, other=1.5)[0].action == "move"
    patient = _run(EscalationLadder(3, 200, 0.05), [True] * 4, inside=3.0, other=1.5)
    assert [d.action for d in patient] == ["stay", "stay", "move", "stay"]
    assert "flagged 2 of 3" in patient[1].reason


def test_a_short_episode_or_one_that_does_not_pay_never_moves():
    ladder = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    # episodes of 2 steps lose 0.8 s each, under the move's 1 s: the loss restarts with every episode
    decisions = _run(ladder, [True, True, False] * 5)
    assert all(d.action == "stay" for d in decisions) and max(d.lost_s for d in decisions) == pytest.approx(
        0.8
    )
    costly = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    decisions = _run(costly, [True] * 10, move=100.0)  # 0.4 s x 200 steps = 80 s < 100 s
    assert all(d.action == "stay" for d in decisions) and "does not pay" in decisions[-1].reason
    late = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    assert all(d.action == "stay" for d in _run(late, [True] * 10, steps_left=2))  # too few steps left


def test_it_returns_after_the_straggler_is_gone_at_break_even_and_moves_at_most_once_each_way():
    ladder = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    # moved at step 2; on the moved-to layout "inside" is its step and "other" the way back's
    episode = [True] * 5 + [False, False, True] + [False] * 6  # two calm steps (0.8 s) then a blip: no return
    actions = [d.action for d in _run(ladder, episode)]
    assert actions.count("move") == 1 and actions.count("return") == 1
    assert (
        actions.index("move") == 2 and actions.index("return") == 8 + 2
    )  # the third calm step after the blip
    assert not ladder.moved


def test_hysteresis_keeps_a_marginal_layout_change_from_happening():
    ladder = EscalationLadder(patience=1, horizon=1000, min_gain=0.10)
    decisions = _run(ladder, [True] * 6, inside=1.0, other=0.92)  # 8 % better: pays, but under 10 %
    assert all(d.action == "stay" for d in decisions)


@pytest.mark.parametrize(
    "settings, needle",
    [({"patience": 0}, "patience 0"), ({"horizon": 0}, "horizon 0"), ({"min_gain": 1.0}, "min_gain 1.0")],
)
def test_bad_settings_get_one_line_errors(settings, needle):
    with pytest.raises(ValueError, match=needle) as err:
        EscalationLadder(**{"patience": 1, "horizon": 200, "min_gain": 0.05, **settings})
    assert "\n" not in str(err.value)
