"""Set-up and the run of megahet's pretraining scripts (pretrain_gpt.py, pretrain_vit.py).

Role: runtime (set-up: plan, process groups, task, engine, hooks; then train to the end).

    pretrain(cfg, spec)       # plan_run -> initialize_parallel -> build_trainer -> train_to_end
    run_cli(spec, argv)       # the scripts' entry point: bad inputs end in one line

A script supplies a `TaskSpec` (megahet/task.py); the step itself is the Trainer's (megahet/trainer.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megahet.checkpointing import checkpoint, finder
from megahet.checkpointing.elastic import read_resharded, reshard_checkpoint
from megahet.config import ConfigError, HelpRequested, MegahetConfig, config_help, load_config
from megahet.engine import build_engine
from megahet.failures import (
    default_sigterm,
    first_local_rank,
    is_peer_loss,
    lost_peer_message,
    name_lost_peers_when_stopped,
    record_peers,
)
from megahet.logging import TrainingLogger
from megahet.models.compiled import compile_layers
from megahet.parallel import (
    ParallelLayout,
    current_layout,
    destroy_parallel,
    initialize_parallel,
    slowest_over_ranks,
    start_distributed,
)
from megahet.platform import cuda_available, freeze_long_lived_objects, release_freed_memory
from megahet.run_plan import RunPlan, plan_run
from megahet.runtime.hook_builder import build_step_hooks
from megahet.runtime.hooks import StepHook
from megahet.runtime.relayout import relayout
from megahet.runtime.resplit import resplit
from megahet.task import TaskSpec
from megahet.trainer import Trainer


def setup(cfg: MegahetConfig, spec: TaskSpec, extra_hooks: Sequence[StepHook] = ()) -> Trainer:
    """Plan the run (every check, before any rank starts work: megahet/run_plan.py), start the process
    groups, prepare data, build the task, engine and logger. `extra_hooks`: the caller's own step hooks,
    run after megahet's (and again after a re-split)."""
    plan = plan_run(cfg, spec)
    cfg = plan.cfg
    freeze_long_lived_objects()  # the imports stay out of every later full collection (a move's, Python's own)
    if cfg.train.precision == "bf16" and cuda_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16 is not supported by this GPU: use train.precision=fp32")
    if int(os.environ.get("RANK", "0")) == 0:  # once, before any rank starts work
        for note in plan.notes:
            print(f"megahet: {note}", flush=True)
    timeout, cp = cfg.parallel.distributed_timeout_minutes, cfg.parallel.cp
    start_distributed(plan.tp, plan.pp, timeout, cp)  # the ranks meet (each started when it did)
    t0 = time.perf_counter()
    layout = initialize_parallel(plan.tp, plan.pp, cfg.train.seed, timeout, cp=cp)
    groups_s = time.perf_counter() - t0
    record_peers()
    resume, restore = plan.resume, None
    if plan.reshard:  # every rank reads its own slices; else rank 0 reshards the whole checkpoint
        resumed = read_resharded(cfg, resume, layout, plan.split)
        if resumed is not None:
            resume, restore = None, checkpoint.Restore(None, resumed.restore)
        else:
            resume = reshard_checkpoint(cfg, resume, layout.rank, plan.split)
    if layout.rank == 0:
        spec.prepare(cfg)
    dist.barrier()
    trainer = build_trainer(plan, spec, layout, resume, extra_hooks=extra_hooks, restore=restore)
    # what a move to another layout does again (not the rendezvous, the data's preparation, a checkpoint's
    # read): the slowest rank's megatron-core groups, and model and engine build
    trainer.rebuild_s = slowest_over_ranks(groups_s)[0] + trainer.build_s
    return trainer


def build_trainer(
    plan: RunPlan,
    spec: TaskSpec,
    layout: ParallelLayout,
    resume: finder.Resume | None,
    logger: TrainingLogger | None = None,
    resplits: int = 0,
    extra_hooks: Sequence[StepHook] = (),
    restore: checkpoint.Restore | None = None,
) -> Trainer:
    """Build the task, engine, logger and step hooks of `plan` on the started process groups and load
    `resume` (setup(); a re-split builds again with the new plan's layers per stage, the same logger, its
    count of re-splits and the caller's `extra_hooks`, which run after megahet's, and `restore`s the
    state it moved: its weights into the model before the engine is built, the rest into the engine)."""
    cfg = plan.cfg
    loaded = resume is not None or restore is not None  # every weight is overwritten: skip their init
    layout = dataclasses.replace(layout, stage_layers=plan.split, weights_loaded=loaded)
    t_build = time.perf_counter()
    task = spec.build(cfg, layout)
    if restore is not None and restore.weights is not None:  # the moved weights in, their copy freed
        restore.weights(task.model)
        release_freed_memory(collect=False)
    compiled = compile_layers(task.model) if cfg.train.compile else 0
    engine = build_engine(cfg, task.model, layout.dp_size, dict(plan.user_ds))
    (build_s,) = slowest_over_ranks(
        time.perf_counter() - t_build
    )  # decisions that use it agree on every rank
    logger = logger or TrainingLogger(cfg, layout, run_name=spec.name)
    split = f" (layers {plan.split})" if plan.split.uneven else ""
    cp = f" x CP {layout.cp_size}" if layout.cp_size > 1 else ""
    strided = " (TP groups strided)" if layout.strided else ""
    logger.print(
        f"megahet {spec.name}: world {layout.world_size} = TP {layout.tp_size}{cp} x PP {layout.pp_size}{split} x "
        f"DP {layout.dp_size}{strided}, ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}, "
        f"{sum(p.numel() for p in task.model.parameters())} parameters on this rank"
    )
    if compiled:
        logger.print(
            f"megahet: torch.compile: the forward of {compiled} transformer layers (compiled at first use)"
        )
    trainer = Trainer(cfg, task, engine, layout, logger)
    trainer.plan, trainer.extra_hooks, trainer.build_s = plan, tuple(extra_hooks), float(build_s)
    build_step_hooks(plan, trainer, resplits, extra_hooks)  # sets trainer.step_hooks, in their order
    progress = None
    if resume is not None:
        progress, seconds = checkpoint.load(trainer.checkpoint_parts(), resume, resplit=resplits > 0)
        restored = f"resumed from {resume.path} (step {progress.iteration}) in {seconds:.2f} s"
    elif restore is not None:
        progress, restored = restore.state(trainer)
        release_freed_memory(collect=False)  # the moved or read state, dropped as it was written
    if progress is not None:
        trainer.resume_at(progress)
        position = getattr(task.train_data, "seek", None)
        if position is None:
            raise ConfigError(
                "train.load: the task's train_data cannot go on from a resumed step (it has no seek): build it "
                "with megahet.data.sampling.micro_batches or give it seek(iteration=, consumed_samples=)"
            )
        position(iteration=trainer.iteration, consumed_samples=trainer.start_sample)
        logger.print(f"megahet: {restored}")
    for hook in trainer.step_hooks:  # traces go on from the loaded step (rows before it are kept)
        if getattr(hook, "trace", None) is not None:
            hook.trace.resume_from = trainer.iteration
    return trainer


def train_to_end(trainer: Trainer, spec: TaskSpec) -> tuple[Trainer, list[dict[str, Any]]]:
    """Train `trainer` to train.train_iters; when the pipeline balancer asks for other layers per stage,
    re-split the stages (the layers that change stage move rank to rank with their optimizer state, then
    the stages are rebuilt: megahet/runtime/resplit.py); when the escalation asks for another layout, move
    to it in place (megahet/runtime/relayout.py); and go on. Returns the last Trainer and the per-step records."""
    logger, extra = trainer.logger, trainer.extra_hooks

    def rebuild(plan: RunPlan, restore, resplits: int) -> Trainer:  # on the groups as they are now
        return build_trainer(plan, spec, current_layout(), None, logger, resplits, extra, restore)

    history = trainer.train()
    while trainer.pending_move and trainer.iteration < trainer.cfg.train.train_iters:
        trainer = (
            resplit(trainer, rebuild) if trainer.pending_split is not None else relayout(trainer, rebuild)
        )
        history += trainer.train()
    return trainer, history


def pretrain(
    cfg: MegahetConfig, spec: TaskSpec, extra_hooks: Sequence[StepHook] = ()
) -> list[dict[str, Any]]:
    """setup(), then train with periodic logging and evaluation (train_to_end); returns the per-step
    records. `extra_hooks`: the caller's own step hooks (megahet/runtime/hooks.py), run after megahet's."""
    trainer = setup(cfg, spec, extra_hooks)
    start, t0 = trainer.start_iteration, time.perf_counter()
    trainer, history = train_to_end(trainer, spec)
    for hook in trainer.step_hooks:
        hook.close()
    trainer.logger.print(
        f"megahet {spec.name}: {trainer.iteration - start} steps in {time.perf_counter() - t0:.1f} s"
    )
    trainer.logger.close()
    return history


def run_cli(spec: TaskSpec, argv: list[str], defaults: MegahetConfig | None = None) -> None:
    """Entry point of the pretrain scripts: bad inputs end in one line naming the problem and fix
    (printed once per node before the process groups start); a lost peer in one line naming it."""
    name_lost_peers_when_stopped()
    try:
        pretrain(load_config(argv, defaults=defaults), spec)
        # Join gloo's worker threads while the interpreter is alive: exiting with the process groups
        # still up lets them be torn down during finalization (SIGABRT, "terminate called without an
        # active exception"). Only on success: after a failure peers may be stuck in a collective.
        destroy_parallel()
    except HelpRequested:
        print(config_help(defaults))
    except (ConfigError, FileNotFoundError) as err:
        # Before the groups start, every rank of a node fails alike: its first rank says it.
        loud = dist.is_initialized() or first_local_rank()
        default_sigterm()
        sys.exit(f"megahet: error: {err}" if loud else 1)
    except RuntimeError as err:
        if not is_peer_loss(err):
            raise
        line = lost_peer_message(err)
        default_sigterm()  # this rank ends now: the launcher's SIGTERM may cut its exit short
        sys.exit(line)
