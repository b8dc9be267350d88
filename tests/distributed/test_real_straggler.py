"""A real straggler, no virtual device: two ranks pinned to their own cores (tools/pin_ranks.py) train
the GPT; part-way through, another process starts competing for rank 1's core (multi-tenant
contention).
- TP=2 with `--balance.mode migrate`: before it, the measured speeds agree within a few percent and the
  balancer changes nothing; after it, rank 1's own compute (collective waits excluded) shows it slow,
  work migrates to rank 0 within a few steps, and its compute falls (the step time is the benchmark's
  to measure: benchmarks/real_contention.py).
- DP=2 with `--hetero.dp_shares measured`: the shares stay even while calm; after it, replica 1's
  measured speed drops and it gets fewer of the 16 micro-batches of every global batch.
- PP=2 with `--hetero.pp_split measured` (rank 1 is stage 1): after it, stage 1's measured time per
  layer doubles and the stages are re-split (checkpoint -> reshard -> rebuild, in the same processes)
  so that it holds fewer of the 8 layers."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
from harness import GPT_MODEL, REPO, finish, skip_or_fail, start_torchrun, wait_until_quiet

from benchmarks.contention import competing_process, two_cores

CALM_STEPS, STEPS = 6, 26


# healthy_gap 0.2: two pinned ranks sharing a 2-core machine with the launcher and the OS measure up to
# ~10 % apart when calm (CI saw 0.907 at step 3); the contended rank runs at ~0.5.
TP_HEALTHY_GAP = 0.2
TP_BALANCE = (
    f"--parallel.tp 2 --balance.mode migrate --balance.window 5 --balance.healthy_gap {TP_HEALTHY_GAP}"
)
# DP: whole replicas (each with its own optimizer step and data) measure up to ~12 % apart when calm.
DP_SHARES = (
    "--hetero.dp_shares measured --hetero.window 5 --hetero.healthy_gap 0.15 --train.micro_batch_size 1"
)


# PP: 8 layers of hidden 256; the output layer (vocabulary 8192) weighs ~2.5 of them by FLOPs, so the calm
# stages may settle on 5,3 rather than 4,4 (the planner counts it): the test compares with the calm split.
PP_SPLIT = (
    "--parallel.pp 2 --model.num_layers 8 --model.hidden_size 256 --model.num_attention_heads 4 "
    "--train.micro_batch_size 2 --train.global_batch_size 8 --hetero.pp_split measured --hetero.window 3 "
    "--hetero.healthy_gap 0.2 --hetero.pp_patience 2"
)


@pytest.fixture(scope="module")
def records(tmp_path_factory, gpt_data) -> tuple[list[dict], int]:
    return _contended_run(tmp_path_factory.mktemp("real_straggler"), gpt_data, TP_BALANCE)


@pytest.fixture(scope="module")
def dp_records(tmp_path_factory, gpt_data) -> tuple[list[dict], int]:
    return _contended_run(tmp_path_factory.mktemp("real_straggler_dp"), gpt_data, DP_SHARES)


@pytest.fixture(scope="module")
def pp_records(tmp_path_factory, gpt_data) -> tuple[list[dict], int]:
    return _contended_run(tmp_path_factory.mktemp("real_straggler_pp"), gpt_data, PP_SPLIT)


CALM_LOAD: dict[str, float] = {}
"""Per run (its extra arguments): the 1-minute load average when its calm phase ended."""
OUTSIDE_LOAD = 3.0
"""A load average above this on the 2 cores the ranks are pinned to means other processes competed with
the calm phase (the two ranks alone load them by about 2): the ranks then look uneven by chance."""


def _calm_was_disturbed(extra: str) -> bool:
    """Whether outside load disturbed the run's calm phase; says so on stdout (the test log) if it did."""
    load = CALM_LOAD.get(extra, 0.0)
    if load > OUTSIDE_LOAD:
        print(
            f"calm phase under outside load (1-min load average {load:.1f} on 2 cores): calm checks relaxed"
        )
    return load > OUTSIDE_LOAD


def _contended_run(out, gpt_data, extra: str) -> tuple[list[dict], int]:
    """The records of a 2-rank run whose rank 1 shares its core with a busy process after CALM_STEPS."""
    cores = two_cores()
    if cores is None:
        skip_or_fail("needs two CPU cores to pin the two ranks to (os.sched_getaffinity)")
    metrics = out / "metrics.jsonl"
    wait_until_quiet()
    args = [
        str(REPO / "pretrain_gpt.py"),
        *GPT_MODEL,
        *gpt_data,
        *["--model.hidden_size", "512", "--model.num_attention_heads", "8", "--model.num_layers", "2"],
        *["--model.seq_length", "128", "--train.log_interval", "1"],
        *["--train.micro_batch_size", "4", "--train.global_batch_size", "16"],
        *(f"--train.train_iters {STEPS} --train.eval_interval {STEPS} --train.eval_iters 1").split(),
        *(f"--logging.wandb false --logging.metrics_file {metrics} --logging.log_dir {out}").split(),
        *extra.split(),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGAHET_CORES", ",".join(map(str, cores)))  # rank r on cores[r]
        proc, cmd = start_torchrun("../../tools/pin_ranks.py", 2, args, cwd=out)
    contended_from = None
    deadline = time.monotonic() + 300
    while proc.poll() is None and contended_from is None and time.monotonic() < deadline:
        steps = [json.loads(line).get("step", 0) for line in _lines(metrics)]
        if steps and max(steps) >= CALM_STEPS:
            contended_from = max(steps)
            break
        time.sleep(0.05)
    if contended_from is None:
        finish(proc, cmd, "pretrain_gpt.py", 2, timeout=30)
        pytest.fail("the run ended or stalled before the contention could start")
    CALM_LOAD[extra] = os.getloadavg()[0]  # over the calm phase's last minute: this run's 2 ranks + others
    with competing_process(cores[1]):
        finish(proc, cmd, "pretrain_gpt.py", 2, timeout=300)
    rows = [json.loads(line) for line in _lines(metrics)]
    return [r for r in rows if "loss" in r], contended_from


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_no_straggler_measured_speeds_agree_and_nothing_moves(records):
    """Calm, the two ranks measure within the healthy gap and nothing moves. Another process on the
    pinned cores during the calm phase (a busy shared machine: `_calm_was_disturbed` says so in the log)
    is contention too: then the speeds need only agree within twice the gap, and a move is allowed."""
    rows, contended_from = records
    calm = [r for r in rows if 3 <= r["step"] <= contended_from]
    assert calm
    disturbed = _calm_was_disturbed(TP_BALANCE)
    for r in calm:
        assert min(r["speed_tp0"], r["speed_tp1"]) > 1 - (2 if disturbed else 1) * TP_HEALTHY_GAP, r
        assert disturbed or (r["plan_changes_max"] == 0 and r["moved_tp1"] == 0.0), r


def test_contended_rank_is_detected_and_work_migrates_within_a_few_steps(records):
    rows, contended_from = records
    by_step = {r["step"]: r for r in rows}
    moved = next(s for s in range(contended_from + 1, STEPS + 1) if by_step[s]["moved_tp1"] > 0)
    assert moved <= contended_from + (12 if _calm_was_disturbed(TP_BALANCE) else 6), (moved, contended_from)
    late = [by_step[s] for s in range(moved + 3, STEPS + 1)]
    # The competing process takes about half of rank 1's core: its measured speed says so.
    assert statistics.median(r["speed_tp1"] for r in late) < 0.8
    assert all(r["speed_tp0"] == 1.0 and r["moved_tp1"] > 0.1 for r in late)


def test_slow_compute_falls_once_the_plan_changes(records):
    """The slow rank's compute falls and the group's compute efficiency rises once work has moved: what
    the plan controls. The step time is a speed goal, measured side by side by
    benchmarks/real_contention.py (migrate 0.978 of the ideal speed-up), not asserted here: the gain is
    ~10 % on this 2-core machine (the contended rank's collectives, optimizer step and transfers slow
    down too, and no plan moves those), within the noise of the two unbalanced steps a test can see: the
    test asserts the direction with a 3 % margin and the balance (balance_eff) itself.

    The unbalanced steps are those after the contention started and before the plan changed: the
    balancer can react as early as the second (CI saw it), and the first may be only partly contended,
    so the worst of them is the reference (a plan that moved on slow samples had at least one)."""
    rows, contended_from = records
    by_step = {r["step"]: r for r in rows}
    moved = next(s for s in range(contended_from + 1, STEPS + 1) if by_step[s]["moved_tp1"] > 0)
    unbalanced = [by_step[s] for s in range(contended_from + 1, moved)]
    balanced = [by_step[s] for s in range(moved + 3, STEPS + 1)]
    assert unbalanced, (contended_from, moved)
    worst_compute = max(r["compute_max_s"] for r in unbalanced)
    after = statistics.median(r["compute_max_s"] for r in balanced)
    print(f"slowest rank's compute: worst unbalanced {worst_compute:.3f} s, balanced median {after:.3f} s")
    # Direction with a margin, not the size of the gain: the contended rank's share of its core varies
    # with whatever else runs (CI measured falls of 5-15 %); the balance itself is asserted below.
    assert after < 0.97 * worst_compute
    assert min(r["balance_eff"] for r in unbalanced) < 0.8
    assert statistics.median(r["balance_eff"] for r in balanced) > 0.9


def test_contended_replica_gets_a_smaller_share_of_the_batch(dp_records):
    rows, contended_from = dp_records
    by_step = {r["step"]: r for r in rows}
    calm = [by_step[s] for s in range(3, contended_from + 1)]
    # Calm replicas measured up to ~12 % apart here (two pinned ranks on a 2-core machine): healthy
    # (hetero.healthy_gap 0.15), and beyond it the hysteresis moves no sample for a gap below ~17 %.
    # Another process on the pinned cores (a busy shared machine) makes them uneven by chance: then the
    # calm phase is not held to that, and the reaction is given twice the steps (said in the log).
    even = all(r["share_dp0"] == r["share_dp1"] == 8 for r in calm)
    alike = all(min(r["speed_dp0"], r["speed_dp1"]) > 0.8 for r in calm)
    disturbed = _calm_was_disturbed(DP_SHARES)
    assert calm and ((even and alike) or disturbed), (calm, CALM_LOAD)
    moved = next(s for s in range(contended_from + 1, STEPS + 1) if by_step[s]["share_dp1"] < 8)
    assert moved <= contended_from + (12 if disturbed else 6), (moved, contended_from, CALM_LOAD)
    late = [by_step[s] for s in range(moved + 3, STEPS + 1)]
    assert statistics.median(r["speed_dp1"] for r in late) < 0.8
    assert all(r["share_dp1"] < 8 and r["share_dp0"] + r["share_dp1"] == 16 for r in late), late


def test_contended_stage_gets_fewer_layers(pp_records):
    rows, contended_from = pp_records
    by_step = {r["step"]: r for r in rows}
    calm = [by_step[s]["layers_pp1"] for s in (contended_from, contended_from - 1)]
    assert calm[0] == calm[1] >= 2, calm  # settled, with a layer to give
    moved = next(s for s in range(contended_from + 1, STEPS + 1) if by_step[s]["layers_pp1"] < calm[0])
    # window 3 + patience 2: the slow samples must be the median, then asked for twice, then one step
    assert moved <= contended_from + 8, (moved, contended_from)
    late = [by_step[s] for s in range(moved, STEPS + 1)]
    assert all(r["layers_pp1"] < calm[0] and r["layers_pp0"] + r["layers_pp1"] == 8 for r in late), late
    assert statistics.median(r["speed_pp1"] for r in late) < 0.8
