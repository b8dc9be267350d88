"""Move a running job to another TP x DP layout in place: the escalation's move (issue 46).

Role: runtime (executes the escalation's request, megahet/runtime/escalation.py; `pretrain()` calls it
between two steps, in the same processes: no restart, nothing written).

It is the pipeline re-split's move (megahet/runtime/resplit.py `move_state`) with the process groups
rebuilt in between: every rank computes the same reshard plan from the old TP x PP x DP to the new one
(megahet/policy/reshard_plan.py: which runs of which weights, fp32 masters and Adam moments each rank
needs, and which old rank holds them), the runs that change rank travel over the world's group, the old
engine is freed, megatron-core's groups are rebuilt for the new TP (`megahet.parallel.regroup`: the world's
group stays), and every rank builds its model and DeepSpeed engine for the new layout and loads what it
received. The run plan of the new layout is `RunPlan.with_layout` (megahet/run_plan.py): the same data and
model, DP shares by measured speed when DP > 1.

The global batch, the data order and the LR schedule stay; the gradients are reduced in another order
(another TP and DP), so the loss follows the unmoved run within fp32 reduction noise. A kill during the move
loses nothing: no checkpoint is written or changed, and the job resumes from its last complete one (at the
run's own layout: megahet/checkpointing/elastic.py reshards a checkpoint saved after a move). The move's cost
is measured in three parts (planning, transfer, rebuild) and logged (`relayout_s`, `relayout_bytes`); the
escalation weighs the next move against it.

    trainer = relayout(trainer, rebuild)     # trainer.pending_layout: the TP, DP shares and placement to move to
"""

from __future__ import annotations

from collections.abc import Callable

from megahet.checkpointing import checkpoint
from megahet.parallel import regroup
from megahet.run_plan import RunPlan
from megahet.runtime.resplit import describe, move_state


def relayout(trainer, rebuild: Callable[[RunPlan, checkpoint.Restore, int], object]):
    """Move `trainer` to `trainer.pending_layout` (TP, DP shares, strided TP groups; all ranks call it after the
    same step); returns the Trainer of the new layout (`rebuild`: from the new plan, on the rebuilt groups), at
    the same step."""
    plan, logger, step = trainer.plan, trainer.logger, trainer.iteration
    new_plan = plan.with_layout(*trainer.pending_layout)
    seed = plan.cfg.train.seed
    new_trainer, cost, moves = move_state(
        trainer, new_plan, rebuild, carried=lambda hook: hook.layout_free,
        regroup=lambda: regroup(new_plan.tp, new_plan.pp, seed, strided=new_plan.strided),
    )  # fmt: skip
    old, new = moves.old, moves.new
    for hook in new_trainer.step_hooks:
        hook.relayout_done(cost)
    logger.print(
        f"megahet: moved {describe(old)} -> {describe(new)} after step {step} in {cost.total_s:.2f} s: planned "
        f"in {cost.plan_s:.2f} s, moved {cost.bytes_moved / 2**20:.1f} MiB of weights and optimizer state rank "
        f"to rank in {cost.transfer_s:.2f} s ({len(moves.tensors_moved())} tensors), rebuilt the groups, model "
        f"and engine and loaded it in {cost.build_s:.2f} s"
    )
    metrics = {
        "relayout_s": cost.total_s,
        "relayout_transfer_s": cost.transfer_s,
        "relayout_bytes": float(cost.bytes_moved),
        "layout_tp": float(new_plan.tp),
    }
    logger.log(step, metrics, console=False)
    return new_trainer
