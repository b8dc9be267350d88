"""Static ZERO-resizing in the training loop: every `resize.reselect_interval` steps, ask the planner
for a plan (gammas from the config, units from the selection policy) and hand it to the executor.

A step hook of the Trainer (see training.py): `before_forward_backward`, `before_step`,
`after_step`, `metrics`. Each rank plans the entries of its own TP rank for every DP replica: the
priority scores come from that TP shard's weights, which are identical on its DP replicas, so all
replicas derive the same entries without communicating; other TP ranks' entries are not needed to
execute the plan.
"""

from __future__ import annotations

import numpy as np

from megahet.balance.resize_planner import parse_block_gammas, parse_rank_gammas, plan_resize
from megahet.balance.selection import select_priority, select_random, update_drop_age, update_scores
from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import BlockKey, RankKey


class ResizeController:
    def __init__(self, cfg: MegahetConfig, model, layout: ParallelLayout, num_microbatches: int):
        r = cfg.resize
        self.cfg, self.layout = r, layout
        self.seed = cfg.train.seed
        gammas = parse_rank_gammas(r.gamma, layout.dp_size, layout.tp_size)
        self.gammas = {rank: g for rank, g in gammas.items() if rank[1] == layout.tp_rank}
        self.overrides = parse_block_gammas(r.block_gamma)
        self.executor = ResizeExecutor(
            model,
            dp_rank=layout.dp_rank,
            tp_rank=layout.tp_rank,
            dp_size=layout.dp_size,
            imputation=r.imputation,
            num_microbatches=num_microbatches,
            track_weight_change=r.selection == "priority",
        )
        units = self.executor.block_units
        self.scores = {block: np.full(n, np.inf) for block, n in units.items()}
        self.drop_age = {
            (block, rank): np.zeros(n, int) for block, n in units.items() for rank in self.gammas
        }
        self.step = 0

    def _choose(self, block: BlockKey, rank: RankKey, n_drop: int) -> tuple[int, ...]:
        if self.cfg.selection == "random":
            kind = 0 if block[0] == "attn" else 1
            return select_random(
                len(self.scores[block]), n_drop, (self.seed, self.step, block[1], kind, *rank)
            )
        return select_priority(
            self.scores[block], self.drop_age[(block, rank)], n_drop, self.cfg.max_drop_steps
        )

    def before_forward_backward(self, step: int) -> None:
        self.step = step
        if step % self.cfg.reselect_interval == 0:
            plan = plan_resize(self.executor.block_units, self.gammas, self._choose, self.overrides)
            self.executor.apply(plan)

    def before_step(self, engine) -> None:
        self.executor.before_step(engine.optimizer)

    def after_step(self, engine) -> None:
        self.executor.after_step(engine.optimizer)
        plan = self.executor.plan
        for block, scores in self.scores.items():
            counts = plan.compute_counts(block, self.layout.tp_rank, self.layout.dp_size, len(scores))
            change = self.executor.weight_change.get(block, np.zeros(len(scores)))
            self.scores[block] = update_scores(scores, change, np.asarray(counts) > 0, self.cfg.score_decay)
            for rank in self.gammas:
                dropped = np.zeros(len(scores), bool)
                dropped[list(plan.dropped(block, *rank))] = True
                self.drop_age[(block, rank)] = update_drop_age(self.drop_age[(block, rank)], dropped)

    def evaluation(self):
        """Evaluate the whole model: the plan is a training-time device, not part of the model."""
        return self.executor.full_model()

    def metrics(self) -> dict[str, float]:
        """This rank's share of units dropped and its executed forward GFLOPs (resizable blocks)."""
        total = sum(self.executor.block_units.values())
        dropped = sum(
            len(self.executor.plan.dropped(b, self.layout.dp_rank, self.layout.tp_rank))
            for b in self.executor.blocks
        )
        return {"dropped_frac": dropped / max(total, 1), "gflops": self.executor.executed_flops() / 1e9}
