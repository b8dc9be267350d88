"""`balance.replay`: a lossy run (resize) replayed from its trace gives its losses bit for bit (issue 31).

The plans of resize and semi follow measured time, so two runs of the same command and seed drop
different units and their losses differ. Replaying the recorded run's targets step by step (unit
selection is seeded by the step) gives the recorded run's plans, and so its losses, exactly. TP=2 ViT
(pretrain_vit.py), TP rank 1 a virtual device at half speed (0.3 GFLOP/s: its charge outlasts its real compute), `--balance.mode resize`: the recorded run
and its replay, which writes a trace of its own. The replay's targets equal the recorded ones to the
last bit (floats from measured times: a run that planned for itself would not repeat them), and so do
its losses.
"""

from __future__ import annotations

import json

import pytest
from harness import metrics_job, read_records, short_run, torchrun

from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.run_plan import check_replay

STEPS = 12


def _run(out, name: str, extra: list[str]) -> dict[int, dict]:
    args = [
        *short_run(STEPS, eval_iters=1),
        *("--parallel.tp", "2", "--device.profile", "static:1,0.5", "--device.rate_gflops", "0.3"),
        *("--balance.mode", "resize", "--balance.window", "1", "--balance.hysteresis", "0.01", *extra),
    ]
    args, metrics = metrics_job(out, name, args)
    torchrun("../../pretrain_vit.py", 2, args, cwd=out, timeout=300)
    return read_records(metrics)


def test_a_replayed_resize_run_gives_the_recorded_losses_bit_for_bit(tmp_path):
    trace = tmp_path / "recorded_trace.jsonl"
    recorded = _run(tmp_path, "recorded", ["--balance.trace", str(trace)])
    again = tmp_path / "replayed_trace.jsonl"
    replayed = _run(tmp_path, "replayed", ["--balance.replay", str(trace), "--balance.trace", str(again)])
    rows, rows_again = ([json.loads(line) for line in t.read_text().splitlines()] for t in (trace, again))
    gammas = [row["targets"][0]["gamma"].get("1", 0.0) for row in rows]
    assert max(gammas) > 0.2, gammas  # the recorded run really resized rank 1
    assert [row["targets"] for row in rows_again] == [row["targets"] for row in rows]
    losses = [recorded[s]["loss"] for s in range(1, STEPS + 1)]
    assert [
        replayed[s]["loss"] for s in range(1, STEPS + 1)
    ] == losses  # bit for bit (JSON floats round-trip)
    assert replayed[STEPS]["gamma_tp1"] == recorded[STEPS]["gamma_tp1"]


def test_replay_settings_are_checked_before_ranks_start(tmp_path):
    trace = tmp_path / "t.jsonl"
    cfg = apply_overrides(MegahetConfig(), {"balance.mode": "migrate", "balance.replay": str(trace)})
    with pytest.raises(ConfigError, match="does not exist"):
        check_replay(cfg)
    trace.write_text(json.dumps({"step": 0, "speed": [None]}) + "\n")
    with pytest.raises(ConfigError, match="records no plans"):
        check_replay(cfg)
    trace.write_text(json.dumps({"step": 0, "targets": [{"gamma": {"1": 0.3}, "moves": {}}]}) + "\n")
    with pytest.raises(ConfigError, match="balance.mode=migrate cannot execute .resizing."):
        check_replay(cfg)
    static = apply_overrides(MegahetConfig(), {"balance.replay": str(trace)})
    with pytest.raises(ConfigError, match="set balance.mode to the recorded run's mode"):
        check_replay(static)
    check_replay(apply_overrides(MegahetConfig(), {"balance.mode": "semi", "balance.replay": str(trace)}))
