"""The data-parallel balancer in the training loop: measure every replica's speed, re-plan the shares.

Role: runtime (the step hook of heterogeneous data parallelism: measure, estimate, plan with the pure
`megahet.policy.dp_shares`, hand the shares to the Trainer, which executes them).

After every step each rank contributes two numbers — the micro-batches it ran and the time of its
forward/backward compute regions (megahet/runtime/timing.py: its own compute plus the TP collectives
inside them, which every micro-batch pays too, and the waits for slower TP peers, which are its
replica's pace; pipeline sends and receives and the data-parallel reduction fall outside) — gathered
over the whole world by an asynchronous all-gather that completes while the step finishes. The
embedding, output layer and loss move with the samples, so they count. Each rank's time is modelled as
fixed plus per micro-batch, t = c (phi + n / E) with E = M / D the even share (the affine model of the TP
balancer, `megahet.policy.detector.AffineSpeedEstimator`, issue 47): a step also pays per-step work that
does not shrink with its micro-batches (launches, the first micro-batch's warm caches, a host that
outruns a virtual device's charge), and divided by fewer micro-batches that work made a replica that gave
micro-batches away look slower the more it gave (two speed-1 replicas read 0.83-0.93 at shares 5 : 11 on a
busy host, and the shares took 11 steps to return to even). phi is fitted from the (share, time) pairs
of successive share changes, c is the median over the last `hetero.window` samples. With packed
documents the work is the predicted cost at speed 1, which changes every step, so the model is the
proportional one, and the speeds go to the per-step document planner instead of shares. The first step
of a process (allocations, lazy initialization, first collectives) is not a sample, and the first
decision waits for a full window, so that one outlier never moves the shares (a median of two samples
is their mean). With
`balance.whole_step` each rank also sends its own time in
the optimizer step (megahet/runtime/timing.py), which does not move with the micro-batches: a replica's
optimizer time is its slowest rank's (median over the window). A replica's per micro-batch time and fixed
time are its slowest rank's, and the shares minimize the slowest whole step, micro-batches plus fixed
work (`dp_shares(..., fixed=)`). A replica
runs at its slowest pipeline stage, a stage at its slowest TP rank (a TP balancer inside the replica
raises that measured rate; the shares follow). At the start of a step every rank runs the same `dp_shares` on the same
numbers, so every rank's shares are the same, with hysteresis, and back to even when the replicas are
alike. Virtual devices (`--device.profile` over the whole mesh) are measured through the same path:
the balancer never reads their profile.

    dp = DataParallelBalancer(cfg, layout, trainer, coords)   # trainer: the StepContext

Telemetry (`report()`): per replica its estimated speed (`speed_dpR`, the fastest = 1) and its share of
the global batch in micro-batches (`share_dpR`). With `--balance.trace run.jsonl` global rank 0 writes
one row per step to run_dp.jsonl and draws run_dp.png at the end. Checkpoints carry the shares and the
speed samples, so a resumed run goes on with the same split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.policy.detector import AffineSpeedEstimator, MedianWindow
from megahet.policy.dp_shares import RankCoords, dp_shares
from megahet.runtime.hooks import MeasuringHook, StepContext
from megahet.runtime.trace_writer import TraceWriter, trace_path


class DataParallelBalancer(MeasuringHook):
    checkpointed = True
    split_free = True  # shares and replica speeds: a re-split keeps them

    def __init__(
        self,
        cfg: MegahetConfig,
        layout: ParallelLayout,
        ctx: StepContext,
        coords: Sequence[RankCoords],
        *,
        packed: bool = False,
    ):
        self.cfg, self.layout, self.ctx = cfg.hetero, layout, ctx
        self.coords = list(coords)
        self.shares = tuple(ctx.shares)
        """The shares the Trainer executes (`ctx.set_shares` hands it new ones)."""
        self.num_microbatches = sum(self.shares)
        self.measured = cfg.hetero.dp_shares == "measured"
        self.packed = packed
        """Packed documents: a replica's work is its predicted cost (`ctx.replica_work`), and the speeds
        go to the per-step planner (`ctx.set_replica_speeds`) instead of whole-micro-batch shares."""
        self.estimator = AffineSpeedEstimator(layout.world_size, cfg.hetero.window, affine=not packed)
        """Every rank's region time as fixed + per unit, a unit being the even share E = M / D
        micro-batches (packed: one unit of predicted cost, proportional)."""
        self.unit = 1.0 if packed else self.num_microbatches / layout.dp_size
        self.fixed = MedianWindow(layout.world_size, cfg.hetero.window)
        """Every rank's own seconds in the optimizer step (the work its micro-batches do not move)."""
        self.whole_step = cfg.balance.whole_step
        self.warm = False
        """Whether this process has measured a step (its first is a warm-up, not a sample)."""
        self.speeds_applied: tuple[float, ...] | None = None
        self.changes = 0
        self._due = False
        self.trace = (
            TraceWriter(trace_path(cfg.balance.trace, "dp"))
            if cfg.balance.trace and layout.rank == 0
            else None
        )

    def before_forward_backward(self, step: int) -> None:
        """Fold the last step's measurements in and re-plan the shares if due (before the step's data is
        read, so new shares apply from this step's first micro-batch)."""
        self._collect()
        if self._due:
            self._due = False
            self._plan()
        self.step = step

    def after_step(self, engine) -> None:
        t = self.ctx.times
        region_s = t.compute_s + t.wait_s  # the replica's time per micro-batch, TP collectives included
        mine = torch.tensor([self.ctx.replica_work(), region_s, t.optimizer_s], dtype=torch.float64)
        self._gather(mine)

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """The shares the Trainer executes from now on: the run plan's starting shares, this balancer's
        own decisions, or, with packed documents, the step's micro-batches per replica as planned."""
        self.shares = tuple(shares)

    def _collect(self) -> None:
        gathered = self._take()
        if gathered is None:
            return
        rows, step, step_s = gathered
        work, region, optimizer = ([r[i] for r in rows] for i in range(3))
        if self.warm:
            self.estimator.update([w / self.unit for w in work], region)
            self.fixed.update(optimizer)
        self.warm = True
        if self.trace is not None:
            self.trace.write(
                {
                    "step": step,
                    "step_s": step_s,
                    "shares": list(self.shares),
                    "replica_speed": self.replica_speeds(),
                    "region_s": region,
                    "optimizer_s": optimizer,
                }
            )
        full = self.estimator.ready and self.estimator.samples() >= self.cfg.window
        self._due = self.measured and (step + 1) % self.cfg.interval == 0 and full

    def _slowest(self, per_rank: list[float]) -> list[float]:
        """Per replica, the largest of its ranks' values."""
        slowest: dict[int, float] = {}
        for (dp, _pp, _tp), value in zip(self.coords, per_rank):
            slowest[dp] = max(slowest.get(dp, 0.0), value)
        return [slowest[dp] for dp in range(len(slowest))]

    def replica_model(self) -> tuple[list[float], list[float]]:
        """Per replica, (its slowest rank's seconds per unit of work, its slowest rank's fixed seconds in
        the region), from the affine fit (a unit: one micro-batch; packed: one unit of predicted cost)."""
        per_unit, phis = self.estimator.fit()
        per_work = self._slowest([c / self.unit for c in per_unit])
        return per_work, self._slowest([c * phi for c, phi in zip(per_unit, phis)])

    def replica_speeds(self) -> list[float] | None:
        """Each replica's estimated speed at the even share, fixed time included, the fastest = 1 (None
        before the first samples); packed: per unit of predicted cost."""
        if not self.estimator.ready:
            return None
        per_work, fixed = self.replica_model()
        even = [m * self.unit + f for m, f in zip(per_work, fixed)]
        return [min(even) / t for t in even]

    def _shares_inputs(self) -> tuple[list[float], list[float]]:
        """`dp_shares`' speeds (per micro-batch, the fastest = 1) and fixed work (in micro-batches at the
        fastest's speed): the region's fixed time, and with `balance.whole_step` the slowest rank's
        optimizer step."""
        per_micro, fixed_s = self.replica_model()
        quickest = min(per_micro)
        if self.whole_step and self.fixed.ready:
            fixed_s = [f + o for f, o in zip(fixed_s, self._slowest(self.fixed.medians()))]
        return [quickest / m for m in per_micro], [f / quickest for f in fixed_s]

    def _plan(self) -> None:
        if self.packed:
            speeds = tuple(self.replica_speeds())
            if all(s >= 1 - self.cfg.healthy_gap for s in speeds):
                speeds = (1.0,) * len(speeds)  # alike within the noise: plan them as equals
            if speeds != self.speeds_applied:
                self.speeds_applied = speeds
                self.changes += 1
                self.ctx.set_replica_speeds(speeds)
            return
        speeds, fixed = self._shares_inputs()
        new = dp_shares(
            speeds,
            self.num_microbatches,
            current=self.shares,
            hysteresis=self.cfg.hysteresis,
            healthy_gap=self.cfg.healthy_gap,
            fixed=fixed,
        )
        if new != self.shares:
            self.shares = new
            self.changes += 1
            self.ctx.set_shares(new)

    def metrics(self) -> dict[str, float]:
        self._collect()
        return {"dp_share_changes": float(self.changes)}

    def report(self) -> dict[str, float]:
        """Per replica: estimated speed (once measured) and micro-batches of the global batch (the same on
        every rank)."""
        self._collect()
        out = {f"speed_dp{r}": s for r, s in enumerate(self.replica_speeds() or ())}
        out.update({f"share_dp{r}": float(n) for r, n in enumerate(self.shares)})
        return out

    def state_dict(self) -> dict:
        self._collect()
        return {
            "step": self.step,
            "shares": list(self.shares),
            "samples": self.estimator.state_dict(),
            "fixed_samples": [list(s) for s in self.fixed.samples],
            "changes": self.changes,
            "due": self._due,
            "speeds_applied": list(self.speeds_applied) if self.speeds_applied is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the shares (the Trainer executes them from the next step) and the speed samples."""
        fixed = state.get("fixed_samples") or [[] for _ in self.fixed.samples]  # older checkpoints
        for samples, values in zip(self.fixed.samples, fixed):
            samples.clear()
            samples.extend(values)
        saved = state["samples"]
        if saved and isinstance(saved[0], list):  # before the affine model: work / time, work per micro-batch
            saved = [[s / self.unit for s in speeds] for speeds in saved]
        self.estimator.load_state_dict(saved)
        self.warm = False  # this process's first step is a warm-up again
        self.shares = tuple(state["shares"])
        if not self.packed:
            self.ctx.set_shares(self.shares)
        elif state.get("speeds_applied") is not None:
            self.speeds_applied = tuple(state["speeds_applied"])
            self.ctx.set_replica_speeds(self.speeds_applied)
        self.changes, self._due, self.step = state["changes"], state["due"], state["step"]
        if self.trace is not None:
            self.trace.resume_from = self.step + 1

    def _plot(self, written: Path) -> None:
        from megahet.runtime.trace_plot import plot_dp_trace  # lazy: matplotlib, only when a trace is drawn

        plot_dp_trace(written, written.with_suffix(".png"))
