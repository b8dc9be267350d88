"""The escalation ladder (issue 46): when balancing inside the layout cannot win, move to another layout, and
back when the straggler is gone. Pure.

Role: policy (what the balancer decides after its inside-layout plan, step by step; the runtime that measures
the per-collective delay, asks the layout planner and moves is issue 46's next steps).

A time-sliced rank (another tenant on its core or GPU) is slow per collective, not per FLOP: it adds its
scheduling delay to every collective it joins. No split of the work inside a TP group takes that back, and
TP joins ~80 collectives a step; a DP replica joins one gradient reduction a step, a pipeline stage its
sends. `layout_step_s` is that cost model: a layout's step is its balanced compute plus its collectives
times the slow rank's measured delay per collective (`collective_delay_s`: its waits against calm).

Each step the runtime hands the ladder an `Observation`: whether a straggler is flagged, the step the
inside-layout plan reaches (SEMI, DP shares, a re-split), the best other layout's predicted step, and the
measured cost of moving (save, restart in the new layout, parallel read). The rungs:

1. the inside-layout plan comes within `min_gain` of the other layout: stay (it closes the gap);
2. a straggler flagged for `patience` steps in a row, and the other layout's gain summed over `horizon`
   steps (or the steps left) exceeds the move's cost: move;
3. on the new layout, the straggler gone for `patience` steps and moving back pays the same way: return.

No flapping: a move needs the straggler flagged `patience` steps in a row and the way back needs it gone as
long, so an episode (flagged until gone `patience` steps) moves at most once each way, and one shorter than
`patience` or whose gain does not pay for the move does not move at all. Every decision, taken or not, comes back as a `Decision` with its
numbers, for the log.

    ladder = EscalationLadder(patience=5, horizon=200, min_gain=0.05)
    decision = ladder.decide(Observation(step=40, straggler=True, inside_s=1.3, other_s=0.9,
                                         move_s=20.0, steps_left=1000))
    decision.action          # "stay", "move" or "return"; decision.reason, decision.line()
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Literal


def collective_delay_s(slow_waits_s: Sequence[float], calm_waits_s: Sequence[float]) -> float:
    """The slow rank's delay per collective: the median of its peers' waits per collective while it is slow,
    less their median while calm (never below 0). Waits are seconds per collective, one per sample."""
    if not slow_waits_s or not calm_waits_s:
        raise ValueError("collective_delay_s needs waits measured both while slow and while calm")
    return max(statistics.median(slow_waits_s) - statistics.median(calm_waits_s), 0.0)


def layout_step_s(work_s: float, speeds: Sequence[float], collectives: int, delay_s: float) -> float:
    """A layout's predicted step: `work_s` (seconds of the step's work at speed 1 on one rank) split by speed
    over ranks of these `speeds` (the inside-layout balancers' best), plus `collectives` a step that each
    wait `delay_s` for the time-sliced rank (TP: every layer's; DP: the gradient reduction; PP: the sends)."""
    if work_s < 0 or collectives < 0 or delay_s < 0 or not speeds or min(speeds) <= 0:
        raise ValueError(
            f"layout_step_s: work {work_s}, collectives {collectives} and delay {delay_s} must be >= 0 and "
            f"speeds {list(speeds)} positive"
        )
    return work_s / sum(speeds) + collectives * delay_s


@dataclasses.dataclass(frozen=True)
class Observation:
    """One step's inputs: `inside_s` the step the inside-layout plan reaches on the current layout,
    `other_s` the best other layout's predicted step (the way back's, on the moved-to layout), `move_s`
    the measured (or predicted) seconds a move costs, `steps_left` the run's remaining steps."""

    step: int
    straggler: bool
    inside_s: float
    other_s: float
    move_s: float
    steps_left: int


@dataclasses.dataclass(frozen=True)
class Decision:
    step: int
    action: Literal["stay", "move", "return"]
    reason: str
    gain_s: float
    """Seconds the other layout saves over the horizon (its gain a step times the steps counted)."""
    move_s: float

    def line(self) -> str:
        """The decision as a log line, with its numbers."""
        return (
            f"escalation step {self.step}: {self.action} ({self.reason}; gain over the horizon "
            f"{self.gain_s:.1f} s, move {self.move_s:.1f} s)"
        )


class EscalationLadder:
    """The ladder's state over a run: which layout it is on, the straggler's streaks, the moves this
    episode. `decide` is called once a step."""

    def __init__(self, patience: int, horizon: int, min_gain: float):
        if patience < 1 or horizon < 1 or not 0.0 <= min_gain < 1.0:
            raise ValueError(
                f"escalation: patience {patience} and horizon {horizon} must be >= 1 steps, min_gain {min_gain} "
                "in [0, 1)"
            )
        self.patience, self.horizon, self.min_gain = patience, horizon, min_gain
        self.moved = False  # on the other layout
        self.flagged = self.calm = 0  # steps in a row with / without a straggler

    def decide(self, obs: Observation) -> Decision:
        self.flagged, self.calm = (self.flagged + 1, 0) if obs.straggler else (0, self.calm + 1)
        steps = min(self.horizon, max(obs.steps_left, 0))
        gain_s = (obs.inside_s - obs.other_s) * steps

        def decision(action, reason: str) -> Decision:
            return Decision(obs.step, action, reason, gain_s, obs.move_s)

        wanted = "return" if self.moved else "move"
        if self.moved and self.calm < self.patience:
            return decision("stay", f"straggler gone {self.calm} of {self.patience} steps")
        if not self.moved and self.flagged < self.patience:
            return decision("stay", f"straggler flagged {self.flagged} of {self.patience} steps")
        if obs.other_s > obs.inside_s * (1.0 - self.min_gain):
            return decision("stay", f"the other layout saves less than {self.min_gain:.0%} a step")
        if gain_s <= obs.move_s:
            return decision("stay", f"it does not pay within {steps} steps")
        self.moved = not self.moved
        return decision(wanted, "the straggler persists" if wanted == "move" else "the straggler is gone")
