"""Tests of megahet.logging: the console line, which ranks log, and the TensorBoard and Weights &
Biases (offline) files the logging rank writes.

Run: ``python -m pytest tests/unit/test_logging.py -q`` (about 15 s: megatron-core import and one
offline wandb run).
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import pytest

from megahet.config import MegahetConfig
from megahet.logging import TrainingLogger, format_console_line
from megahet.parallel import ParallelLayout


def _layout(tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1, dp_rank: int = 0, dp: int = 1):
    world = tp * pp * dp
    rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    return ParallelLayout(
        rank=rank,
        world_size=world,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        dp_rank=dp_rank,
        dp_size=dp,
    )


def _cfg(tmp_path: Path, *, wandb: bool = False, tensorboard: bool = False) -> MegahetConfig:
    cfg = MegahetConfig()
    cfg.train.train_iters = 50
    cfg.logging.log_dir = str(tmp_path / "runs")
    cfg.logging.wandb = wandb
    cfg.logging.tensorboard_dir = str(tmp_path / "tb") if tensorboard else None
    return cfg


# --- the console line ----------------------------------------------------------------------------


def test_console_line_known_metrics_in_order() -> None:
    line = format_console_line(
        7,
        300,
        {
            "loss": 2.345678,
            "lr": 3e-4,
            "grad_norm": 0.98765,
            "tokens_per_s": 1234.56,
            "step_time_s": 0.12345,
            "compute_min_s": 0.05,
            "compute_max_s": 0.0812,
        },
    )
    assert (
        line
        == "step      7/300 | loss 2.3457 | lr 3.000e-04 | grad norm 0.988 | 1235 tokens/s | step 0.123 s"
    )


def test_console_line_leaves_the_detail_to_the_metrics_sinks(tmp_path, capsys) -> None:
    """Spreads, hook time, estimates and traffic are not printed; the metrics file still has them."""
    detail = {"compute_min_s": 0.05, "wait_max_s": 0.1, "hooks_s": 0.002, "est_speed_min": 0.9,
              "plan_changes_max": 3.0, "block_gflops_min": 1.5, "migration_mb_step_max": 2.0, "device_speed": 0.5}  # fmt: skip
    metrics = {"loss": 1.5, **detail, "moved_tp0": 0.25, "moved_tp1": -0.25}
    cfg = _cfg(tmp_path)
    cfg.logging.metrics_file = str(tmp_path / "metrics.jsonl")
    logger = TrainingLogger(cfg, _layout(), run_name="gpt")
    logger.log(2, metrics)
    logger.close()
    assert capsys.readouterr().out.strip() == "step      2/50 | loss 1.5000 | moved 0.25 -0.25"
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 2, **metrics}


def test_console_line_samples_and_unknown_metrics() -> None:
    line = format_console_line(300, 300, {"samples_per_s": 88.04, "val_acc": 0.912345, "val_ppl": 12345.6})
    assert line == "step    300/300 | 88.0 samples/s | val_acc 0.9123 | val_ppl 1.235e+04"


def test_console_line_without_metrics() -> None:
    assert format_console_line(1, 10, {}) == "step      1/10"


# --- which ranks log -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        _layout(tp_rank=1, tp=2),  # not TP rank 0
        _layout(dp_rank=1, dp=2),  # not DP replica 0
        _layout(pp_rank=0, pp=2),  # not the last stage (no loss there)
        _layout(tp_rank=1, tp=2, pp_rank=1, pp=2, dp_rank=1, dp=2),
    ],
    ids=["tp1", "dp1", "first-of-two-stages", "tp1-pp1-dp1"],
)
def test_non_logging_ranks_are_silent(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout) -> None:
    assert not layout.is_logging_rank
    logger = TrainingLogger(_cfg(tmp_path, wandb=True, tensorboard=True), layout, run_name="gpt")
    assert not logger.active
    logger.print("hello")
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tb").exists()  # no files either


@pytest.mark.parametrize(
    "layout",
    [_layout(), _layout(pp_rank=1, pp=2, tp=2, dp=2), _layout(pp_rank=3, pp=4)],
    ids=["single", "last-stage-tp0-dp0", "last-of-four"],
)
def test_logging_rank_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout) -> None:
    assert layout.is_logging_rank
    logger = TrainingLogger(_cfg(tmp_path), layout, run_name="gpt")
    assert logger.active
    logger.print("hello")
    logger.log(5, {"loss": 1.5, "lr": 1e-3})
    logger.log(6, {"loss": 1.4}, console=False)
    logger.close()
    assert capsys.readouterr().out == "hello\nstep      5/50 | loss 1.5000 | lr 1.000e-03\n"
    assert (tmp_path / "runs" / "gpt").is_dir()
    assert not list((tmp_path / "runs" / "gpt").iterdir())  # wandb and tensorboard off: no files


# --- TensorBoard and wandb -----------------------------------------------------------------------


def test_tensorboard_event_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TrainingLogger(_cfg(tmp_path, tensorboard=True), _layout(), run_name="vit")
    logger.log(10, {"loss": 2.5, "lr": 1e-3})
    logger.log(20, {"loss": 2.0, "lr": 5e-4}, console=False)
    logger.log(20, {"val_acc": 0.75})
    logger.close()
    run_dir = tmp_path / "tb" / "vit"
    assert list(run_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "lr", "val_acc"}
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(10, 2.5), (20, 2.0)]
    assert [(s.step, round(s.value, 6)) for s in events.Scalars("lr")] == [(10, 1e-3), (20, 5e-4)]
    assert [(s.step, s.value) for s in events.Scalars("val_acc")] == [(20, 0.75)]
    assert capsys.readouterr().out.count("step ") == 2  # the console=False line was not printed


def test_wandb_offline_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, sub in (
        ("WANDB_CONFIG_DIR", "wb-config"),
        ("WANDB_CACHE_DIR", "wb-cache"),
        ("WANDB_DATA_DIR", "wb-data"),
    ):
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, wandb=True)
    cfg.logging.wandb_run_name = "my-run"
    cfg.model.num_layers = 3
    logger = TrainingLogger(cfg, _layout(), run_name="gpt")
    logger.log(1, {"loss": 3.25, "lr": 1e-3}, console=False)
    logger.log(2, {"loss": 3.125, "lr": 1e-3}, console=False)
    logger.close()
    runs = glob.glob(str(tmp_path / "runs" / "my-run" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs  # under <log_dir>/<wandb_run_name>, not <log_dir>/gpt
    assert not (tmp_path / "runs" / "gpt").exists()
    records = glob.glob(str(Path(runs[0]) / "run-*.wandb"))
    assert len(records) == 1
    # The metrics and the run's config were recorded (protobuf keeps the strings as they are). The
    # wandb-core service may still be writing after finish() returns: give it a few seconds.
    wanted = (b"loss", b"3.125", b"num_layers", b"wandb_run_name")
    deadline = time.monotonic() + 30
    while True:
        data = Path(records[0]).read_bytes()
        if all(w in data for w in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [w for w in wanted if w not in data] == [], data[:200]


def test_wandb_disabled_mode_writes_no_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, wandb=True)
    cfg.logging.wandb_mode = "disabled"
    logger = TrainingLogger(cfg, _layout(), run_name="gpt")
    logger.log(1, {"loss": 1.0}, console=False)
    logger.close()
    assert not (tmp_path / "runs" / "gpt" / "wandb").exists()
