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
from pathlib import Path

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
)
from megahet.checkpointing.optimizer_state import load_into_engine
from megahet.checkpointing.safe_load import load_file
from megahet.compat.deepspeed_checkpoint import engine_loads_with, model_states_file
from megahet.config import ConfigError

TMP_PREFIX = "tmp_"
FORMAT_VERSION = 1


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


def _stateful_hooks(hooks: list) -> dict[str, object]:
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
"""The task's tokenizer model, copied into every checkpoint (export-hf ships it; reshard carries it)."""


def _copy_tokenizer(task, folder: Path) -> None:
    """Copy the task's tokenizer model file (Task.tokenizer_model, when it has one) into folder."""
    source = getattr(task, "tokenizer_model", None)
    if source is not None:
        shutil.copyfile(Path(source).expanduser(), folder / TOKENIZER)


def save(trainer, root: Path | None = None) -> tuple[Path, float]:
    """Save the trainer's state into `root` (default train.save; all ranks call it); returns (folder,
    seconds). Rank 0 adds the task's tokenizer model (tokenizer.model) and megahet.json, then publishes."""
    cfg, engine, layout = trainer.cfg, trainer.engine, trainer.layout
    t0 = time.perf_counter()
    root = Path(cfg.train.save).expanduser() if root is None else root
    tmp_tag = TMP_PREFIX + tag_name(trainer.iteration)
    tmp = root / tmp_tag
    if layout.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP_PREFIX + "*"):  # a crash mid-save left it: never complete, never loaded
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    dist.barrier()
    consumed = (
        trainer.start_sample + (trainer.iteration - trainer.start_iteration) * cfg.train.global_batch_size
    )
    client_state = {"megahet": {"iteration": trainer.iteration, "consumed_samples": consumed}}
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    hooks = {
        name: {"settings": _hook_settings(h), "state": h.state_dict()}
        for name, h in _stateful_hooks(trainer.step_hooks).items()
    }
    torch.save({"rng": rng_states(), "hooks": hooks}, tmp / rank_file(layout.rank))
    dist.barrier()
    final = None
    if layout.rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "iteration": trainer.iteration,
            "consumed_samples": consumed,
            "layout": layout_of(cfg, layout.dp_size, layout.stage_layers),
            "world_size": layout.world_size,
            "model": dataclasses.asdict(cfg.model),
        }
        if trainer.task.vocab_size is not None:  # the tokenizer's: a reshard re-pads it for another TP
            meta["vocab_size"] = trainer.task.vocab_size
        _copy_tokenizer(trainer.task, tmp)  # before _publish: listed with its size, checked on load
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


def load(trainer, resume: Resume, resplit: bool = False) -> float:
    """Restore model, optimizer shards, LR schedule, RNG streams, data position and hook state; seconds.
    From a weights-only checkpoint: the weights, the step and the data position only. `resplit`: the
    stages were re-split in this process, which carries the RNG streams over itself."""
    t0 = time.perf_counter()
    engine = trainer.engine
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
    trainer.iteration = trainer.start_iteration = state["iteration"]
    trainer.start_sample = state["consumed_samples"]
    if weights_only:
        trainer.logger.print(
            f"megahet: {resume.path} is a weights-only checkpoint: loaded the weights, step {trainer.iteration} "
            f"and {trainer.start_sample} consumed samples; the optimizer (AdamW moments) and the LR schedule "
            f"restart from scratch (warmup again), RNG streams and step-hook state start fresh"
        )
        return time.perf_counter() - t0
    if per_parameter(resume):
        _load_per_parameter(trainer, resume, resplit)
        return time.perf_counter() - t0
    mine = load_file(resume.path / rank_file(trainer.layout.rank))
    set_rng_states(mine["rng"])
    for name, hook in _stateful_hooks(trainer.step_hooks).items():
        saved = mine["hooks"].get(name)
        if saved is None or not _same_settings(hook, saved["settings"]):
            trainer.logger.print(
                f"megahet: checkpoint has no {name} state for these settings: it starts fresh"
            )
            continue
        hook.load_state_dict(saved["state"])
    return time.perf_counter() - t0


def _load_per_parameter(trainer, resume: Resume, resplit: bool = False) -> None:
    """A resharded checkpoint: this TP x PP rank's fp32 masters, Adam moments and step, and the LR
    schedule; RNG streams and step hooks (whose state belongs to the old layout) start fresh, but for
    what a re-split carries over in memory (megahet/runtime/resplit.py)."""
    layout, engine = trainer.layout, trainer.engine
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
    trainer.logger.print(
        f"megahet: {resume.path} was resharded from {resume.meta['resharded_from']['layout']}: loaded the weights, "
        f"the optimizer state (fp32 masters, Adam moments, step {saved['step']}) and the LR schedule; {fresh}"
    )
