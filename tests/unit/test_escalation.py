"""The escalation ladder (megahet/policy/escalation.py, issue 46), pure: the per-collective cost model of a
time-sliced rank, and the ladder's decisions: a gap the inside-layout plan closes does not escalate; a
per-collective slowness it cannot close escalates when it pays; a short episode or one that does not pay
never moves; the way back waits as long; hysteresis; every decision carries its numbers; bad settings get
one-line errors.

Run: ``python -m pytest tests/unit/test_escalation.py -q`` (a second).
"""

from __future__ import annotations

import pytest

from megahet.policy.escalation import (
    EscalationLadder,
    Observation,
    collective_delay_s,
    layout_step_s,
)

TP_COLLECTIVES, DP_COLLECTIVES = (
    80,
    1,
)  # collectives a step: TP joins ~80 (issue 31), DP one gradient reduction


def test_a_time_sliced_rank_costs_tp_per_collective_and_dp_once():
    delay = collective_delay_s([0.0031, 0.0029, 0.0040], [0.0011, 0.0010, 0.0009])
    assert delay == pytest.approx(0.0021)  # medians 3.1 ms and 1.0 ms
    speeds = (1.0, 0.5)
    tp = layout_step_s(1.0, speeds, TP_COLLECTIVES, delay)
    dp = layout_step_s(1.0, speeds, DP_COLLECTIVES, delay)
    assert tp == pytest.approx(1 / 1.5 + 80 * 0.0021) and dp == pytest.approx(1 / 1.5 + 0.0021)
    assert collective_delay_s([0.001], [0.002]) == 0.0  # never negative
    with pytest.raises(ValueError, match="speeds"):
        layout_step_s(1.0, (1.0, 0.0), 1, 0.0)


def _run(ladder, episodes, inside=1.3, other=0.9, move=20.0, steps_left=1000):
    """Feed the ladder one straggler flag per step; its decisions."""
    return [
        ladder.decide(Observation(step, flag, inside, other, move, steps_left - step))
        for step, flag in enumerate(episodes)
    ]


def test_a_gap_the_inside_plan_closes_does_not_escalate():
    ladder = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    decisions = _run(
        ladder, [True] * 10, inside=1.0, other=0.97
    )  # SEMI reaches within 3 % of the other layout
    assert all(d.action == "stay" for d in decisions)
    assert "less than 5%" in decisions[-1].reason


def test_a_persistent_per_collective_straggler_escalates_once_when_it_pays():
    ladder = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    decisions = _run(ladder, [True] * 10)
    actions = [d.action for d in decisions]
    assert actions == ["stay", "stay", "move"] + ["stay"] * 7  # after patience, once
    move = decisions[2]
    assert move.gain_s == pytest.approx(0.4 * 200) and move.move_s == 20.0
    assert "move" in move.line() and "80.0 s" in move.line()


def test_a_short_episode_or_one_that_does_not_pay_never_moves():
    ladder = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    assert all(d.action == "stay" for d in _run(ladder, [True, True, False, True, True, False] * 3))
    costly = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    decisions = _run(costly, [True] * 10, move=100.0)  # 0.4 s x 200 steps = 80 s < 100 s
    assert all(d.action == "stay" for d in decisions) and "does not pay" in decisions[-1].reason
    late = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    assert all(d.action == "stay" for d in _run(late, [True] * 10, steps_left=40))  # too few steps left


def test_it_returns_after_the_straggler_is_gone_as_long_and_moves_at_most_once_each_way():
    ladder = EscalationLadder(patience=3, horizon=200, min_gain=0.05)
    episode = [True] * 5 + [False, True] + [False] * 6  # a blip of calm does not send it back
    actions = [d.action for d in _run(ladder, episode)]
    assert actions.count("move") == 1 and actions.count("return") == 1
    assert actions.index("return") == 5 + 2 + 2  # the third calm step in a row
    assert not ladder.moved


def test_hysteresis_keeps_a_marginal_layout_change_from_happening():
    ladder = EscalationLadder(patience=2, horizon=1000, min_gain=0.10)
    decisions = _run(ladder, [True] * 6, inside=1.0, other=0.92)  # 8 % better: pays, but under 10 %
    assert all(d.action == "stay" for d in decisions)


@pytest.mark.parametrize(
    "settings, needle",
    [({"patience": 0}, "patience 0"), ({"horizon": 0}, "horizon 0"), ({"min_gain": 1.0}, "min_gain 1.0")],
)
def test_bad_settings_get_one_line_errors(settings, needle):
    with pytest.raises(ValueError, match=needle) as err:
        EscalationLadder(**{"patience": 3, "horizon": 200, "min_gain": 0.05, **settings})
    assert "\n" not in str(err.value)
