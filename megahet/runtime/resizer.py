"""Static ZERO-resizing in the training loop: every `resize.reselect_interval` steps, ask the planner

Role: runtime (the resize / migration step hook: executes the plan it is given between steps).
for a plan (gammas from the config, units from the selection policy) and hand it to the executor.

A step hook of the Trainer (see megahet/trainer.py): `before_forward_backward`, `before_step`,
`after_step`, `evaluation`, `metrics`. The plan is identical on every rank of a pipeline stage: random
selection is seeded by (seed, step, block, rank), and priority scores are averaged over the DP
replicas of each TP rank and all-gathered over the TP group (a few floats per unit) before every
rank runs the same pure planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megahet import platform
from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.policy.planner import WorkTarget
from megahet.policy.resize_planner import (
    parse_block_gammas,
    parse_migrations,
    parse_rank_gammas,
    plan_migration,
    plan_resize,
)
from megahet.policy.selection import (
    GradientStats,
    priority_scores,
    select_priority,
    select_random,
    update_drop_age,
    update_gradient_stats,
)
from megahet.runtime.hooks import StepHook
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import BlockKey, RankKey, ResizePlan, block_name, parse_block_name


class ResizeController(StepHook):
    checkpointed = True

    def __init__(
        self, cfg: MegahetConfig, model, layout: ParallelLayout, num_microbatches: int, seq_length: int = 0
    ):
        """`seq_length`: the attention's sequence length, what migration weighs a head's work by against an
        MLP unit's (`Block.unit_work`); 0: by its GEMMs alone."""
        r = cfg.resize
        self.seq_length = seq_length
        self.cfg, self.layout, self.seed = r, layout, cfg.train.seed
        self._replan = True  # plan at the next step: the configured plan at the first, the balancer's later
        self.gammas = parse_rank_gammas(r.gamma, layout.dp_size, layout.tp_size)
        self.overrides = parse_block_gammas(r.block_gamma)
        self.moves = parse_migrations(r.migrate, layout.dp_size, layout.tp_size)
        self._migrated: dict = {}
        self.executor = ResizeExecutor(
            model,
            dp_rank=layout.dp_rank,
            tp_rank=layout.tp_rank,
            dp_size=layout.dp_size,
            imputation=r.imputation,
            num_microbatches=num_microbatches,
            track_gradients=self.tracks_priority(cfg, layout.tp_size),
            track_weights=r.priority_score == "taylor",
            score_samples=r.score_samples,
            tp_group=ps.get_tensor_model_parallel_group(),
        )
        self.units = self.executor.block_units
        self.stats: dict[BlockKey, GradientStats] = {}
        self.scores: dict[tuple[BlockKey, int], np.ndarray] = {}
        self.drop_age: dict[tuple[BlockKey, RankKey], np.ndarray] = {}
        """Steps each unit has been dropped in a row, per (block, rank) ever resized."""
        self.step = 0
        self._flops_logged = 0

    @staticmethod
    def tracks_priority(cfg: MegahetConfig, tp_size: int) -> bool:
        """Priority statistics are kept only where units can be dropped: static gammas, or a balancer that
        resizes a TP group of two or more (a group of one is always even: issue 48 measured the statistics
        at 0.5 % of a host-bound step for nothing there). Migration and the even split never select units."""
        r = cfg.resize
        resizes = bool(r.gamma or r.block_gamma) or (cfg.balance.resizes and tp_size > 1)
        return r.selection == "priority" and resizes

    def _local_scores(self, block: BlockKey) -> np.ndarray:
        stats = self.stats.get(block)
        return (
            priority_scores(stats, self.cfg.priority_score)
            if stats is not None
            else np.full(self.units[block], np.inf)
        )

    def _gather_scores(self) -> None:
        """Scores of every TP rank's units, each averaged over that TP rank's DP replicas and CP ranks (the CP
        ranks of a position drop the same heads: they exchange their keys and values)."""
        blocks = sorted(self.units)
        local = torch.from_numpy(np.concatenate([self._local_scores(b) for b in blocks]))
        copies = self.layout.dp_size * self.layout.cp_size
        if copies > 1:
            dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=True))
            local /= copies  # an unmeasured (inf) unit on any replica stays inf
        gathered = [torch.empty_like(local) for _ in range(self.layout.tp_size)]
        dist.all_gather(gathered, local, group=ps.get_tensor_model_parallel_group())
        for tp_rank, scores in enumerate(gathered):
            for block, part in zip(blocks, scores.split([self.units[b] for b in blocks])):
                self.scores[(block, tp_rank)] = part.numpy()

    def _choose(self, block: BlockKey, rank: RankKey, n_drop: int) -> tuple[int, ...]:
        """Units to drop among those not migrated away."""
        moved = {u for units in self._migrated.get(block, {}).get(rank, {}).values() for u in units}
        available = [u for u in range(self.units[block]) if u not in moved]
        n_drop = min(n_drop, len(available) - 1)
        if n_drop <= 0:
            return ()
        r, kind = self.cfg, 0 if block[0] == "attn" else 1
        if r.selection == "random":
            picks = select_random(len(available), n_drop, (self.seed, self.step, block[1], kind, *rank))
        else:
            scores = self.scores[(block, rank[1])][available]
            age = self._drop_age(block, rank)[available]
            # a stream of its own (not random selection's), the same on every rank
            seed = (self.seed, self.step, block[1], kind, *rank, 1)
            picks = select_priority(
                scores, age, n_drop, r.max_drop_steps, r.reselect_interval, r.priority_temperature, seed
            )
        return tuple(available[i] for i in picks)

    def _drop_age(self, block: BlockKey, rank: RankKey) -> np.ndarray:
        """A rank the balancer resizes for the first time starts with every age at zero."""
        return self.drop_age.setdefault((block, rank), np.zeros(self.units[block], int))

    def request_replan(self) -> None:
        """Plan again at the next step (the balancer changed gammas or moves)."""
        self._replan = True

    def set_targets(self, targets: list[WorkTarget], replan: bool = True) -> None:
        """The bridge from the balancer's plan form to this controller's: per DP replica, a WorkTarget's
        fractions become per-rank gammas (resize) and moves (migration), which `plan_resize` and
        `plan_migration` turn into the ResizePlan's whole units at the next planning step."""
        self.gammas = {(dp, tp): g for dp, t in enumerate(targets) for tp, g in t.gamma.items() if g > 0}
        self.moves = {(dp, tp): helpers for dp, t in enumerate(targets) for tp, helpers in t.moves.items()}
        if replan:
            self.request_replan()

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Micro-batches per replica (data-parallel shares): gradient averaging and imputation follow."""
        self.executor.set_shares(shares)

    def before_forward_backward(self, step: int) -> None:
        self.step = step
        self.executor.sampling = step % self.cfg.score_interval == 0  # the statistics' sampled steps
        # a reselection re-draws the dropped units: with none to drop the plan would come out the same
        if self._replan or (self.gammas and step % self.cfg.reselect_interval == 0):
            self._replan = False
            if self.executor.track_gradients:
                self._gather_scores()
            self._migrated = plan_migration(
                self.units,
                self.moves,
                platform.unit_multiple(self.cfg.unit_multiple),
                self.executor.unit_work(self.seq_length) if self.moves else None,
            )
            dropped = plan_resize(
                self.units,
                self.gammas,
                self._choose,
                self.overrides,
                platform.unit_multiple(self.cfg.unit_multiple),
            ).blocks
            self.executor.apply(ResizePlan(dropped, self._migrated))

    def before_step(self, engine) -> None:
        self.executor.before_step(engine.optimizer)

    def after_step(self, engine) -> None:
        self.executor.after_step(engine.optimizer)
        plan = self.executor.plan
        for block, n in self.units.items():
            if self.executor.track_gradients and self.executor.sampling:
                grad = self.executor.unit_gradients[block]  # (units, elements), on the device
                stats = self.stats.get(block) or GradientStats.empty(n, grad.shape[1], grad.device)
                computed = self.executor.computed_mask(block)  # (units,) bool, on the device
                weight = self.executor.unit_weights.get(block)  # (units, elements)
                decay = self.cfg.score_decay**self.cfg.score_interval  # per sample: score_decay per step
                self.stats[block] = update_gradient_stats(stats, grad, computed, decay, weight)
            for rank in self.gammas:
                dropped = np.zeros(n, bool)
                dropped[list(plan.dropped(block, *rank))] = True
                self.drop_age[(block, rank)] = update_drop_age(self._drop_age(block, rank), dropped)

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: the plan, the statistics, the drop ages, the step."""
        return {
            "plan": self.executor.plan.to_dict(),
            "step": self.step,
            "stats": {block_name(b): dataclasses.asdict(st) for b, st in self.stats.items()},
            "drop_age": [
                [block_name(b), list(rank), age.tolist()] for (b, rank), age in self.drop_age.items()
            ],
            "last_grad": self.executor.last_gradients(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.stats = {
            parse_block_name(name): GradientStats.from_saved(st, platform.device())
            for name, st in state["stats"].items()
        }
        for name, rank, age in state["drop_age"]:
            self.drop_age[(parse_block_name(name), tuple(rank))] = np.asarray(age, dtype=int)
        self.executor.load_last_gradients(state["last_grad"])
        self.executor.apply(ResizePlan.from_dict(state["plan"]))
        self._replan = False  # the saved plan goes on until the next reselection, as it would have

    def evaluation(self):
        """Evaluate the whole model: the plan is a training-time device, not part of the model."""
        return self.executor.full_model()

    def metrics(self) -> dict[str, float]:
        """This rank's share of dropped units, and forward GFLOPs its resizable blocks executed since
        the last call (training and evaluation)."""
        total = sum(self.units.values())
        dropped = sum(
            len(self.executor.plan.dropped(b, self.layout.dp_rank, self.layout.tp_rank)) for b in self.units
        )
        flops = self.executor.executed_flops()
        gflops, self._flops_logged = (flops - self._flops_logged) / 1e9, flops
        exchange = self.executor.exchange
        return {
            "dropped_frac": dropped / max(total, 1),
            "block_gflops": gflops,
            "migration_mb_step": exchange.bytes_last_step / 2**20,
            "migration_mb_plan": exchange.bytes_plan_change / 2**20,
        }
