"""The accuracy study's pure parts (benchmarks/accuracy_study.py): the selection-comparison repeats
(every random / priority resizing run again under extra seeds), their paired means, and the goal line
and table that judge priority against random on those means; `--priority-set` overrides reach only
the priority launches and a resumed run is reused only under the same overrides.

    python -m pytest -q tests/unit/test_accuracy_study_bench.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.accuracy_study as study
from benchmarks.accuracy_study import (
    default_grid,
    goals,
    launch,
    selection_repeats,
    setting_overrides,
    write_results,
)
from benchmarks.selection_stats import selection_comparison


def test_repeats_are_the_zero_imputation_resizing_runs_under_each_seed():
    grid = default_grid()
    repeats = selection_repeats(grid, [7, 99])
    compared = [r for r in grid if r.method == "resize" and r.imputation == "zero"]
    assert len(compared) == 12 and len(repeats) == 24  # 6 arm x profile cells x random / priority
    assert {r.seed for r in repeats} == {7, 99}
    assert {(r.selection, r.imputation) for r in repeats} == {("random", "zero"), ("priority", "zero")}
    names = [r.name for r in grid + repeats]
    assert len(set(names)) == len(names)  # a repeat never overwrites the study seed's run
    assert repeats[0].name.endswith("_seed7")
    assert selection_repeats(grid, []) == []


def _row(selection: str, seed: int, acc: float, repeat: bool, profile: str = "1x4x") -> dict:
    return {
        "model": "vit",
        "tp": 4,
        "profile": profile,
        "method": "resize",
        "selection": selection,
        "imputation": "zero",
        "label": f"resize-{selection}",
        "stragglers": 1,
        "slowdown": 4,
        **dict.fromkeys(("train_wall_s", "total_wall_s", "dropped", "moved_mb"), 1.0),
        "seed": seed,
        "repeat": repeat,
        "val_acc": acc,
        "val_loss": 1.0,
        "time_to_target_s": None,
        "curve": [(60, 1.0, acc, 1.0)],
    }


def test_priority_is_judged_on_the_paired_mean_over_seeds(tmp_path):
    rows = [
        _row("random", 1234, 0.66, False),
        _row("priority", 1234, 0.64, False),  # loses at the study seed...
        _row("random", 7, 0.60, True),
        _row("priority", 7, 0.65, True),  # ...wins on the mean over seeds
        _row("random", 99, 0.70, True),  # no priority run at seed 99: not paired, left out
    ]
    (cell,) = selection_comparison(rows)
    assert cell["seeds"] == "7,1234"
    assert cell["random"] == pytest.approx(0.63) and cell["priority"] == pytest.approx(0.645)
    assert cell["differences"] == "+0.05 -0.02"
    assert cell["difference"] == pytest.approx(0.015) and cell["se"] == pytest.approx(
        0.035
    )  # sd 0.0495 / sqrt 2
    (line,) = [line for line in goals(rows) if "priority >= random" in line]
    assert "mean over seeds 7,1234" in line and "mean +0.015, standard error 0.035: within noise" in line
    assert "resolving 0.5 point with 80 % power takes ~770 paired seeds" in line  # (2.80 * 0.0495 / 0.005)^2
    assert line.endswith("-> undecided (priority's mean ahead, within noise)")
    (pooled,) = [line for line in goals(rows) if "pooled" in line]
    assert "pooled over 2 paired runs in 1 cells: +0.015 (standard error 0.035" in pooled
    rows[3]["val_acc"] = 0.61
    assert next(line for line in goals(rows) if "priority >= random" in line).endswith(
        "-> undecided (priority's mean behind, within noise)"
    )

    write_results(rows, tmp_path, "study", {})
    table = (tmp_path / "study.md").read_text()
    assert "Selection policies, mean over seeds" in table
    assert sum(line.startswith("| 4 | 1x4x") for line in table.splitlines()) == 2  # repeats: only there


def test_the_goal_is_met_or_missed_only_where_the_paired_t_test_resolves_it():
    def cell(gains):  # priority - random per seed, random at 0.60
        rows = []
        for seed, gain in enumerate(gains):
            rows += [_row("random", seed, 0.60, seed > 0), _row("priority", seed, 0.60 + gain, seed > 0)]
        return next(line for line in goals(rows) if "priority >= random" in line)

    assert cell([0.011, 0.010, 0.012]).endswith(
        "priority better; resolving 0.5 point with 80 % power takes ~2 paired seeds) -> met"
    )
    assert cell([-0.011, -0.010, -0.012]).endswith("-> MISSED")
    # over 7 pairs, beyond 2 standard errors but not beyond t(0.975, 6) = 2.447
    gains = [0.019 + d for d in (-0.03, 0.03, -0.02, 0.02, 0.0, -0.01, 0.01)]  # mean 2.33 se
    assert cell(gains).endswith("-> undecided (priority's mean ahead, within noise)")


def test_set_reaches_every_launch_priority_set_only_priority_ones_and_both_guard_reuse(tmp_path, monkeypatch):
    launched = []

    def fake_torchrun(script, nproc, args, log):
        launched.append(args)
        metrics = Path(args[args.index("--logging.metrics_file") + 1])
        metrics.write_text(json.dumps({"step": 60, "val_acc": 0.5}) + "\n")
        log.write_text("megahet vit: 60 steps in 1.0 s\n")
        return 2.0

    monkeypatch.setattr(study, "torchrun", fake_torchrun)
    policy = setting_overrides(["resize.priority_score=snr", " resize.priority_temperature = 0 "])
    assert policy == ["--resize.priority_score", "snr", "--resize.priority_temperature", "0"]
    every = setting_overrides(["train.eval_iters=39"], "--set")
    cell = [r for r in default_grid() if r.profile == "1x4x" and r.arm.model == "vit"]
    random_run, priority_run = (
        next(r for r in cell if r.label == f"resize-{s}") for s in ("random", "priority")
    )
    for run in (random_run, priority_run):
        launch(run, tmp_path, resume=True, seed=1234, priority=policy)
    assert "--resize.priority_score" not in launched[0] and launched[1][-4:] == policy
    assert launch(priority_run, tmp_path, True, 1234, priority=policy)["reused"]  # same overrides: reused
    assert not launch(priority_run, tmp_path, True, 1234)["reused"]  # the default policy: launched again
    assert not launch(random_run, tmp_path, True, 99, priority=policy)["reused"]  # another seed
    assert len(launched) == 4
    launch(random_run, tmp_path, True, 1234, overrides=every)  # --set: launched again, with it
    assert launched[-1][-2:] == ["--train.eval_iters", "39"] and len(launched) == 5
    assert launch(random_run, tmp_path, True, 1234, overrides=every)["reused"]
    launch(priority_run, tmp_path, True, 1234, overrides=every, priority=policy)
    assert launched[-1][-6:] == every + policy  # both, the study-wide ones first
    for key in ("train.seed", "device.profile", "logging.metrics_file", "resize.selection"):
        with pytest.raises(SystemExit, match=f"--set {key}: the study sets it per run"):
            setting_overrides([f"{key}=1"], "--set")
    assert setting_overrides(["resize.priority_score=snr"], "--set")  # a prefix of no study key
    with pytest.raises(SystemExit, match="--set 'eval_iters': expected KEY=VALUE"):
        setting_overrides(["eval_iters"], "--set")
    with pytest.raises(SystemExit, match="--priority-set 'resize.priority_score': expected KEY=VALUE"):
        setting_overrides(["resize.priority_score"])


def test_overrides_need_their_own_out_folder(monkeypatch):
    def no_launch(*args):
        raise AssertionError("launched")

    monkeypatch.setattr(study, "torchrun", no_launch)
    for flag in ("--set", "--priority-set"):
        monkeypatch.setattr("sys.argv", ["accuracy_study.py", flag, "train.lr=1e-3"])
        with pytest.raises(SystemExit, match="give them their own --out"):
            study.main()
