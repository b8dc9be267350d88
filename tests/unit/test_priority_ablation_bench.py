"""benchmarks/priority_ablation.py without launches: which study runs a variant reuses, the command
it hands to the accuracy study, and the per-cell and pooled summary it writes.

    python -m pytest -q tests/unit/test_priority_ablation_bench.py
"""

from __future__ import annotations

import json

import pytest

import benchmarks.priority_ablation as ablation


def test_a_variant_reuses_only_the_study_runs_it_does_not_change(tmp_path, monkeypatch):
    study = tmp_path / "study_runs"
    study.mkdir()
    names = [
        "vit_tp4_none_baseline",
        "vit_tp4_1x4x_resize-random_seed7",
        "vit_tp4_1x4x_resize-priority_seed7",
    ]
    for name in names:
        (study / f"{name}.json").write_text("{}")
    commands = []
    monkeypatch.setattr(ablation.subprocess, "run", lambda command, check: commands.append(command))
    out = tmp_path / "out"
    ablation.run_variant("snr-greedy", out, study)
    ablation.run_variant("shipped", out, study)
    snr, shipped = ({p.stem for p in (out / f"{v}_runs").iterdir()} for v in ("snr-greedy", "shipped"))
    assert snr == set(names[:2])  # its priority runs are its own
    assert shipped == set(names)
    assert commands[0][-4:] == [
        "--priority-set", "resize.priority_score=snr", "--priority-set", "resize.priority_temperature=0",
    ]  # fmt: skip
    assert (
        "--priority-set" not in commands[1] and commands[0][commands[0].index("--name") + 1] == "snr-greedy"
    )


def test_summary_pairs_priority_with_random_per_cell_and_pooled(tmp_path):
    def row(profile, selection, seed, acc):
        return {"model": "vit", "tp": 4, "profile": profile, "method": "resize", "selection": selection,
                "imputation": "zero", "seed": seed, "val_acc": acc}  # fmt: skip

    rows = [row("1x4x", "random", 7, 0.60), row("1x4x", "priority", 7, 0.62)]
    rows += [row("1x8x", "random", 7, 0.60), row("1x8x", "priority", 7, 0.58)]
    result = tmp_path / "uniform.json"
    result.write_text(json.dumps({"rows": rows}))
    table, pooled = ablation.summarize("uniform", result)
    assert [(t["profile"], t["difference"]) for t in table] == [
        ("1x4x", pytest.approx(0.02)),
        ("1x8x", pytest.approx(-0.02)),
    ]
    assert table[0]["overrides"] == "resize.priority_temperature=1e6"
    assert pooled["pairs"] == 2 and pooled["difference"] == pytest.approx(0.0)
    assert pooled["se"] == pytest.approx(0.02)  # sd 0.0283 / sqrt 2
    assert pooled["verdict"] == "within noise" and table[0]["verdict"] == "within noise"  # one pair per cell
    assert table[0]["seeds_needed"] is None
