"""The escalation ladder (issue 46): when balancing inside the layout cannot win, move to another layout, and
back when the straggler is gone. Pure.

Role: policy (what the balancer decides after its inside-layout plan, step by step; the runtime that measures
the per-collective delay, asks the layout planner and moves is issue 46's next steps).

A time-sliced rank (another tenant on its core or GPU) is slow per collective, not per FLOP: it adds its
scheduling delay to every collective it joins. No split of the work inside a TP group takes that back, and
TP joins ~120 collectives a step (4 layers, 4 micro-batches); a DP replica joins 3 in the optimizer step.
`predict_step_s` is that cost model: a layout's step is its compute balanced by speed plus its collectives
times the calm wait and the latest rank's measured delay per collective.

Each step the runtime hands the ladder an `Observation`: whether a straggler is flagged, the step the
inside-layout plan reaches (SEMI, DP shares, a re-split), the best other layout's predicted step, and the
measured cost of moving. The rungs:

1. the inside-layout plan comes within `min_gain` of the other layout: stay (it closes the gap);
2. a straggler flagged for at least `patience` steps in a row, the other layout's gain summed over
   `horizon` steps (or the steps left) above the move's cost, and the time already lost by staying this
   episode (the other layout's saving summed over the flagged steps) at least the move's cost: move;
3. on the new layout, the straggler gone as long and moving back paying and breaking even the same way:
   return.

The last condition is the ski-rental rule (rent until the rent paid equals the price, then buy): an episode
whose length is unknown costs at most twice what moving at its start, or never, would have (as far as the
predicted saving and the priced move are right). A large saving against a cheap move moves after one
flagged step; a marginal one waits; an episode that ends before its losses reach the move's cost never
moves. No flapping: the way back needs the straggler gone and the same
break-even, so an episode moves at most once each way. Every decision, taken or not, comes back as a
`Decision` with its numbers, for the log.

    ladder = EscalationLadder(patience=1, horizon=200, min_gain=0.05)
    decision = ladder.decide(Observation(step=40, straggler=True, inside_s=1.3, other_s=0.9,
                                         move_s=0.3, steps_left=1000))
    decision.action          # "stay", "move" or "return"; decision.reason, decision.line()

The other layout's step is predicted from what the runtime measured on this one (`Measured`: each rank's
speed, own compute and per-collective delay, a collective's calm wait, the optimizer step) by
`predict_step_s`: the work at speed 1 split over the candidate's replicas by their speed (the DP shares a
measured balancer would give them, whole micro-batches), plus its collectives (`step_collectives`, counted
on megatron-core 0.16 and DeepSpeed 0.19 by CommClock, tests/distributed/test_escalation_training.py checks the
count), each at the calm wait plus the delay of the latest rank it waits for. At TP and DP both > 1 each
placement of the TP groups is a choice of its own (`tp_groups`: megatron-core's consecutive ranks, or strided
ones, which put two late ranks in one replica). `LayoutMemory` predicts a rank's memory on each layout, and
`left_out_by_memory` names those over the cap.

    best = layout_choices(measured, tps=(1, 2, 4))[0]     # LayoutChoice: tp, dp, step_s, shares, strided
    best.describe()                                      # "TP 2 x DP 2 (shares 10/6), TP groups 0,2 | 1,3"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from megahet.policy.dp_shares import dp_shares, even_shares
from megahet.policy.layout_cost import STATE_BYTES
from megahet.policy.mesh import rank_of

TP_COLLECTIVES_PER_LAYER = 6
"""Collectives a TP > 1 rank joins per transformer layer and micro-batch, forward and backward (counted by
CommClock at TP 2 and 4, 4 and 8 layers; a collective over a group of one is not one: it waits for no peer)."""
TP_COLLECTIVES_PER_MICRO_BATCH = 6
"""... and per micro-batch outside the layers (the vocabulary-parallel embedding and cross-entropy)."""
TP_STEP_COLLECTIVES = 2
"""Per step in the optimizer step with TP > 1 (the gradient norm over the model-parallel group)."""
DP_STEP_COLLECTIVES = 3
"""Per step in the optimizer step with DP > 1 (ZeRO-1's gradient reduction and parameter gather, the norm)."""


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
    lost_s: float
    """Seconds lost by staying so far this episode (the other layout's gain summed over its steps)."""

    def line(self) -> str:
        """The decision as a log line, with its numbers."""
        return (
            f"escalation step {self.step}: {self.action} ({self.reason}; gain over the horizon "
            f"{self.gain_s:.1f} s, lost {self.lost_s:.1f} s, move {self.move_s:.1f} s)"
        )


class EscalationLadder:
    """The ladder's state over a run: which layout it is on, the straggler's streaks and the time lost by
    staying this streak. `decide` is called once a step."""

    def __init__(self, patience: int, horizon: int, min_gain: float):
        if patience < 1 or horizon < 1 or not 0.0 <= min_gain < 1.0:
            raise ValueError(
                f"escalation: patience {patience} and horizon {horizon} must be >= 1 steps, min_gain {min_gain} "
                "in [0, 1)"
            )
        self.patience, self.horizon, self.min_gain = patience, horizon, min_gain
        self.moved = False  # on the other layout
        self.flagged = self.calm = 0  # steps in a row with / without a straggler
        # the other layout's saving summed over the current streak (flagged; calm, once moved)
        self.lost_s = 0.0

    def decide(self, obs: Observation) -> Decision:
        self.flagged, self.calm = (self.flagged + 1, 0) if obs.straggler else (0, self.calm + 1)
        if obs.straggler == self.moved:  # the streak the next move counts (flagged; calm, once moved) broke
            self.lost_s = 0.0
        elif obs.other_s < obs.inside_s:
            self.lost_s += obs.inside_s - obs.other_s
        steps = min(self.horizon, max(obs.steps_left, 0))
        gain_s = (obs.inside_s - obs.other_s) * steps

        def decision(action, reason: str) -> Decision:
            return Decision(obs.step, action, reason, gain_s, obs.move_s, self.lost_s)

        wanted = "return" if self.moved else "move"
        if self.moved and self.calm < self.patience:
            return decision("stay", f"straggler gone {self.calm} of {self.patience} steps")
        if not self.moved and self.flagged < self.patience:
            return decision("stay", f"straggler flagged {self.flagged} of {self.patience} steps")
        if obs.other_s > obs.inside_s * (1.0 - self.min_gain):
            return decision("stay", f"the other layout saves less than {self.min_gain:.0%} a step")
        if gain_s <= obs.move_s:
            return decision("stay", f"it does not pay within {steps} steps")
        if self.lost_s < obs.move_s:
            return decision("stay", "staying has not yet lost what the move costs")
        out = decision(wanted, "the straggler persists" if wanted == "move" else "the straggler is gone")
        self.switch()
        return out

    def switch(self) -> None:
        """Onto the other layout (a move, or the way back): the streaks and the time lost start again."""
        self.moved = not self.moved
        self.flagged = self.calm = 0
        self.lost_s = 0.0


def step_collectives(tp: int, dp: int, layers: int) -> tuple[int, int]:
    """(collectives per micro-batch, collectives per step outside the micro-batches) a rank of a TP x DP
    layout joins, `layers` transformer layers (PP 1, ZeRO-1); counted on this stack (the module constants)."""
    per_mb = TP_COLLECTIVES_PER_LAYER * layers + TP_COLLECTIVES_PER_MICRO_BATCH if tp > 1 else 0
    per_step = TP_STEP_COLLECTIVES * (tp > 1) + DP_STEP_COLLECTIVES * (dp > 1)
    return per_mb, per_step


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the runtime measured on the current layout, per global rank (medians over its window)."""

    speeds: tuple[float, ...]
    """Relative speeds, fastest 1 (the balancers' estimates)."""
    compute_s: tuple[float, ...]
    """Own compute per step in the forward and backward (collective waits excluded)."""
    delays_s: tuple[float, ...]
    """The delay each rank adds to every collective it joins (a time-sliced rank's; 0 for a calm one)."""
    calm_wait_s: float
    """A collective's wait when no rank is late (the transfer)."""
    optimizer_s: float
    """The optimizer step's own time (the slowest rank's)."""
    micro_batches: int
    """Micro-batches per global batch."""
    layers: int

    def __post_init__(self):
        n = len(self.speeds)
        if not n or len(self.compute_s) != n or len(self.delays_s) != n or min(self.speeds) <= 0:
            raise ValueError(f"Measured: one positive speed, compute and delay per rank, got {self}")

    @property
    def work_s(self) -> float:
        """The step's forward and backward at speed 1, summed over ranks (a rank of speed s that computed c
        seconds did c x s of it)."""
        return sum(c * s for c, s in zip(self.compute_s, self.speeds))

    def straggler(self, healthy_gap: float, delay_floor_s: float) -> bool:
        """A rank is slower than the fastest by more than `healthy_gap`, or late to each collective by more
        than `delay_floor_s`."""
        return min(self.speeds) < 1.0 - healthy_gap or max(self.delays_s) > delay_floor_s


def tp_groups(ranks: int, tp: int, strided: bool = False) -> list[list[int]]:
    """Each DP replica's TP group of global ranks, PP 1 (megatron-core's order: consecutive ranks; `strided`:
    every DP-th rank, megahet/policy/mesh.py)."""
    dp = ranks // tp
    return [[rank_of(d, 0, t, tp, dp, strided) for t in range(tp)] for d in range(dp)]


def predict_step_s(
    m: Measured, tp: int, balanced: bool = True, strided: bool = False
) -> tuple[float, tuple[int, ...]]:
    """(predicted step, micro-batches per replica) of TP x DP (DP = ranks / TP, its TP groups `tp_groups`:
    consecutive ranks, or `strided`). A replica's TP group runs at its speeds' sum when a TP balancer evens
    it out (`balanced`), else at TP x its slowest; each micro-batch waits in each of its collectives the
    calm wait plus the latest rank's delay; the replicas get measured DP shares (whole micro-batches by
    speed: megahet/policy/dp_shares.py), then all meet in the step's own collectives and the optimizer."""
    ranks = len(m.speeds)
    if tp < 1 or ranks % tp:
        raise ValueError(f"TP {tp} does not divide {ranks} ranks")
    dp = ranks // tp
    per_mb, per_step = step_collectives(tp, dp, m.layers)
    groups = tp_groups(ranks, tp, strided)
    mb_work = m.work_s / m.micro_batches
    mb_s = []
    for g in groups:
        speed = sum(m.speeds[r] for r in g) if balanced else tp * min(m.speeds[r] for r in g)
        mb_s.append(mb_work / speed + per_mb * (m.calm_wait_s + max(m.delays_s[r] for r in g)))
    if dp == 1:
        shares = (m.micro_batches,)
    elif len(set(mb_s)) == 1:
        shares = tuple(even_shares(m.micro_batches, dp))
    else:
        shares = tuple(dp_shares([min(mb_s) / t for t in mb_s], m.micro_batches, healthy_gap=0.0))
    compute = max(n * t for n, t in zip(shares, mb_s))
    return compute + per_step * (m.calm_wait_s + max(m.delays_s)) + m.optimizer_s, shares


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    tp: int
    dp: int
    step_s: float
    shares: tuple[int, ...]
    strided: bool = False
    """The TP groups strided over the ranks (the placement that puts late ranks in one group)."""

    def describe(self) -> str:
        shares = f" (shares {'/'.join(map(str, self.shares))})" if self.dp > 1 else ""
        if not self.strided:
            return f"TP {self.tp} x DP {self.dp}{shares}"
        groups = " | ".join(",".join(map(str, g)) for g in tp_groups(self.tp * self.dp, self.tp, True))
        return f"TP {self.tp} x DP {self.dp}{shares}, TP groups {groups}"


def layout_choices(
    m: Measured, tps: Sequence[int], balanced: bool = True, placed: bool = True
) -> list[LayoutChoice]:
    """Every TP of `tps` (each dividing the ranks) with its predicted step, fastest first (ties: the larger
    TP, then consecutive TP groups); with TP and DP both > 1 and `placed`, each placement of the TP groups
    (consecutive and strided ranks)."""
    ranks, out = len(m.speeds), []
    for tp in tps:
        for strided in (False, True) if placed and 1 < tp < ranks else (False,):
            step_s, shares = predict_step_s(m, tp, balanced, strided)
            out.append(LayoutChoice(tp, ranks // tp, step_s, shares, strided))
    return sorted(out, key=lambda c: (c.step_s, -c.tp, c.strided))


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
    """A rank's memory on any TP x DP layout (PP 1, ZeRO-1), from what the current layout holds: the
    parameters of the live model (TP-split or whole on every TP rank) with their weights, gradients and
    ZeRO-1 optimizer state (`STATE_BYTES`, the layout planner's), plus the activations measured here scaled
    by TP here / TP there (an upper bound on a smaller TP: each of its ranks held at least its share)."""

    split_params: int
    """Parameters TP splits, all TP ranks' together (those megatron-core marks `tensor_model_parallel`)."""
    replicated_params: int
    """Parameters every TP rank holds whole (norms, row-parallel biases, learned positions)."""
    precision: str
    tp: int
    """The TP the activations were measured at."""
    activations: int = 0
    """The busiest rank's memory here beyond its modeled state (CUDA: the allocator's peak; 0 unmeasured)."""

    def state_bytes(self, tp: int, dp: int) -> int:
        """Weights, gradients and optimizer state of a rank of TP x DP (ZeRO-1 splits the optimizer over DP)."""
        weights, grads, optimizer = STATE_BYTES[self.precision]
        params = self.split_params // tp + self.replicated_params
        return params * (weights + grads) + params * optimizer // dp

    def bytes(self, tp: int, dp: int) -> int:
        return self.state_bytes(tp, dp) + self.activations * self.tp // tp


def left_out_by_memory(
    memory: LayoutMemory, tps: Sequence[int], world: int, cap_bytes: float, home_tp: int
) -> dict[int, str]:
    """{TP: why} for the TP x DP layouts of `world` ranks predicted above `cap_bytes` a rank (the run's own,
    `home_tp`, always fits: it ran)."""
    out = {}
    for tp in tps:
        need = memory.bytes(tp, world // tp)
        if tp != home_tp and need > cap_bytes:
            out[tp] = (
                f"TP {tp} x DP {world // tp} needs {need / 2**30:.3g} GiB a rank, over the "
                f"{cap_bytes / 2**30:.3g} GiB allowed"
            )
    return out


def rank_speeds(
    tp: int,
    dp: int,
    replicas: Sequence[float] | None,
    groups: Sequence[Sequence[float] | None] | None,
    strided: bool = False,
) -> tuple[float, ...] | None:
    """Every global rank's speed (PP 1, TP groups `tp_groups`; the fastest = 1) from what the balancers
    measured: each replica's speed (the DP balancer's, else all alike) split over its TP ranks by their
    speeds within the group (the TP balancer's, else alike). None when neither balancer has measured anything."""
    if replicas is None and (groups is None or all(g is None for g in groups)):
        return None
    replicas = list(replicas) if replicas is not None else [1.0] * dp
    speeds = [0.0] * (tp * dp)
    for d, ranks in enumerate(tp_groups(tp * dp, tp, strided)):
        group = groups[d] if groups is not None and groups[d] is not None else [1.0] * tp
        for r, s in zip(ranks, group):
            speeds[r] = replicas[d] * s / sum(group)
    fastest = max(speeds)
    return tuple(s / fastest for s in speeds)
