"""Re-split the pipeline stages at run time without losing state: checkpoint -> reshard -> rebuild.

Role: runtime (executes the pipeline balancer's request, megahet/runtime/pp_balancer.py; `pretrain()`
calls it between two steps, in the same processes and process groups).

1. Every rank saves the step (`checkpoint.save`: weights, ZeRO optimizer shards, LR schedule, data
   position) into train.save, or into <logging.log_dir>/resplit when the run saves nothing (not again
   when the Trainer has just saved this step).
2. Global rank 0 reshards it to the new layers per stage, with the optimizer state per parameter (fp32
   masters, Adam moments and step: `elastic.reshard_checkpoint` -> `convert.reshard_into`), and
   publishes it beside the saved one, which is kept (in <log_dir>/resplit only the newest is kept).
3. The old engine and stage modules are freed; every rank builds its stage for the new split and a new
   DeepSpeed engine, and loads the resharded checkpoint.
4. What a checkpoint does not carry to another layout crosses in memory: the RNG streams (same rank,
   same streams) and the state of step hooks whose state does not depend on the split (`split_free`:
   the data-parallel shares, the TP balancer's speed samples and per-rank work fractions, which the new
   stage's blocks are planned from at the next step).

Why a checkpoint cycle rather than moving layers between live engines: it reuses the one lossless path
(reshard with the optimizer state) that elastic restarts and `tools/convert_checkpoint.py reshard`
already use and test, for every ZeRO stage, TP degree and split, with nothing of DeepSpeed's internals
touched; and a re-split is rare (hysteresis and `hetero.pp_patience`). It costs a save, one merge on
rank 0 and a rebuild: it grows with the model (on rank 0's host memory), so it is logged (`resplit_s`).

    trainer = resplit(trainer, rebuild)     # rebuild(plan, resume, resplits) -> Trainer
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megahet.checkpointing import checkpoint, finder
from megahet.checkpointing.elastic import reshard_checkpoint
from megahet.config import MegahetConfig
from megahet.platform import cuda_available
from megahet.run_plan import RunPlan

RESPLIT_DIR = "resplit"


def resplit_root(cfg: MegahetConfig) -> Path:
    """Where a re-split's checkpoints go: train.save, else <logging.log_dir>/resplit."""
    if cfg.train.save:
        return Path(cfg.train.save).expanduser()
    return Path(cfg.logging.log_dir).expanduser() / RESPLIT_DIR


def _free(trainer) -> None:
    """Release the old engine, its optimizer and the stage modules (host or device memory)."""
    trainer.engine.destroy()
    trainer.engine = trainer.scheduled = trainer.task = None
    trainer.step_hooks = []
    gc.collect()
    if cuda_available():
        torch.cuda.empty_cache()


def _prune(root: Path, keep: Path) -> None:
    """Delete the re-split checkpoints in <log_dir>/resplit but `keep` (the newest, the one loaded)."""
    for old in root.glob("iter_*"):
        if old.is_dir() and old != keep:
            shutil.rmtree(old, ignore_errors=True)


def resplit(trainer, rebuild: Callable[[RunPlan, finder.Resume, int], object]):
    """Re-split `trainer`'s stages to `trainer.pending_split` (all ranks call it after the same step);
    returns the Trainer for the new split (`rebuild`: from the new plan), at the same step, to train on."""
    plan, layout, logger = trainer.plan, trainer.layout, trainer.logger
    cfg, old_split, step = plan.cfg, plan.split, trainer.iteration
    new_plan = plan.with_split(trainer.pending_split)
    t0 = time.perf_counter()
    root = resplit_root(cfg)
    if trainer.last_saved != step:
        checkpoint.save(trainer.checkpoint_parts(), trainer.progress(), root)
    t_saved = time.perf_counter()
    rng = checkpoint.rng_states()
    carried = {type(h).__name__: h.state_dict() for h in trainer.step_hooks if h.split_free}
    resplits = 1 + max((getattr(h, "resplits", 0) for h in trainer.step_hooks), default=0)
    for hook in trainer.step_hooks:
        hook.close(final=False)
    resume = finder.find_resume_in(root)  # the step just saved
    _free(trainer)
    resume = reshard_checkpoint(cfg, resume, layout.rank, new_plan.split, root)
    t_resharded = time.perf_counter()
    new = rebuild(new_plan, resume, resplits)
    checkpoint.set_rng_states(rng)
    for hook in new.step_hooks:
        if hook.split_free and type(hook).__name__ in carried:
            hook.carry(carried[type(hook).__name__])
    dist.barrier()  # every rank has loaded: the checkpoints it came from may go
    if not cfg.train.save and layout.rank == 0:
        _prune(root, resume.path)
    done = time.perf_counter()
    costs = {
        "resplit_s": done - t0,
        "resplit_save_s": t_saved - t0,
        "resplit_reshard_s": t_resharded - t_saved,
        "resplit_build_s": done - t_resharded,
    }
    logger.print(
        f"megahet: re-split the pipeline stages {old_split} -> {new_plan.split} after step "
        f"{step} in {costs['resplit_s']:.2f} s (save {costs['resplit_save_s']:.2f} s, reshard with the "
        f"optimizer state {costs['resplit_reshard_s']:.2f} s, rebuild and load {costs['resplit_build_s']:.2f} s)"
    )
    logger.log(step, {**costs, "pp_resplits": float(resplits)}, console=False)
    return new
