"""The efficiency benchmark's pure parts: the homogeneous twin of a profile, the speed changes it
reacts to, and the reaction count (benchmarks/balance_efficiency.py)."""

from __future__ import annotations

import pytest

from benchmarks.balance_efficiency import Profile, profiles, reaction, straggler
from megahet.policy.speed_profile import parse_profile


def test_twin_gives_every_rank_the_profiles_mean_speed_at_every_step():
    for profile in profiles(warmup=4, steps=20):
        twin = parse_profile(profile.twin())
        for step in range(profile.steps):
            mean = sum(profile.speeds(step)) / profile.tp
            assert [twin.speed(r, step, profile.tp) for r in range(profile.tp)] == pytest.approx(
                [mean] * profile.tp
            )
    mixed = straggler("m", 8, [1 / 8, 1 / 6, 1 / 4, 1 / 2, 1, 1, 1, 1], warmup=4, steps=20)
    assert parse_profile(mixed.twin()).speed(0, 10, 8) == pytest.approx(5.0417 / 8, abs=1e-4)


def test_changes_are_the_steps_where_speeds_move_after_the_warmup():
    assert straggler("s", 4, [1, 1, 1, 0.25], warmup=4, steps=20).changes(4) == [4]
    assert Profile("r", 4, "rotating:4,6", 24).changes(4) == [6, 12, 18]
    contention = Profile("c", 4, "contention:4,20,10", 50)
    assert contention.changes(4) == [20, 40]


def test_reaction_counts_steps_until_within_5_percent_of_the_twin():
    twin = [1.0] * 10
    run = [1.0, 1.0, 3.0, 3.0, 1.04, 1.0, 3.0, 3.0, 3.0, 1.0]
    assert reaction(run, twin, changes=[2], steps=10) == 2  # steps 2 and 3 slow; step 6 on is later noise
    assert reaction(run, twin, changes=[2, 6], steps=10) == 3  # the worst change
    assert reaction([3.0] * 10, twin, changes=[2], steps=10) == 8  # never: the whole phase


def test_update_replaces_only_the_rerun_profiles_rows(tmp_path, monkeypatch):
    import json

    import benchmarks.balance_efficiency as bench

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RUNS", tmp_path / "runs")
    (tmp_path / "runs").mkdir()

    def rows(profile: str, value: float) -> list[dict]:
        return [{"profile": profile, "mode": mode, "efficiency": value} for mode in bench.MODES]

    old_meta = {"balancer_overhead": {"overhead": 0.004}, "wall_s": 100.0, "profiles": {}}
    old = rows("tp4_2x", 0.5) + rows("tp4_4x", 0.9)
    (tmp_path / "bench.json").write_text(json.dumps({"meta": old_meta, "rows": old}))
    for mode in ("twin", *bench.MODES):  # the trace of the profile that is not rerun feeds the plot
        (tmp_path / "runs" / f"tp4_4x_{mode}.jsonl").write_text('{"step": 0, "step_s": 0.8}\n')

    merged, meta, times = bench.merge_rerun(
        "bench", rows("tp4_2x", 0.97), {"wall_s": 7.0, "profiles": {}}, {"tp4_2x": {}}, 4, 20
    )
    assert [(r["profile"], r["mode"], r["efficiency"]) for r in merged] == [
        *(("tp4_2x", m, 0.97) for m in bench.MODES),
        *(("tp4_4x", m, 0.9) for m in bench.MODES),
    ]
    assert meta["balancer_overhead"] == {"overhead": 0.004}  # kept: this rerun measured none
    assert meta["reruns"][0]["profiles"] == ["tp4_2x"] and meta["wall_s"] == 100.0
    assert list(times) == ["tp4_2x", "tp4_4x"] and times["tp4_4x"]["semi"] == [0.8]
    with pytest.raises(SystemExit, match="run without --update first"):
        bench.merge_rerun("missing", [], {"wall_s": 0.0}, {}, 4, 20)


def test_goal_lines_give_each_cells_distance_to_its_goal():
    from benchmarks.balance_efficiency import goals

    rows = [
        {"profile": "p", "mode": "static", "efficiency": 0.3, "reaction_steps": None},
        {
            "profile": "p",
            "mode": "migrate",
            "efficiency": 0.93,
            "reaction_steps": 2,
            "reaction_compute_steps": 2,
        },
        {
            "profile": "p",
            "mode": "semi",
            "efficiency": 0.94,
            "reaction_steps": 4,
            "reaction_compute_steps": 2,
        },
    ]
    overhead = {"overhead": 0.012, "hooks_overhead": 0.006, "pair_overheads": [0.02, 0.004], "steps": 28}
    migrate, semi, cost = goals(rows, overhead)
    assert migrate == "- p migrate: E 0.930 vs >= 0.90 (+0.030) -> met; reaction 2 (compute 2) vs <= 3 -> met"
    assert (
        "E 0.940 vs >= 0.95 (-0.010) -> MISSED" in semi and "reaction 4 (compute 2) vs <= 3 -> MISSED" in semi
    )
    assert "A/B +1.20 %" in cost and "per pair +2.0 +0.4 %" in cost and "hooks 0.60 %" in cost
    assert cost.endswith("A/B MISSED, hooks met")
    assert len(goals(rows, None)) == 2


def test_a_run_launches_the_benchmark_gpt_through_the_shared_launcher(tmp_path, monkeypatch):
    import json

    import benchmarks.balance_efficiency as bench

    monkeypatch.setattr(bench, "RUNS", tmp_path)
    launched = []

    def fake_torchrun(script, nproc, args, log):
        launched.append((script, nproc, args, log))
        trace = args[args.index("--balance.trace") + 1]
        with open(trace, "w") as f:
            f.write(json.dumps({"step": 1, "step_time_s": 0.5}) + "\n")
        return 3.0

    monkeypatch.setattr(bench, "torchrun", fake_torchrun)
    profile = straggler("tp4_4x", 4, [1, 1, 1, 0.25], warmup=4, steps=12)
    trace = bench.run(profile, "twin", profile.twin(), rate=10.0)
    ((script, nproc, args, log),) = launched
    assert (script, nproc, log) == ("pretrain_gpt.py", 4, tmp_path / "tp4_4x_twin.log")
    assert args[:2] == ["--parallel.tp", "4"] and all(a in args for a in bench.MODEL)
    assert args[args.index("--balance.mode") + 1] == "static"  # the twin runs unbalanced
    assert args[args.index("--device.profile") + 1] == profile.twin()
    assert trace == [{"step": 1, "step_time_s": 0.5}]


def test_dp_profiles_slow_whole_replicas_and_their_twin_runs_at_the_mean():
    from benchmarks.dp_efficiency import PROFILES, DpProfile

    profile = DpProfile("p", 2, (1.0, 0.25))
    spec = parse_profile(profile.spec(warmup=4, slow=12))
    twin = parse_profile(profile.spec(warmup=4, slow=12, twin=True))
    assert [spec.speed(r, 3, 4) for r in range(4)] == [1.0] * 4
    assert [spec.speed(r, 4, 4) for r in range(4)] == [1.0, 1.0, 0.25, 0.25]  # replica 1 = ranks 2, 3
    assert [twin.speed(r, 10, 4) for r in range(4)] == [0.625] * 4
    assert [spec.speed(r, 16, 4) for r in range(4)] == [1.0] * 4  # recovered
    # 16 micro-batches over [1, 0.25]: (13, 3) takes 13 against the twin's 16 / 1.25 = 12.8
    assert profile.split_bound() == pytest.approx(12.8 / 13)
    assert {p.name for p in PROFILES} == {"tp2dp2_2x", "tp2dp2_4x", "dp4_mixed"}
