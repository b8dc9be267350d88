"""The heterogeneity hooks a Trainer starts with: declared speeds, data-parallel shares, pipeline stages.

Role: runtime (setup: `megahet.training.build_trainer` calls these after the Trainer and the TP balancer
exist; the hooks themselves are megahet/runtime/dp_balancer.py and megahet/runtime/pp_balancer.py).

    coords = start_heterogeneous(cfg, trainer, balancer)   # every rank's (dp, pp, tp), or None
    start_pipeline(cfg, trainer, coords, resplits=0)       # when hetero.pp_split plans the stages
"""

from __future__ import annotations

from megahet.config import MegahetConfig
from megahet.parallel import mesh_coords


def start_heterogeneous(cfg: MegahetConfig, trainer, balancer) -> list | None:
    """Declared speeds (hetero.speeds) set the data-parallel shares and the TP plan from step 0; uneven
    shares add the data-parallel balancer (first: it re-plans before a step's data is read). Returns
    every rank's (dp, pp, tp) when the run is heterogeneous (hetero.*), else None."""
    h, layout = cfg.hetero, trainer.layout
    packed = trainer.task.packed
    if not (h.speeds or h.active or h.pp_active):
        return None
    from megahet.config_checks import ranks_per_node
    from megahet.policy.declared_speeds import parse_declared_speeds
    from megahet.policy.dp_shares import dp_shares, replica_speeds
    from megahet.runtime.dp_balancer import DataParallelBalancer, rank_coords

    coords = rank_coords(layout)
    if coords != mesh_coords(layout.world_size, layout.tp_size, layout.pp_size):  # what start_split assumed
        raise RuntimeError(f"megatron-core's rank order is not tp-dp-pp: {coords}")
    if h.speeds:
        declared = parse_declared_speeds(h.speeds, layout.world_size, ranks_per_node(layout.world_size))
        by_coords = dict(zip(coords, declared))
        if h.active:  # a TP balancer evens each TP group out, else it runs at its slowest rank
            speeds = replica_speeds(by_coords, tp_balanced=balancer is not None and cfg.balance.plans)
            if packed:  # documents are planned by cost over speed every step
                trainer.set_replica_speeds(tuple(s / max(speeds) for s in speeds))
            else:
                trainer.set_shares(dp_shares(speeds, sum(trainer.shares), healthy_gap=h.healthy_gap))
        if balancer is not None:
            stage = [
                [by_coords[(dp, layout.pp_rank, tp)] for tp in range(layout.tp_size)]
                for dp in range(layout.dp_size)
            ]
            balancer.start_from(stage)
    if h.active:  # declared shares are measured and reported too, but never re-planned
        dp_balancer = DataParallelBalancer(
            cfg,
            layout,
            trainer.set_shares,
            lambda: trainer.times,
            coords,
            trainer.shares,
            lambda: trainer.step_t0,
            work=trainer.replica_work,
            apply_speeds=trainer.set_replica_speeds if packed else None,
        )
        trainer.step_hooks.insert(0, dp_balancer)
    return coords


def start_pipeline(cfg: MegahetConfig, trainer, coords: list, resplits: int) -> None:
    """The pipeline balancer: measures every stage's time per layer, and with hetero.pp_split=measured
    asks the Trainer for a re-split (megahet/runtime/pp_balancer.py)."""
    from megahet.config_checks import stage_split
    from megahet.runtime.pp_balancer import PipelineBalancer

    pp = PipelineBalancer(
        cfg,
        trainer.layout,
        stage_split(cfg),
        trainer.request_split,
        lambda: trainer.times,
        lambda: trainer.num_microbatches,
        coords,
        lambda: trainer.step_t0,
        resplits,
    )
    trainer.step_hooks.insert(0, pp)
