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
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megahet.checkpointing.optimizer_state import load_into_engine
from megahet.checkpointing.safe_load import load_file
from megahet.compat.deepspeed_checkpoint import engine_loads_with, model_states_file
from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import stage_split

LATEST, META, TMP_PREFIX = "latest", "megahet.json", "tmp_"
FORMAT_VERSION = 1


@dataclasses.dataclass
class Resume:
    """A complete checkpoint to resume from."""

    path: Path
    """The checkpoint folder (DIR/<tag>)."""
    meta: dict
    note: str | None = None
    """Why this checkpoint rather than the one `latest` names (a missing or stale `latest`), to print."""

    @property
    def iteration(self) -> int:
        return self.meta["iteration"]

    @property
    def consumed_samples(self) -> int:
        return self.meta["consumed_samples"]


def tag_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file(rank: int) -> str:
    return f"megahet_rank_{rank:05d}.pt"


def find_resume(cfg: MegahetConfig) -> Resume | None:
    """The checkpoint train.load names (its `latest`), checked for completeness; None to start fresh.

    Without a `latest`, or when it names an incomplete or absent folder, the newest complete checkpoint
    is resumed, and `Resume.note` says so (progress is never dropped silently). A missing folder, or one
    with no complete checkpoint, is a ConfigError, except when train.load is also train.save and the
    folder holds no checkpoint at all: then it means "start fresh" (one command line for the first run
    and every restart).
    """
    load = cfg.train.load
    if not load:
        return None
    root = Path(load).expanduser()
    fresh_ok = cfg.train.save is not None and Path(cfg.train.save).expanduser().resolve() == root.resolve()
    return find_resume_in(root, fresh_ok=fresh_ok)


def find_resume_in(root: Path, fresh_ok: bool = False) -> Resume | None:
    """The checkpoint `root`'s `latest` names, as find_resume (fresh_ok: an empty folder means None)."""
    load = str(root)
    latest = root / LATEST
    named = root / latest.read_text().strip() if latest.is_file() else None
    complete = _checkpoints(root) if root.is_dir() else []
    newest = complete[-1] if complete else None
    note = None
    if named is not None and (named / META).is_file():
        path = named
        if newest is not None and _iteration(newest) > (_iteration(named) or 0):
            note = (
                f"{latest} names {named.name}, and the newer complete checkpoint {newest.name} exists: "
                f"resuming from {named.name} as {LATEST} says (write {newest.name} into it to resume from there)"
            )
    elif newest is not None:  # no `latest`, or a stale one: the newest complete checkpoint, said aloud
        why = f"{latest} is missing" if named is None else f"{latest} names {named.name}, which is incomplete"
        path, note = newest, f"{why}: resuming from the newest complete checkpoint {newest}"
    elif named is not None:
        raise ConfigError(
            f"train.load: checkpoint {named} (named by {latest}) is incomplete: {named / META} missing, and "
            f"{root} holds no complete checkpoint: start fresh without --train.load"
        )
    elif fresh_ok:
        return None
    else:
        what = "not found" if not root.is_dir() else f"has no checkpoint ({latest} missing)"
        raise ConfigError(
            f"train.load: checkpoint directory {load} {what}: point it at a folder written by --train.save "
            f"(or set train.save to the same folder to start fresh when it has none)"
        )
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(
            f"train.load: checkpoint file {meta_file} is corrupt (not megahet's JSON)"
        ) from None
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise ConfigError(f"train.load: checkpoint file {file} is missing")
        if file.stat().st_size != size:
            raise ConfigError(
                f"train.load: checkpoint file {file} is truncated or corrupt ({file.stat().st_size} bytes, "
                f"{size} were saved): resume from another checkpoint"
            )
    return Resume(path, meta, note)


MODEL_SETTINGS_FREE = (
    "hidden_dropout", "attention_dropout", "init_method_std", "layernorm_epsilon", "attention",
)  # fmt: skip
"""Model settings a resumed run may change (regularization, initialization, numerics, the attention kernel):
the rest shape the weights."""


def _shaping_settings(model: dict) -> dict:
    """A recorded ModelConfig's settings that shape the weights (an unset ffn_hidden_size as its size)."""
    shaping = {k: v for k, v in model.items() if k not in MODEL_SETTINGS_FREE}
    if shaping.get("ffn_hidden_size") is None and "hidden_size" in shaping:
        shaping["ffn_hidden_size"] = 4 * shaping["hidden_size"]
    return shaping


def check_model(resume: Resume, cfg: MegahetConfig, vocab_size: int | None) -> None:
    """The checkpoint must hold this run's model: the same shaping model settings (when it records
    them) and vocabulary (`vocab_size`: this run's tokenizer's; None for a task without one, e.g. ViT)."""
    saved = resume.meta.get("model")
    if saved is not None:
        recorded, now = _shaping_settings(saved), _shaping_settings(dataclasses.asdict(cfg.model))
        for key, value in now.items():
            if key in recorded and recorded[key] != value:
                raise ConfigError(
                    f"train.load: checkpoint {resume.path} holds another model (model.{key} {recorded[key]}, "
                    f"this run has {value}): resume with the run's own --model settings, or start fresh "
                    f"without --train.load"
                )
    if "vocab_size" not in resume.meta and saved is None:  # saved before megahet recorded either
        return
    saved_vocab = resume.meta.get("vocab_size")
    if (saved_vocab is None) != (vocab_size is None):
        kind = "a model with a vocabulary (GPT)" if saved_vocab is not None else "a model without one (ViT)"
        raise ConfigError(
            f"train.load: checkpoint {resume.path} holds {kind}, not this task's: load it with its own script"
        )
    if saved_vocab != vocab_size:
        raise ConfigError(
            f"train.load: checkpoint {resume.path} was trained with a vocabulary of {saved_vocab} tokens, this "
            f"run's tokenizer has {vocab_size}: resume with the run's tokenizer (data.tokenizer_model / "
            f"data.vocab_size)"
        )


def per_parameter(resume: Resume) -> bool:
    """A resharded checkpoint: its optimizer state is per parameter (loads at any DP and ZeRO stage)."""
    return resume.meta.get("optimizer") == "per_parameter"


def layout_of(cfg: MegahetConfig, dp: int, split: Sequence[int] | None = None) -> dict:
    """The sharding a checkpoint records: TP x PP x DP, the ZeRO stage, and the layers per stage when
    they are uneven (`split`: the run's, default parallel.stage_layers or even)."""
    p = cfg.parallel
    split = stage_split(cfg) if split is None else split
    return {"tp": p.tp, "pp": p.pp, "dp": dp, "zero_stage": p.zero_stage, **_split_entry(split)}


def _split_entry(split) -> dict:
    """{"stage_layers": [...]} for an uneven split, {} for an even one (which older checkpoints imply)."""
    return {"stage_layers": list(split)} if split is not None and len(set(split)) > 1 else {}


def describe_layout(layout: dict) -> str:
    split = f" (layers {','.join(map(str, layout['stage_layers']))})" if "stage_layers" in layout else ""
    return f"TP {layout['tp']} x PP {layout['pp']}{split}"


def check_compatible(resume: Resume, cfg: MegahetConfig, dp: int, split: Sequence[int] | None = None) -> None:
    """The checkpoint's sharding must be this run's (`split`: its layers per stage, default from cfg):
    DeepSpeed's files are per TP x PP x DP rank. A weights-only checkpoint has no optimizer shards, and
    a resharded one keeps its optimizer state per parameter: for those only TP x PP must match."""
    saved, now = resume.meta["layout"], layout_of(cfg, dp, split)
    split = f" --stage-layers {','.join(map(str, now['stage_layers']))}" if "stage_layers" in now else ""
    reshard = f"reshard it with tools/convert_checkpoint.py reshard --tp {now['tp']} --pp {now['pp']}{split}"
    model_parallel = ("tp", "pp", "stage_layers")
    same_model_parallel = all(saved.get(k) == now.get(k) for k in model_parallel)
    if resume.meta.get("weights_only") or per_parameter(resume):
        if not same_model_parallel:
            kind = "weights-only" if resume.meta.get("weights_only") else "resharded"
            raise ConfigError(
                f"train.load: {kind} checkpoint {resume.path} is laid out for {describe_layout(saved)}, this run is "
                f"{describe_layout(now)}: {reshard}"
            )
        return
    if saved != now:

        def fmt(layout: dict) -> str:
            return f"{describe_layout(layout)} x DP {layout['dp']}, ZeRO-{layout['zero_stage']}"

        also = "" if same_model_parallel else f", or {reshard} (weights only: the optimizer restarts)"
        raise ConfigError(
            f"train.load: checkpoint {resume.path} was saved with {fmt(saved)}, this run is {fmt(now)}: "
            f"resume with the same parallel layout{also}"
        )


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


def _iteration(path: Path) -> int | None:
    """The step a checkpoint folder's megahet.json records; None if it is absent or unreadable."""
    try:
        return int(json.loads((path / META).read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints in root (a readable megahet.json), oldest first (by iteration, then by save
    order)."""
    found = [(step, p) for p in root.glob("iter_*") if (step := _iteration(p)) is not None]
    return [p for _, p in sorted(found, key=lambda item: (item[0], item[1].stat().st_mtime))]


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
            for old in _checkpoints(root)[:-keep]:
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
        "layout": {"tp": tp, "pp": pp, **_split_entry(stage_layers)},
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
