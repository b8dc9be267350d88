"""Elastic resume (runtime): a checkpoint saved at another parallel layout is resharded, with its
optimizer state, to a TP x PP x DP that fits this world, and training continues on the loss curve.

A job restarted on fewer devices (a node lost, `torchrun --nnodes MIN:MAX --max-restarts N`), on more,
or with another --parallel.tp / --parallel.pp resumes from its last checkpoint with the same command:

1. `fit_layout` (policy, before any rank starts work) keeps the run's own TP x PP when it still fits
   the world (only DP changes: every rank's model shard stays the same). Otherwise it takes the
   largest TP' x PP' (TP' <= TP, PP' <= PP) that passes every check of the configuration at this
   world size (TP' divides the heads and the MLP, PP' the layers, DP' the global batch), preferring
   the larger TP' on a tie (TP groups sit inside a node, so a lost node costs pipeline stages first).
2. `reshard_checkpoint` (after the process groups start): rank 0 merges the saved TP x PP x DP shards,
   weights and ZeRO optimizer state (fp32 masters, Adam moments and step, LR schedule) per parameter
   (megahet/checkpointing/optimizer_state.py), re-splits them for the new TP x PP and publishes the result as a new
   checkpoint beside the old one (train.save, else train.load's folder; `latest` names it), which
   loads at any DP size and ZeRO stage. The saved checkpoint is kept.

The resharded run's gradients are reduced in another order (other DP and TP groups), so it follows
the uninterrupted run within fp32 reduction noise. RNG streams and step-hook state (the balancer's
speed samples and plan) belong to the old layout and start fresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from megahet.checkpointing.convert import reshard_into
from megahet.checkpointing.finder import Resume, describe_layout, find_resume_in, layout_of, per_parameter
from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import validate


def needs_reshard(
    resume: Resume | None, cfg: MegahetConfig, world: int, split: Sequence[int] | None = None
) -> bool:
    """A full checkpoint whose TP x PP x DP x ZeRO layout (with `split`, the run's layers per stage,
    default from cfg) is not the one `cfg` runs at this world size (weights-only checkpoints load at
    any DP, with their own TP x PP; resharded ones at any DP)."""
    if resume is None or resume.meta.get("weights_only"):
        return False
    saved, p = resume.meta["layout"], cfg.parallel
    if per_parameter(resume):
        now = layout_of(cfg, 1, split)
        return any(saved.get(k) != now.get(k) for k in ("tp", "pp", "stage_layers"))
    fits = world % (p.tp * p.pp) == 0
    return not fits or saved != layout_of(cfg, world // (p.tp * p.pp), split)


def with_layout(cfg: MegahetConfig, tp: int, pp: int) -> MegahetConfig:
    """cfg at TP x PP; its layers per stage (parallel.stage_layers) only at its own PP (else even)."""
    if (tp, pp) == (cfg.parallel.tp, cfg.parallel.pp):
        return cfg
    split = cfg.parallel.stage_layers if pp == cfg.parallel.pp else None
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, pp=pp, stage_layers=split)
    )


def _fits(cfg: MegahetConfig, tp: int, pp: int, world: int) -> bool:
    try:
        validate(with_layout(cfg, tp, pp), world)
    except ConfigError:
        return False
    return True


def fit_layout(cfg: MegahetConfig, world: int) -> tuple[int, int]:
    """(TP, PP) for this world: the run's own if it fits, else the largest TP' x PP' <= it that does.
    When none does, the configuration is wrong beyond its layout: TP 1 x PP 1's own error says how."""
    p = cfg.parallel
    if _fits(cfg, p.tp, p.pp, world):
        return p.tp, p.pp
    candidates = [
        (tp * pp, tp, pp)
        for tp in range(1, p.tp + 1)
        for pp in range(1, p.pp + 1)
        if _fits(cfg, tp, pp, world)
    ]
    if not candidates:
        validate(with_layout(cfg, 1, 1), world)  # raises the error that no layout can avoid
        raise AssertionError("unreachable: TP 1 x PP 1 is a candidate")
    _, tp, pp = max(candidates)
    return tp, pp


def layout_note(
    resume: Resume, asked: MegahetConfig, fitted: MegahetConfig, world: int, reshard: bool
) -> str | None:
    """The line that says how a checkpoint resumes at `fitted` (the run's TP x PP fitted to the world,
    asked for as `asked`), or None when it resumes as saved at the layout asked for."""
    if resume.meta.get("weights_only"):
        return None
    tp, pp = fitted.parallel.tp, fitted.parallel.pp
    own = (tp, pp) == (asked.parallel.tp, asked.parallel.pp)
    if not reshard and own:
        return None
    saved = resume.meta["layout"]
    old = describe_layout(saved) + (f" x DP {saved['dp']}" if "dp" in saved else "")
    why = "" if own else f" (TP {asked.parallel.tp} x PP {asked.parallel.pp} does not fit {world} ranks)"
    what = "resharding it with its optimizer state" if reshard else "as it was saved"
    return (
        f"{resume.path} was saved at {old}; this world of {world} ranks runs TP {tp} x PP {pp} x DP "
        f"{world // (tp * pp)}{why}: {what}"
    )


def reshard_checkpoint(
    cfg: MegahetConfig, resume: Resume, rank: int, split: Sequence[int], root: Path | None = None
) -> Resume:
    """Rank 0 writes the resharded checkpoint for cfg's TP x PP and `split` into `root` (default
    train.save, else train.load's folder); every rank returns it (all ranks call this after the process
    groups start)."""
    p = cfg.parallel
    written = [None]
    if rank == 0:
        root = root if root is not None else Path(cfg.train.save or cfg.train.load).expanduser()
        try:
            folder, _, seconds = reshard_into(
                resume.path, resume.meta, root, p.tp, p.pp, optimizer=True, stage_layers=split
            )
            written = [(str(folder), seconds, None)]
        except ConfigError as err:
            written = [(None, 0.0, str(err))]
    dist.broadcast_object_list(written, src=0)
    folder, seconds, error = written[0]
    if error is not None:
        raise ConfigError(error)
    if rank == 0:
        print(f"megahet: resharded {resume.path} into {folder} in {seconds:.2f} s", flush=True)
    found = find_resume_in(Path(folder).parent)
    if found is None or found.path != Path(folder):
        raise ConfigError(f"train.load: the resharded checkpoint {folder} is not the latest of its folder")
    return found
