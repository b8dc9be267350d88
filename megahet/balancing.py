"""The balancer in the training loop: measure -> estimate speeds -> plan -> apply, between steps.

After every step each rank contributes two numbers — the work its resizable blocks executed (forward
+ backward FLOPs) and its compute time (the virtual device's charged busy time, else the measured
forward/backward compute) — gathered over its pipeline stage's TP x DP ranks. Every rank feeds the
same `SpeedEstimator`s (one per DP replica's TP group) and, every `balance.interval` steps, runs the
same pure planner (`megahet.balance.planner.balance`: static, resize, migrate or semi, with
hysteresis and a return to the even split when the group is healthy), so the resulting plan is
identical everywhere. The ResizeController turns the targets into units at the next step.

Every TP group of every pipeline stage balances itself (blocks and speeds are stage-local).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megahet.balance.detector import SpeedEstimator
from megahet.balance.planner import WorkTarget, balance
from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout


class BalanceController:
    def __init__(self, cfg: MegahetConfig, layout: ParallelLayout, resize, timers, device=None):
        self.cfg, self.layout, self.resize, self.timers, self.device = (
            cfg.balance,
            layout,
            resize,
            timers,
            device,
        )
        self.estimators = [SpeedEstimator(layout.tp_size, cfg.balance.window) for _ in range(layout.dp_size)]
        self.targets = [WorkTarget() for _ in range(layout.dp_size)]
        self.changes = 0
        self._flops0 = self._compute0 = 0.0

    def before_forward_backward(self, step: int) -> None:
        self.step = step
        self._flops0 = self.resize.executor.executed_flops()
        self._compute0 = self.timers.compute_s

    def before_step(self, engine) -> None:
        pass

    def _measure(self) -> tuple[float, float]:
        work = 3.0 * (self.resize.executor.executed_flops() - self._flops0)  # forward + 2x backward
        busy = self.device.busy_s if self.device is not None else self.timers.compute_s - self._compute0
        return work, busy

    def after_step(self, engine) -> None:
        work, busy = self._measure()
        mine = torch.tensor([self.layout.dp_rank, self.layout.tp_rank, work, busy], dtype=torch.float64)
        group = ps.get_tensor_and_data_parallel_group()
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        table = {(int(r[0]), int(r[1])): (float(r[2]), float(r[3])) for r in rows}
        for dp, estimator in enumerate(self.estimators):
            samples = [table[(dp, tp)] for tp in range(self.layout.tp_size)]
            estimator.update([w for w, _ in samples], [t for _, t in samples])
        if (self.step + 1) % self.cfg.interval or not all(e.ready for e in self.estimators):
            return
        b = self.cfg
        knobs = {"tolerance": b.tolerance, "healthy_gap": b.healthy_gap, "hysteresis_threshold": b.hysteresis}
        new = [
            balance(e.speeds(), b.mode, current, **knobs) for e, current in zip(self.estimators, self.targets)
        ]
        if new != self.targets:
            self.targets = new
            self.changes += 1
            self.resize.gammas = {
                (dp, tp): g for dp, t in enumerate(new) for tp, g in t.gamma.items() if g > 0
            }
            self.resize.moves = {
                (dp, tp): helpers for dp, t in enumerate(new) for tp, helpers in t.moves.items()
            }
            self.resize.request_replan()

    def metrics(self) -> dict[str, float]:
        estimator = self.estimators[self.layout.dp_rank]
        speed = estimator.speeds()[self.layout.tp_rank] if estimator.ready else 1.0
        return {"est_speed": speed, "plan_changes": float(self.changes)}
