"""The pipeline balancer in the training loop: measure every stage's time per layer, ask for a re-split.

Role: runtime (the step hook of heterogeneous pipeline stages: measure, estimate, plan with the pure
`megahet.policy.stage_split`; the Trainer stops after the step and `megahet.runtime.resplit` moves the
layers with their optimizer state).

After every step each rank contributes three numbers — the micro-batches it ran, the time of its own
compute inside the transformer layers (`layers_s`, megahet/runtime/timing.py: TP collectives and the
waits for slower TP peers excluded, pipeline sends and receives outside) and its own compute over the
whole forward/backward (`compute_s`) — gathered over the world by an asynchronous all-gather that
completes while the step finishes. A rank's samples are its seconds per layer and micro-batch,
layers_s / (its stage's layers x micro-batches), and its other compute per micro-batch (embedding,
output layer, loss), (compute_s - layers_s) / micro-batches, plus, with `balance.whole_step`,
its own time in the optimizer step spread over the step's micro-batches; each estimate is the median of the last
`hetero.window` samples. A stage is as slow as its slowest rank (`measured_stage_times`; with context
parallelism a position is as slow as its slowest CP rank).

With `hetero.pp_split=measured`, every `hetero.interval` steps every rank runs the same `next_split` on
the same numbers: the split minimizing the slowest stage's modeled time, kept unless it cuts that time by
more than `hetero.hysteresis`. A new split asked for `hetero.pp_patience` decisions in a row is handed to
`ctx.request_split` (the Trainer ends the step, then re-splits). Declared splits are measured and reported, never
re-planned. Virtual devices (`--device.profile` per global rank) slow the layers' compute and are
measured through the same path: the balancer never reads their profile.

    pp = PipelineBalancer(cfg, layout, split, trainer, coords)   # trainer: the StepContext

Telemetry (`report()`): per stage its measured speed per layer (`speed_ppS`, the fastest = 1) and its
layers (`layers_ppS`); `metrics()`: re-splits so far (`pp_resplits`). With `--balance.trace run.jsonl`
global rank 0 writes one row per step to run_pp.jsonl and draws run_pp.png at the end.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.policy.dp_shares import RankCoords
from megahet.policy.stage_split import (
    format_split,
    layers_moved,
    measured_stage_times,
    next_split,
    predicted_resplit_cost,
    resplit_gain_s,
    resplit_pays,
)
from megahet.runtime.hooks import MeasuringHook, StepContext
from megahet.runtime.trace_writer import TraceWriter, trace_path


class PipelineBalancer(MeasuringHook):
    def __init__(
        self,
        cfg: MegahetConfig,
        layout: ParallelLayout,
        split: Sequence[int],
        ctx: StepContext,
        coords: Sequence[RankCoords],
        resplits: int = 0,
        say: Callable[[str], None] = print,
    ):
        self.cfg, self.layout, self.ctx, self.say = cfg.hetero, layout, ctx, say
        self.train_iters = cfg.train.train_iters
        self.split = tuple(split)
        """The layers per stage the model runs (this balancer's measurements are in its units)."""
        self.coords = list(coords)
        self.measured = cfg.hetero.pp_split == "measured"
        self.whole_step = cfg.balance.whole_step
        window = cfg.hetero.window
        self.layer_samples = [collections.deque(maxlen=window) for _ in self.coords]
        self.extra_samples = [collections.deque(maxlen=window) for _ in self.coords]
        self.resplits = resplits
        """Re-splits of this run so far (the runtime counts the one this balancer asks for)."""
        self.proposal: tuple[int, ...] | None = None
        self.streak = 0
        """Decisions in a row that asked for `proposal`."""
        self.requested: tuple[int, ...] | None = None
        self.last_cost = None
        """The last re-split's measured cost (megahet/runtime/resplit.py ResplitCost), None before one."""
        self.refused: tuple[int, ...] | None = None
        """The last split refused because it would not pay (its refusal is printed once)."""
        self.decision: dict[str, float] = {}
        self.trace = (
            TraceWriter(trace_path(cfg.balance.trace, "pp"))
            if cfg.balance.trace and layout.rank == 0
            else None
        )

    def before_forward_backward(self, step: int) -> None:
        """Fold the last step's measurements in and plan if due."""
        self._collect()
        self.step = step

    def after_step(self, engine) -> None:
        t = self.ctx.times
        optimizer_s = t.optimizer_s if self.whole_step else 0.0
        mine = torch.tensor(
            [self.ctx.num_microbatches, t.layers_s, t.compute_s, optimizer_s], dtype=torch.float64
        )
        self._gather(mine)

    @property
    def ready(self) -> bool:
        return all(self.layer_samples)

    def stage_times(self, healthy_gap: float = 0.0) -> tuple[list[float], list[float]] | None:
        """(seconds per layer and micro-batch, other seconds per micro-batch) of every stage, from the
        medians of its ranks' samples (None before every rank has one)."""
        if not self.ready:
            return None
        per_rank: dict[RankCoords, tuple[float, float]] = {}
        for coords, layer, extra in zip(self.coords, self.layer_samples, self.extra_samples):
            # a position's CP ranks share its coordinates: it runs at the slower (they wait for each other's
            # keys and values in every layer)
            mine = (statistics.median(layer), statistics.median(extra))
            other = per_rank.get(coords, mine)
            per_rank[coords] = (max(mine[0], other[0]), max(mine[1], other[1]))
        return measured_stage_times(per_rank, len(self.split), healthy_gap)

    def stage_speeds(self) -> list[float] | None:
        """Each stage's measured speed per layer, the fastest = 1 (None before the first samples)."""
        times = self.stage_times()
        if times is None:
            return None
        fastest = min(times[0])
        return [fastest / a for a in times[0]]

    def _collect(self) -> None:
        gathered = self._take()
        if gathered is None:
            return
        rows, step, step_s = gathered
        for (_dp, stage, _tp), row, layer, extra in zip(
            self.coords, rows, self.layer_samples, self.extra_samples
        ):
            micro, layers_s, compute_s, optimizer_s = row
            if micro > 0 and layers_s > 0:  # a layer-less evaluation-only step measures nothing
                layer.append(layers_s / (self.split[stage] * micro))
                extra.append((max(compute_s - layers_s, 0.0) + optimizer_s) / micro)
        if self.measured and self.requested is None and (step + 1) % self.cfg.interval == 0 and self.ready:
            self._plan(step)
        if self.trace is not None:
            times = self.stage_times()
            self.trace.write(
                {
                    "step": step,
                    "step_s": step_s,
                    "split": list(self.split),
                    "stage_speed": self.stage_speeds(),
                    "layer_s": times[0] if times else None,
                    "extra_s": times[1] if times else None,
                    "proposal": list(self.proposal) if self.proposal else None,
                }
            )

    def _plan(self, step: int) -> None:
        layer_s, extra_s = self.stage_times(self.cfg.healthy_gap)
        proposal = next_split(self.split, layer_s, extra_s, self.cfg.hysteresis)
        if proposal == self.split:
            self.proposal, self.streak = None, 0
            return
        self.streak = self.streak + 1 if proposal == self.proposal else 1
        self.proposal = proposal
        if self.streak >= self.cfg.pp_patience and self._pays(proposal, layer_s, extra_s, step):
            self.requested = proposal
            self.ctx.request_split(proposal)

    def _pays(self, proposal: tuple[int, ...], layer_s, extra_s, step: int) -> bool:
        """Whether re-splitting to `proposal` saves more over the horizon (or the steps left) than it
        costs; printed when it re-splits, and once per split it refuses. Every input is the same on
        every rank (gathered times, shares, the cost's max over ranks), so every rank decides alike."""
        microbatches = max(self.ctx.shares)  # the busiest replica's (the same number on every rank)
        gain = resplit_gain_s(self.split, proposal, layer_s, extra_s, microbatches)
        steps = min(self.cfg.resplit_horizon, self.train_iters - step - 1)
        layers = layers_moved(self.split, proposal)
        last = self.last_cost
        if last is not None:
            per_layer = last.transfer_s / max(last.layers_moved, 1)
            cost = predicted_resplit_cost(last.plan_s + last.build_s, per_layer, layers)
            source = "measured by the last re-split"
        else:
            cost = predicted_resplit_cost(self.ctx.build_s, 0.0, layers)
            source = "the stages' build time at start"
        pays = resplit_pays(gain, steps, cost)
        self.decision = {"resplit_gain_s": gain, "resplit_cost_s": cost}
        if pays or proposal != self.refused:
            verdict = "re-splitting" if pays else f"keeping {format_split(self.split)}"
            self.say(
                f"megahet: pipeline re-split {format_split(self.split)} -> {format_split(proposal)} saves "
                f"{gain:.3f} s a step (modeled) x {steps} steps = {gain * steps:.2f} s, "
                f"{'more' if pays else 'no more'} than its cost {cost:.2f} s ({source}): {verdict}"
            )
        self.refused = None if pays else proposal
        return pays

    def resplit_done(self, cost) -> None:
        self.last_cost = cost

    def metrics(self) -> dict[str, float]:
        self._collect()
        return {"pp_resplits": float(self.resplits), **self.decision}

    def report(self) -> dict[str, float]:
        """Per stage: measured speed per layer (once measured) and layers (the same on every rank)."""
        self._collect()
        out = {f"speed_pp{s}": v for s, v in enumerate(self.stage_speeds() or ())}
        out.update({f"layers_pp{s}": float(n) for s, n in enumerate(self.split)})
        return out

    def _plot(self, written: Path) -> None:
        from megahet.runtime.trace_plot import plot_pp_trace  # lazy: matplotlib, only when a trace is drawn

        plot_pp_trace(written, written.with_suffix(".png"))
