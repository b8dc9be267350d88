"""The escalation in the training loop: measure the per-collective cost of a straggler, predict the other
TP x DP layouts, decide with the escalation ladder, ask for the move (issue 46).

Role: runtime (the step hook of `escalate.mode=on`; the ladder and the prediction are pure,
megahet/policy/escalation.py; the move is megahet/runtime/relayout.py).

After every step each rank contributes its own compute in the forward and backward, the median of its
waits per collective, its collectives and its optimizer step (megahet/runtime/timing.py), and the step's
time, gathered over the world by an asynchronous all-gather that completes while the step finishes. At the
start of the next step every rank folds the same rows in, so every rank decides the same:

- a rank's delay per collective: its TP group's other ranks' median wait less its own (at TP 1 the other
  replicas'), never below 0; a time-sliced rank arrives late to each collective and its peers wait;
- its compute: its own time in the forward and backward less its collectives times its delay (a late
  rank's lateness is time it did not run), and no less than the quickest rank's;
- the calm wait: the smallest rank's median wait (the last to arrive waits only for the transfer);
- the speeds: the balancers' measured ones (`rank_speeds`: the DP balancer's per replica, the TP balancer's
  within a group), else each rank's compute against the others' (equal work);
- the medians over `escalate.window` steps (a process's first step, a warm-up, is left out).

With them `layout_choices` predicts every TP x DP layout of the world (and, with `escalate.placement`, each
placement of its TP groups), those a rank's memory would not fit are left out (`escalate.memory_gib`, by
default the smallest GPU's less plan.memory_reserve: the live model's state on each layout, plus on CUDA the
activations the allocator's peak shows here, scaled by TP), and `EscalationLadder` decides: a
straggler (slower than `balance.healthy_gap`, or later than `escalate.delay_floor_ms` to each collective)
flagged at least `escalate.patience` steps in a row, the best other layout's predicted saving over
`escalate.horizon` steps above the move's cost (the last move's, measured; before one, a rehearsal's price:
megahet/runtime/move_price.py),
and the time lost by staying this episode at least that cost (break-even): move. On the moved-to layout,
the straggler gone as long and the way back paying and breaking even the same way: return.
Every decision is logged (metrics `escalate_inside_s`, `escalate_other_s`, `escalate_predicted_s`,
`escalate_delay_ms`, `escalate_collectives`: a rank's collectives per step), and printed whenever it or its reason changes:

    escalation step 9: move (the straggler persists; gain over the horizon 41.3 s, move 1.9 s): TP 2 x DP 1
    0.612 s a step (predicted 0.598), TP 1 x DP 2 (shares 2/2) predicted 0.201, delay 3.02 ms, speeds 1.00 0.98

The ladder's state (on which layout, the streaks), the last move's cost and the layouts left out (printed
once) cross the move (`layout_free`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megahet.config import ConfigError, MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.platform import cuda_available, device
from megahet.policy.detector import MedianWindow
from megahet.policy.escalation import (
    Decision,
    EscalationLadder,
    LayoutChoice,
    LayoutMemory,
    Measured,
    Observation,
    layout_choices,
    left_out_by_memory,
    tp_groups,
)
from megahet.runtime.hooks import MeasuringHook, StepContext


class EscalationController(MeasuringHook):
    layout_free = True  # the ladder's state and the last move's cost cross the move

    def __init__(
        self,
        cfg: MegahetConfig,
        layout: ParallelLayout,
        ctx: StepContext,
        tps: tuple[int, ...],
        home_tp: int,
        speeds: Callable[[], tuple[float, ...] | None],
        log: Callable[[str], None],
        memory: LayoutMemory,
        cap_bytes: float,
        price_move: Callable[[LayoutChoice], float],
    ):
        e = cfg.escalate
        self.cfg, self.layout, self.ctx, self.tps, self.home_tp = e, layout, ctx, tps, home_tp
        self.speeds, self.log, self.price_move = speeds, log, price_move
        self.memory, self.cap_bytes = memory, cap_bytes
        self.peak = 0  # the busiest rank's allocator peak on this layout (CUDA; 0 on CPU)
        self.left_out: dict[int, str] = {}
        if cuda_available():  # the peak of this layout's steps (not the start's, nor the move's)
            torch.cuda.reset_peak_memory_stats()
        self.balanced = cfg.balance.plans
        self.healthy_gap = cfg.balance.healthy_gap
        self.train_iters = cfg.train.train_iters
        self.micro_batches = cfg.train.global_batch_size // cfg.train.micro_batch_size
        self.layers = cfg.model.num_layers
        self.ladder = EscalationLadder(e.patience, e.horizon, e.min_gain)
        n = layout.world_size
        windows = (MedianWindow(n, e.window) for _ in range(5))
        self.compute, self.waits, self.delays, self.optimizer, self.collectives = windows
        self.steps = collections.deque(maxlen=e.window)
        self.move_s: float | None = None
        """The last move's measured cost (None before one: `price_move` predicts it, megahet/runtime/move_price.py)."""
        self.warm = self.closing = False
        self.printed: tuple[str, str] | None = None
        self.last: dict[str, float] = {}
        self._check_memory()

    def after_step(self, engine) -> None:
        t = self.ctx.times
        step_s = time.perf_counter() - self.ctx.step_t0
        peak = float(torch.cuda.max_memory_allocated()) if cuda_available() else 0.0
        mine = [t.compute_s, t.median_wait_s, float(t.collectives), t.optimizer_s, step_s, peak]
        self._gather(torch.tensor(mine, dtype=torch.float64))

    def before_forward_backward(self, step: int) -> None:
        self._collect()
        self.step = step

    def _collect(self) -> None:
        taken = self._take()
        if taken is None:
            return
        rows, step, _ = taken
        if not self.warm:  # a process's first step (allocations, first collectives) is not a sample
            self.warm = True
            return
        compute, waits, count, optimizer, step_s, peak = ([r[i] for r in rows] for i in range(6))
        self.peak = int(max(peak))
        self.compute.update(compute)
        self.waits.update(waits)
        self.delays.update(self._delays(waits))
        self.optimizer.update(optimizer)
        self.steps.append(max(step_s))
        self.collectives.update(count)
        if len(self.steps) == self.steps.maxlen and not self.closing:
            self._decide(step)

    def close(self, final: bool = True) -> None:
        self.closing = True  # the last step is folded in, not decided on
        super().close(final)

    def _delays(self, waits: list[float]) -> list[float]:
        """Each rank's delay per collective this step: its peers' mean wait less its own, >= 0."""
        tp, n = self.layout.tp_size, len(waits)
        group_of = {r: g for g in tp_groups(n, tp, self.layout.strided) for r in g}
        out = []
        for r in range(n):
            group = group_of[r] if tp > 1 else range(n)
            peers = [waits[p] for p in group if p != r]
            out.append(max(statistics.fmean(peers) - waits[r], 0.0))
        return out

    def measured(self) -> Measured:
        delays = self.delays.medians()
        # A late rank's lateness is in its own time (it was not running): its compute is the rest, and no
        # less than the quickest rank's (a straggler is not faster; the delay's measure is not exact).
        raw = self.compute.medians()
        compute = [max(c - n * d, min(raw)) for c, n, d in zip(raw, self.collectives.medians(), delays)]
        speeds = self.speeds()
        if speeds is None:  # no balancer: equal work on every rank, a slower rank computes longer
            speeds = tuple(min(compute) / c if c > 0 else 1.0 for c in compute)
        return Measured(
            speeds=tuple(speeds), compute_s=tuple(compute), delays_s=tuple(delays),
            calm_wait_s=min(self.waits.medians()), optimizer_s=max(self.optimizer.medians()),
            micro_batches=self.micro_batches, layers=self.layers,
        )  # fmt: skip

    def _check_memory(self) -> None:
        """At start, a one-line ConfigError when no other layout's weights, gradients and optimizer state
        fit (the activations are measured later; every rank computes the same, with the same cap)."""
        if self.layout.tp_size != self.home_tp:  # a moved-to layout: checked at the start
            return
        state = dataclasses.replace(self.memory, activations=0)
        world = self.layout.world_size
        left_out = left_out_by_memory(state, self.tps, world, self.cap_bytes, self.home_tp)
        sizes = ", ".join(
            f"TP {t} x DP {world // t} {state.bytes(t, world // t) / 2**30:.3g}" for t in self.tps
        )
        allowed = f"{self.cap_bytes / 2**30:.3g} GiB allowed" if math.isfinite(self.cap_bytes) else "no limit"
        self.log(f"escalation: a rank's weights, gradients and optimizer state (GiB): {sizes}; {allowed}")
        if len(left_out) == len(self.tps) - 1:
            closest = min(left_out, key=lambda t: state.bytes(t, world // t))
            raise ConfigError(
                f"escalate.mode=on: no other TP x DP layout fits ({left_out[closest]}; weights, "
                "gradients and optimizer state): raise escalate.memory_gib or set escalate.mode=off"
            )

    def _fitting(self, choices: list) -> list:
        """The choices that fit the memory cap with the activations measured here (the busiest rank's peak
        beyond its state); prints what is left out whenever that changes."""
        here = self.memory.state_bytes(self.layout.tp_size, self.layout.dp_size)
        memory = dataclasses.replace(self.memory, activations=max(self.peak - here, 0))
        left_out = left_out_by_memory(memory, self.tps, self.layout.world_size, self.cap_bytes, self.home_tp)
        if left_out != self.left_out:
            self.left_out = left_out
            for why in left_out.values():
                self.log(f"escalation: {why} (escalate.memory_gib): left out")
        return [c for c in choices if c.tp not in left_out]

    def _decide(self, step: int) -> None:
        m = self.measured()
        choices = self._fitting(layout_choices(m, self.tps, self.balanced, self.cfg.placement))
        here = next(c for c in choices if (c.tp, c.strided) == (self.layout.tp_size, self.layout.strided))
        wanted = (self.home_tp, False) if self.ladder.moved else None  # the way back: the run's own layout
        other = next(
            (c for c in choices if c.tp != here.tp and (wanted is None or (c.tp, c.strided) == wanted)), None
        )
        if other is None:  # every other layout is left out (printed)
            return
        inside = statistics.median(self.steps)
        move_s = self.move_s if self.move_s is not None else self.price_move(other)
        obs = Observation(
            step=step + 1, straggler=m.straggler(self.healthy_gap, self.cfg.delay_floor_ms / 1e3),
            inside_s=inside, other_s=other.step_s, move_s=move_s, steps_left=self.train_iters - step - 1,
        )  # fmt: skip
        decision = self.ladder.decide(obs)
        self.last = {
            "escalate_inside_s": inside,
            "escalate_predicted_s": here.step_s,
            "escalate_other_s": other.step_s,
            "escalate_delay_ms": max(m.delays_s) * 1e3,
            "escalate_collectives": max(self.collectives.medians()),
        }
        if (decision.action, decision.reason) != self.printed or decision.action != "stay":
            self.printed = (decision.action, decision.reason)
            self.log(_line(decision, here, other, inside, m))
        if decision.action != "stay":  # from the predicted shares (the DP balancer goes on)
            self.ctx.request_layout(other.tp, other.shares, other.strided)

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def relayout_done(self, cost) -> None:
        self.move_s = cost.total_s

    def state_dict(self) -> dict:
        ladder = self.ladder
        return {
            "moved": ladder.moved, "flagged": ladder.flagged, "calm": ladder.calm, "lost_s": ladder.lost_s,
            "move_s": self.move_s, "left_out": dict(self.left_out),
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        ladder = self.ladder
        ladder.moved, ladder.flagged, ladder.calm = state["moved"], state["flagged"], state["calm"]
        ladder.lost_s = state["lost_s"]
        self.move_s = state["move_s"]
        self.left_out = dict(state.get("left_out", {}))  # printed once: a move does not print it again


def layout_memory(model: torch.nn.Module, tp: int, precision: str) -> LayoutMemory:
    """The live model's parameters, TP-split (megatron-core's `tensor_model_parallel`) or whole, for
    `LayoutMemory` (its activations are measured later)."""
    split = replicated = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            split += p.numel() * tp
        else:
            replicated += p.numel()
    return LayoutMemory(split, replicated, precision, tp)


def memory_cap_bytes(cfg: MegahetConfig) -> float:
    """What a rank may hold on a moved-to layout: escalate.memory_gib, else the smallest GPU's memory less
    plan.memory_reserve (an all-reduce over the world, so every rank leaves the same layouts out), else no
    limit (CPU)."""
    if cfg.escalate.memory_gib > 0:
        return cfg.escalate.memory_gib * 2**30
    if not cuda_available():
        return math.inf
    total = torch.cuda.get_device_properties(device()).total_memory
    smallest = torch.tensor([float(total)], dtype=torch.float64, device=device())
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return smallest.item() * (1.0 - cfg.plan.memory_reserve)


def _line(decision: Decision, here, other, inside: float, m: Measured) -> str:
    speeds = " ".join(f"{s:.2f}" for s in m.speeds)
    return (
        f"{decision.line()}: {here.describe()} {inside:.3f} s a step (predicted {here.step_s:.3f}), "
        f"{other.describe()} predicted {other.step_s:.3f}, delay {max(m.delays_s) * 1e3:.2f} ms, speeds {speeds}"
    )
