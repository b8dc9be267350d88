"""Find the checkpoint a run resumes from, and check that it fits the run: complete (every file at its
saved size), the same model and vocabulary, a sharding this run can load.

Role: runtime (resume: what set-up decides before any rank loads; megahet/run_plan.py calls it).

    resume = find_resume(cfg)                 # train.load's `latest`, or the newest complete checkpoint
    check_model(resume, cfg, vocab_size)      # one-line ConfigErrors naming the file and the fix
    check_compatible(resume, cfg, dp, split)

A checkpoint's layout is docs/checkpoints.md's; saving and loading are megahet/checkpointing/checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import stage_split

LATEST, META = "latest", "megahet.json"


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
    complete = complete_checkpoints(root) if root.is_dir() else []
    newest = complete[-1] if complete else None
    note = None
    if named is not None and (named / META).is_file():
        path = named
        if newest is not None and saved_iteration(newest) > (saved_iteration(named) or 0):
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
    """A recorded ModelConfig's settings that shape the weights (an unset ffn_hidden_size as its size; with
    rotary positions the sequence length shapes nothing: a model trains on at another length)."""
    shaping = {k: v for k, v in model.items() if k not in MODEL_SETTINGS_FREE}
    if shaping.get("position_embedding_type") == "rope":
        shaping.pop("seq_length", None)
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
    they are uneven (`split`: the run's, default parallel.stage_layers or even). `dp` counts the ranks
    ZeRO partitions over: DP x CP with context parallelism (`zero_ranks`), whose ranks hold the same
    weights and their own ZeRO partitions, as DP ranks do: a checkpoint does not depend on CP."""
    p = cfg.parallel
    split = stage_split(cfg) if split is None else split
    return {"tp": p.tp, "pp": p.pp, "dp": dp, "zero_stage": p.zero_stage, **split_entry(split)}


def zero_ranks(cfg: MegahetConfig, dp: int) -> int:
    """The ranks ZeRO partitions the optimizer state over: DP x CP (DeepSpeed's sequence-data-parallel
    group, megahet/parallel.py), in megatron-core's rank order the index dp x cp + cp_rank."""
    return dp * cfg.parallel.cp


def split_entry(split) -> dict:
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


def saved_iteration(path: Path) -> int | None:
    """The step a checkpoint folder's megahet.json records; None if it is absent or unreadable."""
    try:
        return int(json.loads((path / META).read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints in root (a readable megahet.json), oldest first (by iteration, then by save
    order)."""
    found = [(step, p) for p in root.glob("iter_*") if (step := saved_iteration(p)) is not None]
    return [p for _, p in sorted(found, key=lambda item: (item[0], item[1].stat().st_mtime))]
