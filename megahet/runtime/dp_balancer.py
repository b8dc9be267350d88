"""The data-parallel balancer in the training loop: measure every replica's speed, re-plan the shares.

Role: runtime (the step hook of heterogeneous data parallelism: measure, estimate, plan with the pure
`megahet.policy.dp_shares`, hand the shares to the Trainer, which executes them).

After every step each rank contributes two numbers — the micro-batches it ran and the time of its
forward/backward compute regions (megahet/runtime/timing.py: its own compute plus the TP collectives
inside them, which every micro-batch pays too, and the waits for slower TP peers, which are its
replica's pace; pipeline sends and receives and the data-parallel reduction fall outside) — gathered
over the whole world by an asynchronous all-gather that completes while the step finishes. A rank's
speed sample is micro-batches per second of that time (the embedding, output layer and loss move with
the samples, so they count; with packed documents: predicted cost at speed 1 per second, and the speeds
go to the per-step document planner instead of shares); the estimate is the median of the last
`hetero.window` samples. With `balance.whole_step` each rank also sends its own time in
the optimizer step (megahet/runtime/timing.py), which does not move with the micro-batches: a replica's
fixed work is its slowest rank's (median over the window), and the shares minimize the slowest whole
step, micro-batches plus fixed work (`dp_shares(..., fixed=)`). A replica
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
from megahet.policy.detector import MedianWindow, SpeedEstimator
from megahet.policy.dp_shares import RankCoords, dp_shares, replica_speeds
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
        self.estimator = SpeedEstimator(layout.world_size, cfg.hetero.window)
        self.fixed = MedianWindow(layout.world_size, cfg.hetero.window)
        """Every rank's own seconds in the optimizer step (the work its micro-batches do not move)."""
        self.whole_step = cfg.balance.whole_step
        self.packed = packed
        """Packed documents: a replica's work is its predicted cost (`ctx.replica_work`), and the speeds
        go to the per-step planner (`ctx.set_replica_speeds`) instead of whole-micro-batch shares."""
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
        micro, region, optimizer = ([float(r[i]) for r in rows] for i in range(3))
        self.estimator.update(micro, region)
        self.fixed.update(optimizer)
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
        self._due = self.measured and (step + 1) % self.cfg.interval == 0 and self.estimator.ready

    def replica_speeds(self) -> list[float] | None:
        """Each replica's estimated speed in micro-batches per second, the fastest = 1 (None before the
        first samples)."""
        if not self.estimator.ready:
            return None
        speeds = self._raw_replica_speeds()
        fastest = max(speeds)
        return [s / fastest for s in speeds]

    def _raw_replica_speeds(self) -> list[float]:
        return replica_speeds(dict(zip(self.coords, self.estimator.raw_speeds())), tp_balanced=False)

    def replica_fixed(self) -> list[float] | None:
        """Each replica's fixed work (its slowest rank's optimizer step) in micro-batches at the fastest
        replica's speed (None: `balance.whole_step` off, or no sample yet)."""
        if not (self.whole_step and self.fixed.ready and self.estimator.ready):
            return None
        slowest: dict[int, float] = {}
        for (dp, _pp, _tp), seconds in zip(self.coords, self.fixed.medians()):
            slowest[dp] = max(slowest.get(dp, 0.0), seconds)
        fastest = max(self._raw_replica_speeds())
        return [slowest[dp] * fastest for dp in range(len(slowest))]

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
        new = dp_shares(
            self.replica_speeds(),
            self.num_microbatches,
            current=self.shares,
            hysteresis=self.cfg.hysteresis,
            healthy_gap=self.cfg.healthy_gap,
            fixed=self.replica_fixed(),
        )
        if new != self.shares:
            self.shares = new
            self.changes += 1
            self.ctx.set_shares(new)

    def metrics(self) -> dict[str, float]:
        self._collect()
        return {"dp_share_changes": float(self.changes)}

    def report(self) -> dict[str, float]:
        """Per replica: estimated speed and micro-batches of the global batch (the same on every rank)."""
        self._collect()
        speeds = self.replica_speeds() or [float("nan")] * len(self.shares)
        out = {f"speed_dp{r}": s for r, s in enumerate(speeds)}
        out.update({f"share_dp{r}": float(n) for r, n in enumerate(self.shares)})
        return out

    def state_dict(self) -> dict:
        self._collect()
        return {
            "step": self.step,
            "shares": list(self.shares),
            "samples": [list(s) for s in self.estimator.samples],
            "fixed_samples": [list(s) for s in self.fixed.samples],
            "changes": self.changes,
            "due": self._due,
            "speeds_applied": list(self.speeds_applied) if self.speeds_applied is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the shares (the Trainer executes them from the next step) and the speed samples."""
        fixed = state.get("fixed_samples") or [[] for _ in self.fixed.samples]  # older checkpoints
        for samples, values in [
            *zip(self.estimator.samples, state["samples"], strict=True),
            *zip(self.fixed.samples, fixed),
        ]:
            samples.clear()
            samples.extend(values)
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
