"""The heterogeneity hooks a Trainer starts with: declared speeds, data-parallel shares, pipeline stages.

Role: runtime (setup: `megahet.training.build_trainer` calls these after the Trainer and the TP balancer
exist; they read the run plan, megahet/run_plan.py; the hooks themselves are
megahet/runtime/dp_balancer.py and megahet/runtime/pp_balancer.py).

    coords = start_heterogeneous(plan, trainer, balancer)   # every rank's (dp, pp, tp), or None
    start_pipeline(plan, trainer, coords, resplits=0)       # when hetero.pp_split plans the stages
"""

from __future__ import annotations

from megahet.parallel import mesh_coords
from megahet.run_plan import RunPlan


def start_heterogeneous(plan: RunPlan, trainer, balancer) -> list | None:
    """The plan's starting shares (from declared speeds, hetero.speeds) and the TP plan's starting
    speeds from step 0; uneven shares add the data-parallel balancer (first: it re-plans before a step's
    data is read). Returns every rank's (dp, pp, tp) when the run is heterogeneous (hetero.*), else None."""
    cfg, layout = plan.cfg, trainer.layout
    h = cfg.hetero
    if not (h.speeds or h.active or h.pp_active):
        return None
    from megahet.runtime.dp_balancer import DataParallelBalancer, rank_coords

    coords = rank_coords(layout)
    if coords != mesh_coords(layout.world_size, layout.tp_size, layout.pp_size):  # what the plan assumed
        raise RuntimeError(f"megatron-core's rank order is not tp-dp-pp: {coords}")
    if plan.replica_speeds is not None:  # packed documents are planned by cost over speed every step
        trainer.set_replica_speeds(plan.replica_speeds)
    elif plan.shares is not None and plan.shares != trainer.shares:
        trainer.set_shares(plan.shares)
    if balancer is not None and plan.speeds:
        balancer.start_from(plan.tp_group_speeds(layout.pp_rank))
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
            apply_speeds=trainer.set_replica_speeds if trainer.task.packed else None,
        )
        trainer.step_hooks.insert(0, dp_balancer)
    return coords


def start_pipeline(plan: RunPlan, trainer, coords: list, resplits: int) -> None:
    """The pipeline balancer: measures every stage's time per layer, and with hetero.pp_split=measured
    asks the Trainer for a re-split (megahet/runtime/pp_balancer.py)."""
    from megahet.runtime.pp_balancer import PipelineBalancer

    pp = PipelineBalancer(
        plan.cfg,
        trainer.layout,
        plan.split,
        trainer.request_split,
        lambda: trainer.times,
        lambda: trainer.num_microbatches,
        coords,
        lambda: trainer.step_t0,
        resplits,
    )
    trainer.step_hooks.insert(0, pp)
