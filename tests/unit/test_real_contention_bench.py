"""The real-contention benchmark's parts: rank-to-core pinning (tools/pin_ranks.py), the competing
process and the core share it leaves (benchmarks/contention.py), and the table's arithmetic: each run's
step split per rank, the capacity ideal from the core shares, the gain captured and the goal lines
(benchmarks/real_contention.py)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from benchmarks.contention import competing_process, core_share, schedstat, two_cores
from benchmarks.real_contention import UNIT_SHARE, add_capacity, goals, ownership_saving, summarize
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


def test_a_nice_tenant_runs_at_its_priority_in_its_own_session():
    """A milder straggler's tenant: niced, in a session (and so an autogroup, where the kernel has them)
    of its own whose nice is its own, as the kernel weighs tenants by their autogroup."""
    core = (two_cores() or sorted(os.sched_getaffinity(0)))[-1]
    with competing_process(core, processes=2, nice=5) as proc:
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the loop has set it
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 5
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        group = Path(f"/proc/{proc.pid}/autogroup")
        if group.exists():
            while not group.read_text().strip().endswith("nice 5") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert group.read_text().split()[-1] == "5", group.read_text()


def _trace(steps: int, busy: list[float], fixed: list[float], step_s: float) -> list[dict]:
    """A TP=2 trace: both ranks did the same work, at these layer and fixed times."""
    return [
        {
            "step": s,
            "step_s": step_s,
            "busy_s": [busy],
            "fixed_s": [fixed],
            "work_gflop": [[1.0, 1.0]],
            "efficiency": [compute_efficiency([1.0, 1.0], busy, fixed)],
        }
        for s in range(steps)
    ]


def test_capacity_ideal_gain_captured_and_goals():
    """T_cap = T_homog x sum(r_homog) / sum(r_i) from each run's core shares; gain captured =
    (T_static / T - 1) / (T_static / T_cap - 1); the old compute-only ideal beside it."""
    calm = summarize("tp", "static", False, [_trace(10, [0.2, 0.2], [0.05, 0.05], 0.3)], [1.0, 0.9], skip=4)
    static = summarize("tp", "static", True, [_trace(10, [0.2, 0.4], [0.05, 0.1], 0.6)], [1.0, 0.5], skip=4)
    migrate = summarize(
        "tp", "migrate", True, [_trace(10, [0.3, 0.3], [0.05, 0.1], 0.45)], [1.0, 0.5], skip=4
    )
    semi = summarize("tp", "semi", True, [_trace(10, [0.3, 0.3], [0.05, 0.1], 0.55)], [1.0, 0.5], skip=4)
    rows = [calm, static, migrate, semi]
    add_capacity(rows)
    assert static["movable"] == [0.2, 0.4] and static["fixed"] == [0.05, 0.1]
    assert static["waits"] == pytest.approx([0.35, 0.1])  # the step less each rank's own work
    # Homogeneous 0.3 s at shares 1 and 0.9; contended 1 and 0.5: the cores do 1.5 / 1.9 of the work.
    assert migrate["capacity_s"] == pytest.approx(0.3 * 1.9 / 1.5) == calm["capacity_s"] * 1.9 / 1.5
    assert migrate["speedup"] == pytest.approx(0.6 / 0.45)
    assert migrate["gain_captured"] == pytest.approx((0.6 / 0.45 - 1) / (0.6 / 0.38 - 1))
    assert static["gain_captured"] == pytest.approx(0.0)
    # The layers at speeds 1 and 0.5 split ideally take 2 / (1/0.2 + 1/0.4) = 0.267 s: E 2/3 of 0.4 s.
    assert static["compute_ideal_s"] == pytest.approx(0.6 - 0.4 / 3)
    lines = goals(rows)
    assert lines[0].startswith(
        "tp migrate: 0.450 s/step, speed-up 1.333, capacity ideal 0.380 s (core shares 1.00 0.50)"
    )
    assert lines[0].endswith("gain captured 0.58 (goal >= 0.8) -> MISSED")
    assert len(lines) == 2  # migrate and semi: static and the homogeneous run have no goal


def test_ownership_saving_is_the_optimizer_phase_it_would_shorten():
    """Rank 1 (optimizer step 0.15 s) sent half its units to rank 0 (0.05 s): with ownership moving, each
    rank's optimizer work scales by 1 - unit_share x (sent - hosted), and the synchronous phase is the
    slower of them. A trace without optimizer times (an older run) has no figure."""
    rows = [{"optimizer_s": [[0.05, 0.15]], "sent": [[0.0, 0.5]], "hosted": [[0.5, 0.0]]}] * 3
    assert ownership_saving([rows], skip=0, unit_share=1.0) == pytest.approx(0.15 - 0.075)
    assert ownership_saving([rows], skip=0, unit_share=0.5) == pytest.approx(0.15 - 0.1125)
    even = [{"optimizer_s": [[0.05, 0.15]], "sent": [[0.0, 0.0]], "hosted": [[0.0, 0.0]]}]
    assert ownership_saving([even], skip=0) == 0.0
    assert math.isnan(ownership_saving([_trace(3, [0.2, 0.2], [0.05, 0.05], 0.3)], skip=0))
    assert 0.9 < UNIT_SHARE < 1.0  # the benchmark's GPT: 4 layers of hidden 512 beside a 1024-word embedding


def test_a_run_pins_the_ranks_and_reads_every_stage_trace(tmp_path, monkeypatch):
    import json

    import benchmarks.real_contention as bench

    monkeypatch.setattr(bench, "RUNS", tmp_path)
    launched = []

    def fake_torchrun(script, nproc, args, log):
        launched.append((script, nproc, args, log, os.environ.get("MEGAHET_CORES")))
        trace = Path(args[args.index("--balance.trace") + 1])
        trace.write_text(json.dumps({"step": 0}) + "\n")  # PP 1 (TP, DP): one trace
        for stage in (0, 1):
            path = trace.with_name(f"{trace.stem}_stage{stage}{trace.suffix}")
            path.write_text(json.dumps({"step": 0, "stage": stage}) + "\n")
        return 1.0

    monkeypatch.setattr(bench, "torchrun", fake_torchrun)
    traces, shares = bench.run(
        "pp", "measured", False, 12, [0, 1], ["--resize.selection", "random"], tag="x_"
    )
    ((script, nproc, args, log, cores),) = launched
    assert (script, nproc, log, cores) == (
        "tools/pin_ranks.py",
        2,
        tmp_path / "x_pp_measured_calm.log",
        "0,1",
    )
    splits = [args[i + 1] for i, a in enumerate(args) if a == "--hetero.pp_split"]
    assert splits == ["even", "measured"]  # the layout's, then the mode's (the last one wins)
    assert args[-2:] == ["--resize.selection", "random"]
    assert [t[0]["stage"] for t in traces] == [0, 1] and len(shares) == 2
    assert "MEGAHET_CORES" not in os.environ
    assert args[args.index("--train.global_batch_size") + 1] == "8"  # four micro-batches of 2
    bench.run("dp", "measured", True, 12, [0, 1])
    dp_args = launched[-1][2]
    # DP shares move whole micro-batches: sixteen of one sequence leave the planner room.
    assert dp_args[dp_args.index("--train.micro_batch_size") + 1] == "1"
    assert dp_args[dp_args.index("--train.global_batch_size") + 1] == "16"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "resize.selection=random"], "give them their own --name"),
        (["--set", "balance.mode=semi", "--name", "x"], "--set balance.mode: the benchmark sets it"),
        (["--set", "oops", "--name", "x"], "expected KEY=VALUE"),
        (["--cases", "dp", "--modes", "semi"], "no case has mode"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, monkeypatch):
    import benchmarks.real_contention as bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)
