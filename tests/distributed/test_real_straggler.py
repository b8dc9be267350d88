"""A real straggler, no virtual device: two ranks pinned to their own cores (tools/pin_ranks.py) train
the GPT; part-way through, two busy processes start competing for one rank's core (multi-tenant
contention: it gets a third of its core): rank 1's, unless outside load already left one rank with less
of its core (then that rank's, so that the contended rank is the slower one whichever core the machine
loads). Outside load on the contended core dilutes the tenants (a busy loop there leaves rank 1 half its
core when calm, and two tenants take it to a quarter, not a third of its peer's): their number is scaled
by one over the calm share, so that the contention is the planned one on a busy machine too. What each
rank got of its core is read from the kernel (/proc/PID/schedstat) at every step, and the checks follow
it.
- TP=2 with `--balance.mode migrate`: before it, the measured speeds agree within a few percent and the
  balancer changes nothing; after it, rank 1's own compute (collective waits excluded) shows it slow,
  work migrates to rank 0 within a few steps, and its compute falls (the step time is the benchmark's
  to measure: benchmarks/real_contention.py).
- DP=2 with `--hetero.dp_shares measured`: the shares stay even while calm; after it, replica 1's
  measured speed drops and it gets fewer of the 16 micro-batches of every global batch.
- PP=2 with `--hetero.pp_split measured` (rank 1 is stage 1): after it, stage 1's measured time per
  layer doubles and the stages are re-split (checkpoint -> reshard -> rebuild, in the same processes)
  so that it holds fewer of the 8 layers.
- TP=2 with `--balance.mode semi` under contention that grows in steps (a lower-priority tenant, then two
  of equal priority): rank 1 resizes while its gap is mild and migrates once it is heavy.

Tenants are busy loops in sessions of their own (`benchmarks.contention.competing_process`); a tenant's
`nice` is its autogroup's, so it takes its weight's share of the core (nice 5: about a quarter)."""

from __future__ import annotations

import statistics

import pytest
from contended import CALM_STEPS, ContendedRun, Tenants, contended_run

from megahet.policy.planner import ideal_shares

# SEMI under a gap that grows in steps: a tenant at nice 5 from the calm phase's end (rank 1 keeps ~0.7 of
# its core: mild), then two at nice 0 from GAP_GROWS (~0.3: heavy). Window 3: each phase's plan settles
# within a few steps.
MILD_NICE, GAP_GROWS, SEMI_STEPS, SEMI_TOLERANCE, SEMI_HEALTHY_GAP = 5, 16, 30, 0.35, 0.1
SEMI_BALANCE = (
    f"--parallel.tp 2 --balance.mode semi --balance.window 3 --balance.healthy_gap {SEMI_HEALTHY_GAP} "
    f"--balance.tolerance {SEMI_TOLERANCE}"
)


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
def tp_run(tmp_path_factory, gpt_data) -> ContendedRun:
    return contended_run(tmp_path_factory.mktemp("real_straggler"), gpt_data, TP_BALANCE)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, gpt_data) -> ContendedRun:
    return contended_run(tmp_path_factory.mktemp("real_straggler_dp"), gpt_data, DP_SHARES)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, gpt_data) -> ContendedRun:
    return contended_run(tmp_path_factory.mktemp("real_straggler_pp"), gpt_data, PP_SPLIT)


def test_no_straggler_measured_speeds_agree_and_nothing_moves(tp_run):
    """Calm, the two ranks measure within the healthy gap and nothing moves. Outside load on the pinned
    cores during the calm phase is contention too: if it left one rank slower throughout, no work moves
    to that rank and it measures the slower; if it came and went, the speeds need only agree within
    twice the gap, and a move is allowed."""
    run = tp_run
    calm = run.steps(3, run.contended_from)
    assert calm
    slow, fast = f"speed_tp{run.slow}", f"speed_tp{run.fast}"
    if run.skewed:
        assert all(r[f"moved_tp{run.fast}"] <= 0.0 for r in calm), calm
        assert statistics.median(r[slow] for r in calm) < statistics.median(r[fast] for r in calm), calm
        return
    for r in calm:
        assert min(r[slow], r[fast]) > 1 - (2 if run.disturbed else 1) * TP_HEALTHY_GAP, r
        assert run.disturbed or (r["plan_changes_max"] == 0 and r[f"moved_tp{run.slow}"] == 0.0), r


def test_contended_rank_is_detected_and_work_migrates_within_a_few_steps(tp_run):
    run = tp_run
    moved_key = f"moved_tp{run.slow}"
    moved = run.first_step(run.contended_from, lambda r: r[moved_key] > 0)
    assert moved <= run.contended_from + (12 if run.disturbed else 6), (moved, run.contended_from)
    late = run.steps(moved + 3)
    # The competing processes take about two thirds of the slow rank's core: its measured speed says so.
    assert statistics.median(r[f"speed_tp{run.slow}"] for r in late) < 0.8
    assert all(r[f"speed_tp{run.fast}"] == 1.0 and r[moved_key] > 0.1 for r in late)


def test_slow_compute_falls_once_the_plan_changes(tp_run):
    """The slow rank's compute falls and the group's compute efficiency rises once work has moved: what
    the plan controls. The step time is a speed goal, measured side by side by
    benchmarks/real_contention.py (against the capacity ideal, docs/benchmarks.md), not asserted here: the gain is
    ~10 % on this 2-core machine (the contended rank's collectives, optimizer step and transfers slow
    down too, and no plan moves those), within the noise of the two unbalanced steps a test can see: the
    test asserts the direction with a 3 % margin and the balance (balance_eff) itself.

    The unbalanced steps are those after the contention started and before the plan changed: the
    balancer can react as early as the second (CI saw it), and the first may be only partly contended,
    so the worst of them is the reference (a plan that moved on slow samples had at least one). Where
    outside load had already moved work off the slow rank when calm, the change is the move beyond it
    (measured: 0.31 of its units moved at a core share of 0.47, then 0.60 at 0.23)."""
    run = tp_run
    moved_key = f"moved_tp{run.slow}"
    calm_moved = run.rows[run.contended_from][moved_key]
    final = statistics.median(r[moved_key] for r in run.steps(run.last - 4))
    if final <= calm_moved + 0.02:
        _already_balanced_for_the_outside_load(run)
        return
    # The change: past half of the way to the final plan (a small adjustment can come first).
    moved = run.first_step(run.contended_from, lambda r: r[moved_key] > (calm_moved + final) / 2)
    unbalanced = run.steps(run.contended_from + 1, moved - 1)
    balanced = run.steps(moved + 3)
    assert unbalanced, (run.contended_from, moved)
    worst_compute = max(r["compute_max_s"] for r in unbalanced)
    after = statistics.median(r["compute_max_s"] for r in balanced)
    print(f"slowest rank's compute: worst unbalanced {worst_compute:.3f} s, balanced median {after:.3f} s")
    # Direction with a margin, not the size of the gain: the contended rank's share of its core varies
    # with whatever else runs (CI measured falls of 5-15 %); the balance itself is asserted below (from
    # a calm plan; a plan already made for a rank at half its core is off by less when it slows more).
    assert after < 0.97 * worst_compute
    assert run.skewed or min(r["balance_eff"] for r in unbalanced) < 0.8
    balanced_eff = 0.8 if run.fast_disturbed else 0.9
    if run.fast_disturbed:  # measured: E 0.86 with the fast rank at 0.63 of its core while contended
        print(f"outside load on the fast rank too (core shares {run.contended_shares}): balance_eff > 0.8")
    assert statistics.median(r["balance_eff"] for r in balanced) > balanced_eff


def _already_balanced_for_the_outside_load(run: ContendedRun) -> None:
    """No further move after the contention started: only right where outside load had already slowed the rank
    as much in the calm phase (a second busy process on its core need not slow it further: the kernel
    shares a core between process groups first), so that the calm plan was made for it. Then the rank's
    estimated speed is what the kernel gave it, and the group is balanced."""
    assert run.skewed, f"no work moved after rank {run.slow} was contended (shares {run.contended_shares})"
    late = run.steps(run.contended_from + 1)
    kernel = run.contended_shares[run.slow] / run.contended_shares[run.fast]
    estimated = statistics.median(r[f"speed_tp{run.slow}"] for r in late)
    print(f"calm plan kept: estimated speed {estimated:.2f}, kernel share ratio {kernel:.2f}")
    assert abs(estimated - kernel) < 0.15, (estimated, kernel)
    assert statistics.median(r["balance_eff"] for r in late) > 0.9


def test_contended_replica_gets_a_smaller_share_of_the_batch(dp_run):
    """Calm replicas measured up to ~30 % apart here (two pinned ranks on a 2-core machine, each with
    0.95 of its core): at most one of the 16 micro-batches moves while calm.
    Outside load on the pinned cores during the calm phase (a busy shared machine) makes them uneven by
    chance: then the calm phase is not held to that (if it left one replica slower throughout, that one
    never gets more than its half), and the reaction is given twice the steps (said in the log)."""
    run = dp_run
    slow, fast = f"share_dp{run.slow}", f"share_dp{run.fast}"
    calm = run.steps(3, run.contended_from)
    if run.skewed:
        assert all(r[slow] <= r[fast] for r in calm), calm
    else:
        # at most one micro-batch off even: CI measured one replica at 0.71-0.79 with both ranks getting
        # 0.95 of their cores (whole replicas differ by more than their cores: the logging rank's work)
        even = all(abs(r[slow] - r[fast]) <= 2 and r[slow] + r[fast] == 16 for r in calm)
        alike = all(min(r["speed_dp0"], r["speed_dp1"]) > 0.7 for r in calm)
        assert calm and ((even and alike) or run.disturbed), calm
    moved = run.first_step(run.contended_from, lambda r: r[slow] < 8)
    assert moved <= run.contended_from + (12 if run.disturbed else 6), (moved, run.contended_from)
    late = run.steps(moved + 3)
    assert statistics.median(r[f"speed_dp{run.slow}"] for r in late) < 0.8
    assert all(r[slow] < 8 and r[slow] + r[fast] == 16 for r in late), late


def test_contended_stage_gets_fewer_layers(pp_run):
    """The contended stage gives layers away within a few steps. Where outside load left it slower for the
    whole calm phase, it may have given them already: it then ends with fewer than the run started with."""
    run = pp_run
    layers = f"layers_pp{run.slow}"
    if run.skewed:
        reference = run.rows[1][layers]
        moved = run.first_step(0, lambda r: r[layers] < reference)
    else:
        calm = [run.rows[s][layers] for s in (run.contended_from, run.contended_from - 1)]
        assert calm[0] == calm[1] >= 2, calm  # settled, with a layer to give
        reference = calm[0]
        moved = run.first_step(run.contended_from, lambda r: r[layers] < reference)
        # window 3 + patience 2: the slow samples must be the median, then asked for twice, then one step
        assert moved <= run.contended_from + 8, (moved, run.contended_from)
    late = run.steps(max(moved, run.contended_from + 1))
    assert all(r[layers] < reference and r["layers_pp0"] + r["layers_pp1"] == 8 for r in late), late
    assert statistics.median(r[f"speed_pp{run.slow}"] for r in late) < 0.8


@pytest.fixture(scope="module")
def semi_run(tmp_path_factory, gpt_data) -> ContendedRun:
    tenants = (Tenants(CALM_STEPS, processes=1, nice=MILD_NICE), Tenants(GAP_GROWS))
    return contended_run(tmp_path_factory.mktemp("real_semi"), gpt_data, SEMI_BALANCE, tenants, SEMI_STEPS)


def test_semi_follows_a_real_gap_as_it_grows(semi_run):
    """SEMI under real contention that grows in steps (issue 31): first one lower-priority tenant shares
    rank 1's core (measured: 0.69 of it, estimated speed 0.70-0.77, gap ~0.17: rank 1 resizes 0.13-0.18 of
    its units), then two tenants of equal priority (0.31 of it, speed 0.30-0.36, gap ~0.52: it migrates
    0.47-0.53 of its units to rank 0 and resizes none). The choice follows the current gap, not the first
    decision; in each phase the estimated speed is what the kernel gave the rank (its share of its core
    over the fast rank's). Outside load can make a phase's gap other than planned (a busy loop on the
    slow core leaves no mild phase; the tenants are scaled to it, but it comes and goes): each phase is
    then held to the choice its measured gap calls for, and a gap near the tolerance or the healthy gap
    to none (said in the log; a busy .ci/run measured a mild gap of 0.09, under the healthy 0.1)."""
    run = semi_run
    slow, fast = run.slow, run.fast
    gamma, moved = f"gamma_tp{slow}", f"moved_tp{slow}"
    choices, grown = [], run.phases[1][0]  # the step after which the gap grew
    for (start, shares), end in zip(run.phases, [grown, run.last], strict=True):
        settled = run.steps(end - 3, end)  # the phase's last steps: its plan has had time to follow it
        estimated = statistics.median(r[f"speed_tp{slow}"] for r in settled)
        kernel = shares[slow] / shares[fast]
        gap = 1 - ideal_shares([1.0, estimated])[1]  # the planner's gap of a TP=2 straggler
        # near the healthy gap (nothing need move) or the tolerance (either choice is right), no check
        resize = SEMI_HEALTHY_GAP + 0.05 < gap < SEMI_TOLERANCE - 0.1
        choice = "resize" if resize else "migrate" if gap > SEMI_TOLERANCE + 0.05 else None
        print(f"after step {start}: kernel share ratio {kernel:.2f}, estimated speed {estimated:.2f}, gap "
              f"{gap:.2f}: {choice or 'too near the tolerance or the healthy gap to check'}")  # fmt: skip
        assert abs(estimated - kernel) < 0.15, (start, estimated, kernel)
        if choice == "resize":
            assert all(r[gamma] > 0.03 and r[moved] == 0 for r in settled), settled
        elif choice == "migrate":
            assert all(r[gamma] == 0 and r[moved] > 0.25 for r in settled), settled
        choices.append(choice)
    if choices == [
        "resize",
        "migrate",
    ]:  # as planned: resized while mild, migrating within 6 steps of the change
        resized = run.first_step(run.contended_from, lambda r: r[gamma] > 0)
        migrated = run.first_step(run.contended_from, lambda r: r[moved] > 0)
        assert resized <= grown < migrated <= grown + 6, (resized, grown, migrated)
