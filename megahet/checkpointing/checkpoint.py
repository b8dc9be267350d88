"""Save and resume training through DeepSpeed checkpoints, atomically (see docs/checkpoints.md).

Role: runtime (save and resume).

    --train.save DIR --train.save_interval N   # every N steps and at the end
    --train.load DIR                           # resume from DIR's latest checkpoint

A checkpoint is the folder DIR/iter_NNNNNNN: DeepSpeed's files (model states per TP x PP rank with
megahet's client state, ZeRO optimizer shards per rank, LR schedule), one megahet_rank_RRRRR.pt per
rank (python / numpy / torch / CUDA / megatron-core tracker RNG states, and the step hooks' state,
e.g. the ResizeController), the task's tokenizer model as tokenizer.model (GPT: the checkpoint is
self-contained for export-hf), and megahet.json (iteration, consumed samples, layout, every file's size).
Every rank writes into DIR/tmp_iter_NNNNNNN; after a barrier rank 0 writes megahet.json, renames the
folder into place, then points DIR/latest at it (tmp file + os.replace), and only then applies
train.keep_last. A crash at any moment leaves the previous checkpoint loadable.

A weights-only checkpoint (`tools/convert_checkpoint.py reshard`, `save_weights_only`) has only the
model states per TP x PP rank and a megahet.json with "weights_only": true; it loads under any DP
size and ZeRO stage with its own TP x PP, restoring the weights, the step and the consumed samples,
while the optimizer, LR schedule, RNG streams and step hooks start fresh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megahet.checkpointing.finder import (
    LATEST,
    META,
    Resume,
    complete_checkpoints,
    layout_of,
    per_parameter,
    rank_file,
    split_entry,
    tag_name,
    zero_ranks,
)
from megahet.checkpointing.optimizer_state import load_into_engine
from megahet.checkpointing.safe_load import load_file
from megahet.compat.deepspeed_checkpoint import engine_loads_with, model_states_file
from megahet.config import ConfigError, MegahetConfig
from megahet.data.tokenizer import tokenizer_files
from megahet.parallel import ParallelLayout
from megahet.runtime.hooks import StepHook

TMP_PREFIX = "tmp_"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where training stands: the last step done and the samples consumed up to it."""

    iteration: int
    consumed_samples: int

    def advanced(self, steps: int, global_batch_size: int) -> Progress:
        return Progress(self.iteration + steps, self.consumed_samples + steps * global_batch_size)


@dataclasses.dataclass(frozen=True)
class Restore:
    """State moved or read for a stage about to be built (a re-split, a parallel elastic read), loaded in
    two parts so that no rank holds its weights twice: `weights(model)` writes them into the freshly built
    model before DeepSpeed's engine is made from it (and drops its own copy; None: `state` writes them
    too); `state(trainer)` writes the rest (fp32 masters, Adam moments, schedule, step) into the engine
    -> (the progress, what was restored)."""

    weights: Callable[[torch.nn.Module], None] | None
    state: Callable[[Any], tuple[Progress, str]]


@dataclasses.dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint saves and restores, named: the DeepSpeed engine (model, ZeRO optimizer shards,
    LR schedule), the step hooks (those `checkpointed` keep their state), and what megahet.json records
    of the run. The Trainer hands these over (`Trainer.checkpoint_parts`); nothing else of it is read."""

    cfg: MegahetConfig
    layout: ParallelLayout
    engine: Any
    hooks: Sequence[StepHook] = ()
    vocab_size: int | None = None
    """The tokenizer's vocabulary (recorded: a reshard re-pads it for another TP)."""
    tokenizer_model: str | None = None
    """The task's tokenizer model file, copied into the checkpoint as tokenizer.model."""
    say: Callable[[str], None] = print
    """Where loading says what it restored and what starts fresh (rank 0's logger)."""


# --- per-rank state: RNG streams and step hooks -----------------------------------------------------


def rng_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": _plain_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _plain_numpy_state(state: tuple) -> tuple:
    """NumPy's global RNG state with its key as a list of ints (loads without NumPy's pickled types)."""
    name, key, *rest = state
    return (name, key.tolist(), *rest)


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def _hook_settings(hook) -> dict | None:
    """The settings a hook's state belongs to (its `cfg` dataclass, e.g. ResizeConfig), if any."""
    cfg = getattr(hook, "cfg", None)
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None


def _same_settings(hook, saved: dict | None) -> bool:
    """Whether the hook's settings are the saved ones, but for those it names in `settings_free`
    (which do not shape its state, e.g. where a trace is written)."""
    free = getattr(hook, "settings_free", ())

    def shaping(settings: dict | None) -> dict | None:
        return None if settings is None else {k: v for k, v in settings.items() if k not in free}

    return shaping(_hook_settings(hook)) == shaping(saved)


def _stateful_hooks(hooks: Sequence[StepHook]) -> dict[str, StepHook]:
    return {type(h).__name__: h for h in hooks if h.checkpointed}


# --- save and load ----------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _publish(tmp: Path, meta: dict) -> Path:
    """Complete the checkpoint written into tmp (DIR/tmp_iter_NNNNNNN): write its megahet.json (with
    every file's size), rename it to DIR/iter_NNNNNNN (or iter_NNNNNNN_2, ... when that step exists),
    then point DIR/latest at it. Returns the final folder."""
    root, tag = tmp.parent, tag_name(meta["iteration"])
    final, suffix = root / tag, 1
    while final.exists():  # the same step saved again (a resumed run): keep both
        suffix += 1
        final = root / f"{tag}_{suffix}"
    meta = {**meta, "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}}
    _write_atomic(tmp / META, json.dumps(meta, indent=1))
    os.rename(tmp, final)
    _write_atomic(root / LATEST, final.name)
    return final


TOKENIZER = "tokenizer.model"
TOKENIZER_FILES = (TOKENIZER, "tokenizer.json", "tokenizer_config.json")
"""What a checkpoint may carry of its run's tokenizer (megahet.data.tokenizer.tokenizer_files): a
SentencePiece model, or a Hugging Face tokenizer.json with its config."""
"""The task's tokenizer model, copied into every checkpoint (export-hf ships it; reshard carries it)."""


def save(parts: CheckpointParts, progress: Progress, root: Path | None = None) -> tuple[Path, float]:
    """Save `parts` at `progress` into `root` (default train.save; all ranks call it); returns (folder,
    seconds). Rank 0 adds the task's tokenizer model (tokenizer.model) and megahet.json, then publishes."""
    cfg, engine, layout = parts.cfg, parts.engine, parts.layout
    t0 = time.perf_counter()
    root = Path(cfg.train.save).expanduser() if root is None else root
    tmp_tag = TMP_PREFIX + tag_name(progress.iteration)
    tmp = root / tmp_tag
    if layout.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP_PREFIX + "*"):  # a crash mid-save left it: never complete, never loaded
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    dist.barrier()
    client_state = {"megahet": dataclasses.asdict(progress)}
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    hooks = {
        name: {"settings": _hook_settings(h), "state": h.state_dict()}
        for name, h in _stateful_hooks(parts.hooks).items()
    }
    torch.save({"rng": rng_states(), "hooks": hooks}, tmp / rank_file(layout.rank))
    dist.barrier()
    final = None
    if layout.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            **dataclasses.asdict(progress),
            "layout": {
                **layout_of(cfg, zero_ranks(cfg, layout.dp_size), layout.stage_layers),
                **({"strided": True} if layout.strided else {}),  # which rank holds which shard
            },
            "context_parallel": cfg.parallel.cp,
            "world_size": layout.world_size,
            "model": dataclasses.asdict(cfg.model),
        }
        if parts.vocab_size is not None:  # the tokenizer's: a reshard re-pads it for another TP
            meta["vocab_size"] = parts.vocab_size
        if parts.tokenizer_model is not None:  # before _publish: listed with their sizes, checked on load
            for name, file in tokenizer_files(parts.tokenizer_model).items():
                shutil.copyfile(file, tmp / name)
        final = _publish(tmp, meta)
        keep = cfg.train.keep_last
        if keep > 0:
            for old in complete_checkpoints(root)[:-keep]:
                if old != final:
                    shutil.rmtree(old)
    name = [final.name if final is not None else None]
    dist.broadcast_object_list(name, src=0)  # rank 0 chose the name; also the final barrier
    return root / name[0], time.perf_counter() - t0


def optimizer_file(mp_rank: int) -> str:
    """A resharded checkpoint's per-parameter optimizer state of one TP x PP rank (megahet/checkpointing/optimizer_state.py)."""
    return f"megahet_optimizer_mp_rank_{mp_rank:02d}.pt"


def save_weights_only(
    root: Path,
    stages: list[list[dict]],
    *,
    iteration: int,
    consumed_samples: int,
    meta: dict,
    optimizer: list[list[dict]] | None = None,
    files: dict[str, Path] | None = None,
    stage_layers: tuple[int, ...] | None = None,
) -> Path:
    """Write a weights-only checkpoint into root (a new folder, or one holding other checkpoints):
    stages[pp_rank][tp_rank] is that rank's module state dict (stage-local names, as the model's
    state_dict() names them). Only DeepSpeed's model states files and megahet.json ("weights_only":
    true, layout TP x PP, plus `meta`); `latest` names it. With `optimizer` ([pp_rank][tp_rank]: the
    per-parameter fp32 masters, Adam moments and step, LR schedule) it also writes those, and it is a
    full checkpoint at any DP size ("optimizer": "per_parameter"). `files`: more files to copy in, by
    name (e.g. the tokenizer model). `stage_layers`: the layers per stage, recorded when uneven.
    Returns the checkpoint folder."""
    tp, pp = len(stages[0]), len(stages)
    tmp = root / (TMP_PREFIX + tag_name(iteration))
    if tmp.is_dir():  # left by a crash mid-write: never complete, never loaded
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    client_state = {"megahet": {"iteration": iteration, "consumed_samples": consumed_samples}}
    for pp_rank, shards in enumerate(stages):
        for tp_rank, module in enumerate(shards):
            # what engine.load_checkpoint(load_module_only=True) reads: module, dp_world_size, client state
            states = {"module": module, "dp_world_size": None, "mp_world_size": tp * pp, **client_state}
            torch.save(states, tmp / model_states_file(pp_rank * tp + tp_rank))
            if optimizer is not None:
                torch.save(optimizer[pp_rank][tp_rank], tmp / optimizer_file(pp_rank * tp + tp_rank))
    for name, source in (files or {}).items():
        shutil.copyfile(source, tmp / name)
    header = {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "weights_only": optimizer is None,
        "layout": {"tp": tp, "pp": pp, **split_entry(stage_layers)},
    }
    if optimizer is not None:
        header["optimizer"] = "per_parameter"
    return _publish(tmp, {**header, **meta})


def load(parts: CheckpointParts, resume: Resume, resplit: bool = False) -> tuple[Progress, float]:
    """Restore model, optimizer shards, LR schedule, RNG streams and hook state into `parts`; returns the
    saved progress (step, data position) and the seconds taken. From a weights-only checkpoint: the
    weights and the progress only. `resplit`: the stages were re-split in this process, which carries
    the RNG streams over itself."""
    t0 = time.perf_counter()
    engine = parts.engine
    weights_only = bool(resume.meta.get("weights_only"))
    with engine_loads_with(engine, load_file):  # DeepSpeed's reads, safe and naming a bad file
        # load_module_only: DeepSpeed then copies the loaded weights into ZeRO's fp32 master partitions
        load_path, client_state = engine.load_checkpoint(
            str(resume.path.parent),
            tag=resume.path.name,
            load_module_only=weights_only or per_parameter(resume),
        )
    if load_path is None:
        raise ConfigError(f"train.load: DeepSpeed found no model states in checkpoint {resume.path}")
    state = client_state["megahet"]
    progress = Progress(state["iteration"], state["consumed_samples"])
    if weights_only:
        parts.say(
            f"megahet: {resume.path} is a weights-only checkpoint: loaded the weights, step {progress.iteration} "
            f"and {progress.consumed_samples} consumed samples; the optimizer (AdamW moments) and the LR schedule "
            f"restart from scratch (warmup again), RNG streams and step-hook state start fresh"
        )
    elif per_parameter(resume):
        _load_per_parameter(parts, resume, resplit)
    else:
        mine = load_file(resume.path / rank_file(parts.layout.rank))
        set_rng_states(mine["rng"])
        for name, hook in _stateful_hooks(parts.hooks).items():
            saved = mine["hooks"].get(name)
            if saved is None or not _same_settings(hook, saved["settings"]):
                parts.say(f"megahet: checkpoint has no {name} state for these settings: it starts fresh")
                continue
            hook.load_state_dict(saved["state"])
    return progress, time.perf_counter() - t0


def _load_per_parameter(parts: CheckpointParts, resume: Resume, resplit: bool = False) -> None:
    """A resharded checkpoint: this TP x PP rank's fp32 masters, Adam moments and step, and the LR
    schedule; RNG streams and step hooks (whose state belongs to the old layout) start fresh, but for
    what a re-split carries over in memory (megahet/runtime/resplit.py)."""
    layout, engine = parts.layout, parts.engine
    saved = load_file(resume.path / optimizer_file(layout.pp_rank * layout.tp_size + layout.tp_rank))
    load_into_engine(engine, saved)
    if saved.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if saved.get("global_steps") is not None:
        engine.global_steps = saved["global_steps"]
    fresh = (
        "RNG streams and the balancers' state carry over (megahet/runtime/resplit.py)"
        if resplit
        else "RNG streams and step-hook state (the balancer's) start fresh"
    )
    parts.say(
        f"megahet: {resume.path} was resharded from {resume.meta['resharded_from']['layout']}: loaded the weights, "
        f"the optimizer state (fp32 masters, Adam moments, step {saved['step']}) and the LR schedule; {fresh}"
    )
