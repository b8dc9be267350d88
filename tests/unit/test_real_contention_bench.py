"""The real-contention benchmark's parts: rank-to-core pinning (tools/pin_ranks.py), the competing
process and the core share it leaves (benchmarks/contention.py), and the table's arithmetic: the ideal
speed-up of a perfect split of static's measured speeds and the goal lines
(benchmarks/real_contention.py)."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.contention import competing_process, core_share, schedstat, two_cores
from benchmarks.real_contention import add_speedups, goals, summarize
from megahet.runtime.balancer import compute_efficiency
from tools.pin_ranks import rank_core


def test_rank_core_takes_the_listed_or_allowed_cores_and_says_what_is_wrong():
    allowed = sorted(os.sched_getaffinity(0))
    assert rank_core(0) == allowed[0]
    assert rank_core(0, str(allowed[-1])) == allowed[-1]
    with pytest.raises(ValueError, match="local rank 1 has no core of its own .*MEGAHET_CORES"):
        rank_core(1, str(allowed[0]))
    with pytest.raises(ValueError, match="core 4096 is not available"):
        rank_core(0, "4096")


def test_core_share_is_time_on_cpu_over_time_wanting_it():
    assert core_share((1.0, 1.0), (2.0, 2.0)) == pytest.approx(0.5)
    assert core_share((0.0, 0.0), (3.0, 1.0)) == pytest.approx(0.75)
    assert core_share((1.0, 1.0), (1.0, 1.0)) != core_share((1.0, 1.0), (1.0, 1.0))  # nan: never ran


def test_competing_process_burns_its_core_until_the_block_ends():
    core = (two_cores() or sorted(os.sched_getaffinity(0)))[-1]
    with competing_process(core) as proc:
        time.sleep(0.3)
        before = schedstat(proc.pid)
        time.sleep(0.5)
        ran = schedstat(proc.pid)[0] - before[0]
        with open(f"/proc/{proc.pid}/status") as status:
            allowed = status.read().split("Cpus_allowed_list:")[1].split()[0]
    assert ran > 0.1  # busy, on CPU (shared with whatever else runs there)
    assert allowed == str(core)
    assert proc.poll() is not None  # killed on exit


def _trace(steps: int, busy: list[float], sent: float = 0.0, step_s: float = 1.0) -> list[dict]:
    return [
        {
            "step": s,
            "step_s": step_s,
            "busy_s": [busy],
            "efficiency": [compute_efficiency([1.0, 1.0], busy)],
            "speed": [[1.0, min(busy) / max(busy)]] if s else [None],
            "sent": [[0.0, sent if s >= 2 else 0.0]],
            "dropped": [[0.0, 0.0]],
        }
        for s in range(steps)
    ]


def test_summary_ideal_speedup_and_goals():
    static = summarize("static", True, _trace(10, [0.2, 0.4], step_s=0.6), share=0.5, skip=4)
    migrate = summarize("migrate", True, _trace(10, [0.3, 0.3], sent=0.3, step_s=0.5), share=0.5, skip=4)
    semi = summarize("semi", True, _trace(10, [0.3, 0.3], sent=0.3, step_s=0.58), share=0.5, skip=4)
    calm = summarize("static", False, _trace(10, [0.2, 0.2], step_s=0.35), share=0.95, skip=4)
    assert static["reaction_steps"] == "-" and migrate["reaction_steps"] == 2
    # Speeds 1 and 0.5: a perfect split takes 2 / (1/0.2 + 1/0.4) = 0.267 s, E = 0.267 / 0.4 = 2/3.
    assert static["est_speed_tp1"] == pytest.approx(0.5) and static["balance_eff"] == pytest.approx(2 / 3)
    rows = [static, migrate, semi, calm]
    add_speedups(rows)
    # It saves max compute x (1 - E) = 0.4 / 3 of static's 0.6 s.
    assert static["ideal_step_s"] == pytest.approx(0.6 - 0.4 / 3)
    assert migrate["ideal_speedup"] == pytest.approx(0.6 / (0.6 - 0.4 / 3))
    assert migrate["speedup"] == pytest.approx(1.2)
    assert migrate["of_ideal"] == pytest.approx(1.2 / migrate["ideal_speedup"])
    assert calm["speedup"] == pytest.approx(0.6 / 0.35)
    lines = goals(rows)
    assert lines[0] == "migrate: speed-up 1.200 = 0.933 of the ideal 1.286 (goal >= 0.9) -> met"
    assert lines[1] == "semi: speed-up 1.034 = 0.805 of the ideal 1.286 (goal >= 0.9) -> MISSED"
    assert len(lines) == 2  # resize and the uncontended run have no goal


def test_a_run_pins_the_ranks_and_passes_the_settings(tmp_path, monkeypatch):
    import json

    import benchmarks.real_contention as bench

    monkeypatch.setattr(bench, "RUNS", tmp_path)
    launched = []

    def fake_torchrun(script, nproc, args, log):
        launched.append((script, nproc, args, log, os.environ.get("MEGAHET_CORES")))
        trace = args[args.index("--balance.trace") + 1]
        with open(trace, "w") as f:
            f.write(json.dumps({"step": 0}) + "\n")
        return 1.0

    monkeypatch.setattr(bench, "torchrun", fake_torchrun)
    trace, _ = bench.run("migrate", False, 12, [0, 1], ["--resize.selection", "random"], tag="x_")
    ((script, nproc, args, log, cores),) = launched
    assert (script, nproc, log, cores) == ("tools/pin_ranks.py", 2, tmp_path / "x_migrate_calm.log", "0,1")
    assert args[args.index("--balance.mode") + 1] == "migrate" and args[-2:] == [
        "--resize.selection",
        "random",
    ]
    assert trace == [{"step": 0}] and "MEGAHET_CORES" not in os.environ


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "resize.selection=random"], "give them their own --name"),
        (["--set", "balance.window=5", "--name", "x"], "--set balance.window: the benchmark sets it"),
        (["--set", "oops", "--name", "x"], "expected KEY=VALUE"),
        (["--modes", "migrate"], "must include static"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, monkeypatch):
    import benchmarks.real_contention as bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)
