"""Re-split the pipeline stages at run time: only the layers that change stage move, rank to rank.

Role: runtime (executes the pipeline balancer's request, megahet/runtime/pp_balancer.py; `pretrain()`
calls it between two steps, in the same processes and process groups).

1. Every rank lists the model's parameters (names, unsharded shapes) from the live stages (one
   all-gather of names and shapes) and computes the same reshard plan (megahet/policy/reshard_plan.py)
   from the old split to the new: for every rank, which runs of which tensors it needs (weights, fp32
   masters, Adam moments: ZeRO fragments included) and which old rank holds them.
2. `exchange` (megahet/runtime/state_move.py) moves them over the world's process group, one message
   per run, on the device the state lives on: the layers that change stage, with their optimizer
   state, and the ZeRO fragments whose DP owner changes because a stage's flat partition grew or
   shrank. Nothing is written to disk, and no rank gathers the model. What each rank keeps stays where
   it is: views of the old engine's buffers (`keep(share=True)`; a copy only where a new holding mixes
   kept and received runs).
3. The old engine and stage modules are freed (and their memory given back: `release_freed_memory`),
   all but the buffers under the kept views (the old weights' flat buffer goes once they are written);
   every rank builds its stage for the new split, writes the weights it now holds into it before the
   DeepSpeed engine is made from it (`load_weights`), then the fp32 masters and Adam moments into the
   new engine (`load_engine_state`), each tensor dropped once written, with Adam's step, the learning
   rates, the LR schedule and the engine's step count.
4. What is not per-parameter crosses in memory as before: the RNG streams (same rank, same streams) and
   the state of step hooks whose state does not depend on the split (`split_free`: the data-parallel
   shares, the TP balancer's speed samples and per-rank work fractions).

A kill during a move loses nothing: no checkpoint is written or changed, and the job resumes from its
last complete one. The move's cost is measured in three parts and logged (`resplit_s`; `resplit_plan_s`: the parameter
list, the plan and the engine's state; `resplit_transfer_s`: the runs that change rank;
`resplit_build_s`: what each rank keeps, freeing, rebuilding and loading), with the
bytes moved (`resplit_bytes`); the pipeline balancer weighs the next re-split against it.

    trainer = resplit(trainer, rebuild)     # rebuild(plan, restore, resplits) -> Trainer

`move_state` is the move itself, shared with the escalation's move to another TP x DP layout
(megahet/runtime/relayout.py), which rebuilds megatron-core's groups between freeing and building.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megahet.checkpointing import checkpoint
from megahet.checkpointing.state_slices import engine_state, keep, load_engine_state, load_weights
from megahet.compat import deepspeed_zero as zero
from megahet.parallel import slowest_over_ranks
from megahet.platform import release_freed_memory
from megahet.policy.reshard_plan import (
    KEYS,
    WEIGHT,
    Layout,
    Param,
    rank_holdings,
    reshard_plan,
    unsharded_params,
)
from megahet.policy.stage_split import layers_moved
from megahet.run_plan import RunPlan
from megahet.runtime.state_move import exchange


@dataclasses.dataclass(frozen=True)
class ResplitCost:
    """A measured re-split (each part the slowest rank's): planning (the parameter list, the plan, the
    engine's state), the transfer (the runs that change rank), the rebuild (what each rank keeps, free,
    build, load: it grows with the stage, not with what moves), and the bytes moved;
    what the pipeline balancer's next decision weighs."""

    plan_s: float
    transfer_s: float
    build_s: float
    bytes_moved: int
    layers_moved: int

    @property
    def total_s(self) -> float:
        return self.plan_s + self.transfer_s + self.build_s


def _free(trainer) -> None:
    """Release the old engine, its optimizer and the stage modules (host or device memory)."""
    trainer.engine.destroy()
    trainer.engine = trainer.scheduled = trainer.task = None
    trainer.step_hooks = []
    release_freed_memory()


def live_params(model: torch.nn.Module, layout, split, gated: bool, tied: bool) -> list[Param]:
    """The unsharded model's trained parameters from every rank's live stage (an all-gather of (stage, TP
    rank, local names and shapes); all ranks call it). `tied`: the last stage's `output_layer.weight` is
    a copy of the word embedding, not a parameter of its own."""
    mine = (layout.pp_rank, layout.tp_rank, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if layout.dp_rank == 0 else None)
    by_stage = {stage: named for stage, tp_rank, named in filter(None, gathered) if tp_rank == 0}
    stages = [by_stage[stage] for stage in range(layout.pp_size)]
    return unsharded_params(stages, layout.tp_size, split, gated, tied)


def state_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The dtype each key of the moved state travels in: the weights the model's, the optimizer state fp32."""
    weight = next(model.parameters())
    return {key: weight.dtype if key == WEIGHT else torch.float32 for key in KEYS}


def plan_move(model: torch.nn.Module, layout, plan: RunPlan, tp: int, pp: int, dp: int, split, strided: bool):
    """(the live parameters, the old and new reshard Layouts, the ReshardPlan) of a move of `model` (on
    `layout`, run plan `plan`) to TP x PP x DP with `split` layers per stage and `strided` TP groups, at the
    same CP. Every rank calls it (it gathers the parameters' names and shapes)."""
    m = plan.cfg.model
    tied = not m.untie_embeddings_and_output_weights
    params = live_params(model, layout, plan.split, gated=m.activation == "swiglu", tied=tied)
    # CP ranks hold their position's weights whole and ZeRO splits the optimizer state over DP x CP (ranks
    # in megatron-core's tp-cp-dp-pp order): to the plan they are replicas, CP folded into DP
    cp = layout.cp_size
    old = Layout(layout.tp_size, layout.pp_size, layout.dp_size * cp, tuple(plan.split), tied, layout.strided)
    new = Layout(tp, pp, dp * cp, tuple(split), tied, strided)
    return params, old, new, reshard_plan(params, old, new)


def move_state(
    trainer,
    new_plan: RunPlan,
    rebuild: Callable[[RunPlan, checkpoint.Restore, int], object],
    carried: Callable[[object], bool],
    regroup: Callable[[], None] | None = None,
):
    """Move `trainer`'s weights and optimizer state, rank to rank, to `new_plan`'s layout (another split, or
    with `regroup` another TP x PP x DP: it rebuilds the process groups once the old engine is freed) and
    rebuild; the hooks `carried` picks hand their state to the new Trainer's of the same type. Returns
    (the new Trainer, the measured ResplitCost, the reshard plan). All ranks call it after the same step."""
    plan, layout, engine = trainer.plan, trainer.layout, trainer.engine
    dist.barrier()  # ranks leave the step at different times: the move's cost starts when all are here
    t0 = time.perf_counter()
    model = engine.module
    target = (new_plan.tp, new_plan.pp, new_plan.dp, tuple(new_plan.split), new_plan.strided)
    params, old, new, moves = plan_move(model, layout, plan, *target)
    before = rank_holdings(params, old, layout.rank, moves.blocks)
    after = rank_holdings(params, new, layout.rank, moves.blocks)
    weight = next(model.parameters())
    dtypes = state_dtypes(model)
    inner = engine.optimizer.optimizer
    adam = (zero.adam_step(engine.optimizer), [g["lr"] for g in inner.param_groups])
    schedule = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    global_steps, progress = engine.global_steps, trainer.progress()
    dist.barrier()  # the move starts when every rank has planned: their skew counts as planning, not moving
    t_planned = time.perf_counter()
    held = engine_state(engine, before)
    state = exchange(moves, layout.rank, before, after, held, dtypes, weight.device, keep_local=False)
    t_moved = time.perf_counter()
    keep(held, before, after, state, share=True)  # the rest of the stage's state: views of the old engine
    del held, engine, model, inner, weight  # the old engine's last references here: _free releases it
    rng = checkpoint.rng_states()
    kept = {type(h).__name__: h.state_dict() for h in trainer.step_hooks if carried(h)}
    resplits = 1 + max((getattr(h, "resplits", 0) for h in trainer.step_hooks), default=0)
    for hook in trainer.step_hooks:
        hook.close(final=False)
    _free(trainer)
    carry = "and the balancers' state carry" if regroup is None else "carry (the balancers measure anew)"
    if regroup is not None:
        regroup()
        # the tensor-parallel streams belong to a TP rank: the new one's, seeded by regroup, stay
        rng["tracker"] = checkpoint.rng_states()["tracker"]

    def restore(new_trainer) -> tuple[checkpoint.Progress, str]:
        e = new_trainer.engine
        load_engine_state(e, after, state, *adam, weights_loaded=True)
        if schedule is not None and e.lr_scheduler is not None:
            e.lr_scheduler.load_state_dict(schedule)
        e.global_steps = global_steps
        return progress, (
            f"moved the weights and optimizer state {describe(old)} -> {describe(new)} rank to rank (step "
            f"{progress.iteration}); RNG streams {carry} over"
        )

    weights = functools.partial(load_weights, holdings=after, flat=state)
    new_trainer = rebuild(new_plan, checkpoint.Restore(weights, restore), resplits)
    checkpoint.set_rng_states(rng)
    for hook in new_trainer.step_hooks:
        if carried(hook) and type(hook).__name__ in kept:
            hook.carry(kept[type(hook).__name__])
    # Every rank weighs the next move against the same cost (the slowest rank's): ranks that decided
    # differently would wait for each other in the move forever.
    parts = slowest_over_ranks(t_planned - t0, t_moved - t_planned, time.perf_counter() - t_moved)
    itemsize = {key: dtype.itemsize for key, dtype in dtypes.items()}
    moved = layers_moved(plan.split, new_plan.split) if new_plan.pp == plan.pp else 0
    cost = ResplitCost(*parts, moves.bytes_moved(itemsize), moved)
    new_trainer.last_resplit = cost
    return new_trainer, cost, moves


def describe(layout: Layout) -> str:
    """'TP 2 x PP 1 x DP 1', with the layers per stage when PP > 1 and ', TP groups strided' when they are."""
    split = f" (layers {list(layout.split)})" if layout.pp > 1 else ""
    strided = ", TP groups strided" if layout.strided else ""
    return f"TP {layout.tp} x PP {layout.pp}{split} x DP {layout.dp}{strided}"


def resplit(trainer, rebuild: Callable[[RunPlan, checkpoint.Restore, int], object]):
    """Re-split `trainer`'s stages to `trainer.pending_split` (all ranks call it after the same step);
    returns the Trainer for the new split (`rebuild`: from the new plan), at the same step, to train on."""
    plan, logger, step = trainer.plan, trainer.logger, trainer.iteration
    old_split = plan.split
    new_plan = plan.with_split(trainer.pending_split)
    resplits = 1 + max((getattr(h, "resplits", 0) for h in trainer.step_hooks), default=0)
    new_trainer, cost, moves = move_state(trainer, new_plan, rebuild, carried=lambda hook: hook.split_free)
    for hook in new_trainer.step_hooks:
        hook.resplit_done(cost)
    logger.print(
        f"megahet: re-split the pipeline stages {old_split} -> {new_plan.split} after step {step} in "
        f"{cost.total_s:.2f} s: planned in {cost.plan_s:.2f} s, moved {cost.bytes_moved / 2**20:.1f} MiB of "
        f"weights and optimizer state rank to rank in {cost.transfer_s:.2f} s ({len(moves.tensors_moved())} "
        f"tensors), rebuilt the stages and loaded it in {cost.build_s:.2f} s"
    )
    metrics = {
        "resplit_s": cost.total_s,
        "resplit_plan_s": cost.plan_s,
        "resplit_transfer_s": cost.transfer_s,
        "resplit_build_s": cost.build_s,
        "resplit_bytes": float(cost.bytes_moved),
        "pp_resplits": float(resplits),
    }
    logger.log(step, metrics, console=False)
    return new_trainer
