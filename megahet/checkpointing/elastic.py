"""Elastic resume (runtime): a checkpoint saved at another parallel layout is resharded, with its
optimizer state, to a TP x PP x DP that fits this world, and training continues on the loss curve.

A job restarted on fewer devices (a node lost, `torchrun --nnodes MIN:MAX --max-restarts N`), on more,
or with another --parallel.tp / --parallel.pp resumes from its last checkpoint with the same command:

1. `fit_layout` (policy, before any rank starts work) keeps the run's own TP x PP when it still fits
   the world (only DP changes: every rank's model shard stays the same). Otherwise it takes the
   largest TP' x PP' (TP' <= TP, PP' <= PP) that passes every check of the configuration at this
   world size (TP' divides the heads and the MLP, PP' the layers, DP' the global batch), preferring
   the larger TP' on a tie (TP groups sit inside a node, so a lost node costs pipeline stages first).
2. `read_resharded` (after the process groups start): every rank reads only its own slices of the saved
   checkpoint, in parallel, with no collective: the reshard plan (megahet/policy/reshard_plan.py)
   from the saved TP x PP x DP x ZeRO layout to the new one names, for each of its tensors (weights,
   fp32 masters, Adam moments: its new ZeRO fragments), the old rank that holds each run; it reads them
   from that rank's files, memory-mapped and one old rank at a time, straight into its new engine
   (built first, with its weights uninitialized: each run is copied from the file to the engine's own
   parameter, fp32 fragment or Adam moment), so its memory holds its own new shard once, not the
   model; then Adam's step, the learning rates and the LR schedule. Nothing is written; the saved
   checkpoint stays as it is.
   Where the plan cannot apply, `reshard_checkpoint` does what megahet did before: rank 0 merges the
   whole checkpoint per parameter (megahet/checkpointing/optimizer_state.py), re-splits it and
   publishes it beside the old one. That is a checkpoint already per parameter (a reshard's output),
   a GPT whose padded vocabulary changes with the TP degree, and a change of precision.

Why not a library's sharded checkpoint format (measured for issue 32): megatron-core 0.16's
`dist_checkpointing` saves only with CUDA and no longer describes flat ZeRO fragments
(`flattened_range` raises); torch.distributed.checkpoint reshards on CPU, but its file reader reads
each saved chunk whole before cutting a slice (193 MiB above the target to load a quarter of a 200 MiB
tensor), and either would be a second format beside the DeepSpeed files every tool reads. DeepSpeed's
own files, memory-mapped (`torch.load(mmap=True)`), give each rank exactly the pages it copies.

The resharded run's gradients are reduced in another order (other DP and TP groups), so it follows
the uninterrupted run within fp32 reduction noise. RNG streams and step-hook state (the balancer's
speed samples and plan) belong to the old layout and start fresh.

    resumed = read_resharded(cfg, resume, layout, split)    # None: use reshard_checkpoint
    progress, note = resumed.restore(trainer)                # read into the new Trainer's engine
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megahet.checkpointing.checkpoint import Progress
from megahet.checkpointing.convert import reshard_into
from megahet.checkpointing.finder import (
    Resume,
    describe_layout,
    find_resume_in,
    layout_of,
    per_parameter,
    zero_ranks,
)
from megahet.checkpointing.optimizer_state import prepare_adam
from megahet.checkpointing.safe_load import load_file
from megahet.checkpointing.sharded_state import (
    checkpoint_params,
    read_planned_state,
    saved_layout,
    saved_scalars,
)
from megahet.checkpointing.state_slices import Flat, check_holds_every_parameter, engine_state
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import validate
from megahet.models.gpt import padded_vocab_size
from megahet.policy.reshard_plan import (
    KEYS,
    WEIGHT,
    WORD_EMBEDDING,
    Layout,
    Param,
    ReshardPlan,
    State,
    rank_holdings,
    reshard_plan,
)


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


@dataclasses.dataclass
class ResumedState:
    """One rank's state at the new layout, to be read from its own slices of the old ranks' files
    (`read_resharded`): `restore` reads it straight into the new Trainer's engine, `read` into new tensors."""

    folder: Path
    params: Sequence[Param]
    plan: ReshardPlan
    rank: int
    dtypes: dict[str, torch.dtype]
    scalars: dict
    progress: Progress
    source: str
    """What was saved, for the note: the old layout."""

    @property
    def holdings(self) -> State:
        return rank_holdings(self.params, self.plan.new, self.rank, self.plan.blocks)

    def read(self, into: Flat | None = None) -> Flat:
        """This rank's state: weights, fp32 masters and Adam moments per (tensor, key), flat."""
        return read_planned_state(self.folder, self.params, self.plan, self.rank, self.dtypes, into)

    def restore(self, trainer) -> tuple[Progress, str]:
        """Read the state into the new Trainer's engine, built with its weights uninitialized: each run
        goes from the memory-mapped file to the engine's own parameter, fp32 fragment or Adam moment
        (made unfilled), so the rank never holds its state twice (no copy beside the engine, no zeros
        beside the read); (the saved progress, what was restored)."""
        t0 = time.perf_counter()
        engine, holdings = trainer.engine, self.holdings
        check_holds_every_parameter(engine.module, holdings)
        prepare_adam(engine, self.scalars["step"], self.scalars["lr"], written=True)
        with torch.no_grad():
            state = self.read(into=engine_state(engine, holdings))
        if self.scalars["lr_scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(self.scalars["lr_scheduler"])
        if self.scalars["global_steps"] is not None:
            engine.global_steps = self.scalars["global_steps"]
        mine = sum(t.numel() * t.element_size() for t in state.values())
        sources = len({t.src for t in self.plan.received_by(self.rank)})
        return self.progress, (
            f"read its own slices of {self.folder} ({mine / 2**20:.1f} MiB: weights, fp32 masters and Adam "
            f"moments, from {sources} saved rank(s)) into the new engine in {time.perf_counter() - t0:.2f} s, "
            f"resharded from {self.source}; RNG streams and step-hook state start fresh"
        )


def _weight_dtype(folder: Path) -> torch.dtype:
    module = load_file(folder / model_states_file(0), mmap=True)["module"]
    return next(t.dtype for t in module.values() if torch.is_tensor(t) and t.is_floating_point())


def read_resharded(cfg: MegahetConfig, resume: Resume, layout, split: Sequence[int]) -> ResumedState | None:
    """This rank's state at cfg's layout (`layout`: this rank's place in it; `split`: its layers per stage),
    read from its own slices of the checkpoint `resume` saved at another layout; None where the reshard
    plan does not apply (see the module docstring): the caller reshards on rank 0."""
    meta, folder = resume.meta, resume.path
    if meta.get("weights_only") or per_parameter(resume) or "layout" not in meta or "model" not in meta:
        return None
    params = checkpoint_params(folder, meta)
    old = saved_layout(meta)
    dp = zero_ranks(cfg, layout.dp_size)  # DP x CP: CP ranks hold ZeRO partitions as DP ranks do
    new = Layout(layout.tp_size, layout.pp_size, dp, tuple(split), tied=old.tied)
    rows = {p.name: p.shape[0] for p in params}.get(WORD_EMBEDDING)
    vocab, m = meta.get("vocab_size"), cfg.model
    if rows is not None and (
        vocab is None or padded_vocab_size(vocab, m.make_vocab_size_divisible_by, new.tp) != rows
    ):
        return None  # the padded vocabulary changes with the TP degree
    weight = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    if _weight_dtype(folder) != weight:
        return None  # another precision: the weights come from the fp32 masters (rank 0's path)
    plan = reshard_plan(params, old, new, keep=False)
    dtypes = {key: weight if key == WEIGHT else torch.float32 for key in KEYS}
    progress = Progress(meta["iteration"], meta["consumed_samples"])
    source = f"{describe_layout(meta['layout'])} x DP {old.dp}"
    return ResumedState(
        folder, params, plan, layout.rank, dtypes, saved_scalars(folder, meta), progress, source
    )
