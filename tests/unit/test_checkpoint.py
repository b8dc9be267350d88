"""Tests of megahet.checkpointing.checkpoint on one rank: finding the checkpoint to resume (one-line errors for a
missing folder, no checkpoint, an incomplete or truncated one, another parallel layout), a real
DeepSpeed save / load round trip on a toy model (weights, AdamW moments, LR schedule, RNG streams,
data position, step-hook state) that continues exactly like the uninterrupted run, atomic saves
(a crash mid-save leaves the previous checkpoint loadable), keep_last retention, re-saving a step,
a corrupt DeepSpeed file named in the error, and weights-only checkpoints (what reshard writes): any
DP / ZeRO stage accepted, another TP x PP refused naming the reshard command, and a load that restores
weights, step and data position with a fresh optimizer and LR schedule whose next step equals that
of a new run started from the same weights.

Run: ``python -m pytest tests/unit/test_checkpoint.py -q`` (about 10 s, mostly imports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from one_line import one_line

from megahet.checkpointing import checkpoint, finder
from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.config_checks import validate
from megahet.engine import build_engine
from megahet.runtime.hooks import StepHook


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x))).pow(2).mean()


@dataclasses.dataclass
class _HookSettings:
    mode: str = "a"


class _CountingHook(StepHook):
    """A stateful step hook (as the ResizeController): counts steps; state must survive a resume."""

    checkpointed = True

    def __init__(self, mode: str = "a"):
        self.cfg, self.count = _HookSettings(mode), 0

    def after_step(self, engine):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _cfg(tmp: Path, **overrides: object) -> MegahetConfig:
    base = {
        "train.global_batch_size": 4,
        "train.micro_batch_size": 4,
        "train.lr": 1e-2,
        "train.lr_warmup_iters": 3,
        "train.train_iters": 10,
        "train.save": str(tmp / "ck"),
    }
    return apply_overrides(MegahetConfig(), {**base, **overrides})


def _trainer(cfg: MegahetConfig, layout, hook_mode: str = "a"):
    torch.manual_seed(0)
    model = _Toy()
    engine = build_engine(cfg, model, 1, {})
    messages: list[str] = []
    logger = types.SimpleNamespace(print=messages.append)
    return types.SimpleNamespace(
        cfg=cfg,
        engine=engine,
        layout=layout,
        iteration=0,
        start_iteration=0,
        start_sample=0,
        step_hooks=[_CountingHook(hook_mode)],
        task=types.SimpleNamespace(vocab_size=1000),  # recorded for resharding
        logger=logger,
        messages=messages,
    )


def _parts(trainer) -> checkpoint.CheckpointParts:
    return checkpoint.CheckpointParts(
        trainer.cfg, trainer.layout, trainer.engine, trainer.step_hooks, trainer.task.vocab_size,
        say=trainer.logger.print,
    )  # fmt: skip


def _save(trainer, root: Path | None = None) -> tuple[Path, float]:
    start = checkpoint.Progress(trainer.start_iteration, trainer.start_sample)
    progress = start.advanced(
        trainer.iteration - trainer.start_iteration, trainer.cfg.train.global_batch_size
    )
    return checkpoint.save(_parts(trainer), progress, root)


def _load(trainer, resume: finder.Resume) -> float:
    """checkpoint.load into the fake trainer's parts; it goes on from the loaded progress."""
    progress, seconds = checkpoint.load(_parts(trainer), resume)
    trainer.iteration = trainer.start_iteration = progress.iteration
    trainer.start_sample = progress.consumed_samples
    return seconds


def _steps(trainer, n: int) -> list[float]:
    """n training steps whose data and noise come from the RNG streams (so those must be restored)."""
    losses = []
    for _ in range(n):
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        x = x.to(next(trainer.engine.module.parameters()).dtype)  # bf16 runs take bf16 inputs
        trainer.engine.zero_grad()
        loss = trainer.engine(x)
        loss.backward()
        trainer.engine.step()
        trainer.iteration += 1
        for hook in trainer.step_hooks:
            hook.after_step(trainer.engine)
        losses.append(loss.item())
    return losses


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}


# --- find_resume / check_compatible (no process group) ---------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"train.save": None, "train.save_interval": 5}, ["train.save_interval 5", "train.save"]),
        ({"train.keep_last": -1}, ["train.keep_last", ">= 0"]),
        ({"train.save_interval": -2}, ["train.save_interval", ">= 0"]),
    ],
)
def test_checkpoint_keys_are_validated(tmp_path: Path, overrides: dict, needles: list[str]) -> None:
    validate(_cfg(tmp_path, **{"train.save_interval": 5, "train.keep_last": 2}), 1)
    with pytest.raises(ConfigError) as err:
        validate(_cfg(tmp_path, **overrides), 1)
    one_line(err, *needles)


def test_no_load_means_fresh(tmp_path: Path) -> None:
    assert finder.find_resume(_cfg(tmp_path)) is None
    assert finder.find_resume(_cfg(tmp_path)) is None


def test_missing_load_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        finder.find_resume(_cfg(tmp_path, **{"train.load": str(tmp_path / "nope")}))
    one_line(err, "train.load", "nope", "not found")


def test_dir_without_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        finder.find_resume(_cfg(tmp_path, **{"train.load": str(tmp_path / "empty")}))
    one_line(err, "empty", "has no checkpoint", "latest")


def test_load_equal_to_save_starts_fresh_when_empty(tmp_path: Path) -> None:
    """One command line for the first run and every restart: --train.save D --train.load D."""
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    assert finder.find_resume(cfg) is None  # the folder does not even exist yet
    (tmp_path / "ck").mkdir()
    assert finder.find_resume(cfg) is None


def _fake_checkpoint(root: Path, iteration: int = 4, files: dict[str, bytes] | None = None) -> Path:
    files = files if files is not None else {"a.pt": b"x" * 100}
    path = root / finder.tag_name(iteration)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    meta = {
        "iteration": iteration,
        "consumed_samples": iteration * 4,
        "layout": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1},
        "files": {name: len(data) for name, data in files.items()},
    }
    (path / finder.META).write_text(json.dumps(meta))
    (root / finder.LATEST).write_text(path.name)
    return path


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path / "ck")
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    assert finder.find_resume(cfg).iteration == 4
    assert finder.find_resume(cfg).consumed_samples == 16
    (path / "a.pt").write_bytes(b"x" * 60)
    with pytest.raises(ConfigError) as err:
        finder.find_resume(cfg)
    one_line(err, str(path / "a.pt"), "truncated")
    (path / "a.pt").unlink()
    with pytest.raises(ConfigError) as err:
        finder.find_resume(cfg)
    one_line(err, str(path / "a.pt"), "missing")


def test_incomplete_or_corrupt_metadata_is_named(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path / "ck")
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    (path / finder.META).write_text('{"iteration": 4, "fi')
    with pytest.raises(ConfigError) as err:
        finder.find_resume(cfg)
    one_line(err, str(path / finder.META), "corrupt")
    (path / finder.META).unlink()
    with pytest.raises(ConfigError) as err:
        finder.find_resume(cfg)
    one_line(err, str(path), "incomplete")


def test_missing_or_stale_latest_resumes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    """Never a silent restart from step 1: without `latest`, or with one naming an incomplete folder,
    the newest complete checkpoint is resumed and the note says why; one newer than `latest` is named."""
    root = tmp_path / "ck"
    cfg = _cfg(tmp_path, **{"train.load": str(root), "train.save": str(root)})  # the restart command line
    _fake_checkpoint(root, 2)
    newest = _fake_checkpoint(root, 6)
    (root / finder.LATEST).unlink()
    resume = finder.find_resume(cfg)
    assert (resume.path, resume.iteration, resume.consumed_samples) == (newest, 6, 24)
    assert "latest is missing" in resume.note and str(newest) in resume.note
    (root / "iter_0000008").mkdir()  # a crash before its megahet.json: incomplete
    (root / finder.LATEST).write_text("iter_0000008")
    resume = finder.find_resume(cfg)
    assert resume.path == newest and "iter_0000008, which is incomplete" in resume.note
    (root / finder.LATEST).write_text("iter_0000002")  # a hand-made rollback is obeyed, but said
    resume = finder.find_resume(cfg)
    assert resume.iteration == 2 and "newer complete checkpoint iter_0000006" in resume.note
    (root / finder.LATEST).write_text("iter_0000006")
    assert finder.find_resume(cfg).note is None


def test_latest_naming_an_incomplete_checkpoint_with_no_other_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    (root / "iter_0000004").mkdir(parents=True)
    (root / finder.LATEST).write_text("iter_0000004")
    with pytest.raises(ConfigError) as err:  # even with train.save = train.load: not a fresh start
        finder.find_resume(_cfg(tmp_path, **{"train.load": str(root), "train.save": str(root)}))
    one_line(err, "iter_0000004", "incomplete", "no complete checkpoint")


def test_other_parallel_layout_is_an_error(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "ck")
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck"), "parallel.tp": 2})
    resume = finder.find_resume(cfg)
    finder.check_compatible(resume, _cfg(tmp_path), dp=1)
    with pytest.raises(ConfigError) as err:
        finder.check_compatible(resume, cfg, dp=1)
    one_line(err, "TP 1 x PP 1 x DP 1", "TP 2 x PP 1 x DP 1", "same parallel layout", "reshard --tp 2 --pp 1")
    with pytest.raises(ConfigError) as err:  # only DP differs: resharding would not help
        finder.check_compatible(resume, _cfg(tmp_path), dp=2)
    one_line(err, "TP 1 x PP 1 x DP 2", "same parallel layout")
    assert "reshard" not in str(err.value)


def test_weights_only_checkpoint_needs_only_the_same_tp_pp(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path / "ck")
    meta = json.loads((path / finder.META).read_text())
    meta.update(weights_only=True, layout={"tp": 1, "pp": 1})
    (path / finder.META).write_text(json.dumps(meta))
    resume = finder.find_resume(_cfg(tmp_path, **{"train.load": str(tmp_path / "ck")}))
    finder.check_compatible(resume, _cfg(tmp_path, **{"parallel.zero_stage": 2}), dp=4)
    with pytest.raises(ConfigError) as err:
        finder.check_compatible(resume, _cfg(tmp_path, **{"parallel.pp": 2}), dp=1)
    one_line(
        err,
        "weights-only checkpoint",
        "TP 1 x PP 1, this run is TP 1 x PP 2",
        "reshard it with tools/convert_checkpoint.py reshard --tp 1 --pp 2",
    )


# --- save / load with a real DeepSpeed engine ---------------------------------------------------


def test_resume_continues_exactly(world1, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    full = _trainer(cfg, world1)
    _steps(full, 3)
    path, _ = _save(full)
    assert path.name == "iter_0000003" and (tmp_path / "ck" / "latest").read_text() == "iter_0000003"
    expected = _steps(full, 4)
    expected_params, expected_lr = _params(full), full.engine.get_lr()

    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # the restored streams must win
    resumed = _trainer(cfg, world1)
    _load(resumed, finder.find_resume(cfg))
    assert (resumed.iteration, resumed.start_iteration, resumed.start_sample) == (3, 3, 12)
    assert resumed.step_hooks[0].count == 3
    assert _steps(resumed, 4) == expected  # bit for bit: fp32 on one rank
    assert resumed.engine.get_lr() == expected_lr
    for name, value in _params(resumed).items():
        assert torch.equal(value, expected_params[name]), name
    assert resumed.step_hooks[0].count == full.step_hooks[0].count == 7

    # Saving after the resume records the data position from the start sample on.
    path, _ = _save(resumed)
    meta = json.loads((path / finder.META).read_text())
    assert meta["consumed_samples"] == 28
    assert meta["model"] == dataclasses.asdict(cfg.model)  # for the conversion tools


def test_hook_state_for_other_settings_is_not_loaded(world1, tmp_path: Path) -> None:
    trainer = _trainer(_cfg(tmp_path), world1)
    _steps(trainer, 2)
    _save(trainer)
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    other = _trainer(cfg, world1, hook_mode="b")
    _load(other, finder.find_resume(cfg))
    assert other.step_hooks[0].count == 0
    assert any("_CountingHook" in m and "starts fresh" in m for m in other.messages)


def test_crash_mid_save_leaves_previous_checkpoint(world1, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    trainer = _trainer(cfg, world1)
    _steps(trainer, 2)
    _save(trainer)
    saved = _params(trainer)
    _steps(trainer, 2)
    # A save of step 4 killed at various points: half-written files in the temporary tag, the
    # metadata not yet written, the `latest` pointer's temporary file half-written.
    root = tmp_path / "ck"
    (root / "tmp_iter_0000004").mkdir()
    (root / "tmp_iter_0000004" / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04half")
    (root / "latest.tmp").write_text("iter_00")
    resume = finder.find_resume(cfg)
    assert resume.path.name == "iter_0000002"
    fresh = _trainer(cfg, world1)
    _load(fresh, resume)
    for name, value in _params(fresh).items():
        assert torch.equal(value, saved[name]), name
    # The next save clears the leftover and completes.
    path, _ = _save(trainer)
    assert not (root / "tmp_iter_0000004").exists()
    assert finder.find_resume(cfg).path == path


def test_keep_last_and_same_step_saved_again(world1, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, **{"train.keep_last": 2})
    trainer = _trainer(cfg, world1)
    for _ in range(4):
        _steps(trainer, 1)
        _save(trainer)
    root = tmp_path / "ck"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    # A resumed run saving a step that exists keeps both (nothing saved is overwritten).
    trainer.cfg.train.keep_last = 0
    path, _ = _save(trainer)
    assert path.name == "iter_0000004_2" and (root / "latest").read_text() == "iter_0000004_2"
    assert json.loads((root / "iter_0000004" / finder.META).read_text())["vocab_size"] == 1000


def test_corrupt_deepspeed_file_is_named(world1, tmp_path: Path) -> None:
    """Same size, garbage bytes: the size check passes, DeepSpeed's read fails -> the file's name."""
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    trainer = _trainer(cfg, world1)
    _steps(trainer, 1)
    path, _ = _save(trainer)
    bad = path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    bad.write_bytes(b"\x80" + b"\x00" * (bad.stat().st_size - 1))
    with pytest.raises(ConfigError) as err:
        _load(_trainer(cfg, world1), finder.find_resume(cfg))
    one_line(err, str(bad), "truncated or corrupt")


class _RunsCode:
    """An object whose unpickling would run a shell command (touch `marker`): a crafted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "victim",
    ["megahet_rank_00000.pt", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
)
def test_checkpoint_file_that_would_run_code_is_refused(world1, tmp_path: Path, victim: str) -> None:
    """Someone who can write the checkpoint folder swaps one file (megahet's, or DeepSpeed's model or
    ZeRO file) for a pickle that runs a command, and fixes megahet.json's sizes: the resume refuses it
    with one line naming the file and the type, and the command never runs."""
    cfg = _cfg(tmp_path, **{"train.load": str(tmp_path / "ck")})
    trainer = _trainer(cfg, world1)
    _steps(trainer, 1)
    path, _ = _save(trainer)
    marker = tmp_path / "ran"
    torch.save({"module": {}, "rng": _RunsCode(marker)}, path / victim)
    meta = json.loads((path / finder.META).read_text())
    meta["files"][victim] = (path / victim).stat().st_size
    (path / finder.META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as err:
        _load(_trainer(cfg, world1), finder.find_resume(cfg))
    one_line(err, str(path / victim), "system", "does not load")
    assert not marker.exists()


def test_saved_files_name_only_allowed_types(world1, tmp_path: Path) -> None:
    """Every file of a real save names only types of torch's weights-only set or megahet's allow-list,
    and the RNG states are plain (no NumPy arrays): the safe loader reads every file megahet writes."""
    from megahet.checkpointing.safe_load import ALLOWED

    trainer = _trainer(_cfg(tmp_path), world1)
    _steps(trainer, 1)
    path, _ = _save(trainer)
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in ALLOWED}
    for file in path.glob("*.pt"):
        named = set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        assert named <= allowed, (file.name, named - allowed)
    assert not torch.serialization.get_unsafe_globals_in_checkpoint(path / "megahet_rank_00000.pt")


def test_weights_only_load_restarts_the_optimizer(world1, tmp_path: Path) -> None:
    """A weights-only checkpoint of step 3 loads under ZeRO-2 (saved under ZeRO-1): weights, step and
    consumed samples come back, the optimizer and LR schedule start fresh, and the next step equals
    that of a new engine built on the same weights (so DeepSpeed's fp32 master copy holds them)."""
    trainer = _trainer(_cfg(tmp_path), world1)
    _steps(trainer, 3)
    weights = _params(trainer)
    root = tmp_path / "weights"
    folder = checkpoint.save_weights_only(root, [[weights]], iteration=3, consumed_samples=12, meta={})
    assert (root / finder.LATEST).read_text() == folder.name == "iter_0000003"

    cfg = _cfg(tmp_path, **{"train.load": str(root), "parallel.zero_stage": 2})
    resume = finder.find_resume(cfg)
    finder.check_compatible(resume, cfg, dp=1)
    loaded = _trainer(cfg, world1)
    _load(loaded, resume)
    assert (loaded.iteration, loaded.start_iteration, loaded.start_sample) == (3, 3, 12)
    assert any("weights-only" in m and "optimizer" in m and "restart" in m for m in loaded.messages)
    assert loaded.step_hooks[0].count == 0  # hook state starts fresh
    for name, value in _params(loaded).items():
        assert torch.equal(value, weights[name]), name
    assert loaded.engine.lr_scheduler.num_steps == 1  # the schedule's step 0 (1 / warmup): warmup again
    assert trainer.engine.lr_scheduler.num_steps == 3 + 1

    torch.manual_seed(0)
    fresh_model = _Toy()
    fresh_model.load_state_dict(weights)
    fresh = types.SimpleNamespace(engine=build_engine(cfg, fresh_model, 1, {}), iteration=0, step_hooks=[])
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = _steps(fresh, 2)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    assert _steps(loaded, 2) == expected
    for name, value in _params(loaded).items():
        assert torch.equal(value, _params(fresh)[name]), name
    assert not torch.equal(_params(loaded)["proj.weight"], weights["proj.weight"])


def test_bf16_checkpoint_consolidates_to_the_fp32_master_weights(world1, tmp_path: Path) -> None:
    """A bf16 run's model states hold bf16-rounded weights; consolidate returns ZeRO's fp32 masters
    (merged by DeepSpeed's zero_to_fp32), exactly the optimizer's, not the rounded copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    from megahet.checkpointing.convert import consolidate

    cfg = _cfg(tmp_path, **{"train.precision": "bf16"})
    trainer = _trainer(cfg, world1)
    _steps(trainer, 3)
    _save(trainer)
    state, meta = consolidate(tmp_path / "ck")
    assert meta["iteration"] == 3
    for name, param in trainer.engine.module.named_parameters():
        assert param.dtype == torch.bfloat16 and state[name].dtype == torch.float32
        master = safe_get_full_fp32_param(param)
        assert torch.equal(state[name], master), name
        assert not torch.equal(state[name], param.detach().float()), name  # the rounded copy differs
