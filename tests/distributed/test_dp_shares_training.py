"""Heterogeneous data parallelism in real `pretrain()` runs: uneven shares train exactly as the even split.

Equivalence: the same 12-step job as test_training.py (a global batch of 4 micro-batches of 2), with
replica 1 declared 0.4x as fast (`--hetero.speeds`, `--hetero.dp_shares declared`), so replica 0 runs
3 micro-batches of every global batch and replica 1 runs 1. Each replica's loss is scaled by D n_r / M,
so every sample weighs what it weighs in the single-rank reference: per-step loss and gradient norm,
and every parameter after training, must match it within the tolerances of test_training.py. Layouts:
- DP=2, ZeRO-1;
- PP=2 x DP=2, ZeRO-1 (each pipeline runs its own number of micro-batches through 1F1B);
- TP=2 x DP=2, ZeRO-1, with the slow replica's TP rank 1 migrating half its units to TP rank 0
  (a TP-balanced replica: lossless, so still the reference's numbers).

Reaction: TP=1 x DP=2 with a virtual device over the whole mesh that makes replica 1 4x slow from
step 6 to 18 (`--device.profile schedule:...` with one speed per global rank) and
`--hetero.dp_shares measured`: the shares follow the measured speeds within a few steps and return to
even when replica 1 recovers.

Run: python -m pytest tests/distributed/test_dp_shares_training.py -q   (about 3 minutes on 2 idle CPU cores)
"""

from __future__ import annotations

from pathlib import Path

from harness import read_records, torchrun
from test_training import STEPS, _common, _train, check_run, reference  # noqa: F401 (a fixture)

UNEVEN = "--parallel.zero_stage 1 --hetero.dp_shares declared --hetero.speeds"


def _shares(metrics: Path) -> list[tuple[int, int]]:
    """(micro-batches of replica 0, of replica 1) at every logged step."""
    records = read_records(metrics)
    return [
        (int(r["share_dp0"]), int(r["share_dp1"])) for _, r in sorted(records.items()) if "share_dp0" in r
    ]


def _uneven_run(tmp_path: Path, nproc: int, name: str, extra: str, gpt_data, init=None) -> dict:
    metrics = tmp_path / f"{name}.jsonl"
    variant = f"{extra} --logging.metrics_file {metrics}"
    run = _train(tmp_path, nproc, {name: variant}, _common(gpt_data, tmp_path), init=init)[name]
    assert _shares(metrics) == [(3, 1)] * 3, _shares(metrics)  # logged at steps 4, 8, 12
    return run


def test_uneven_dp2_zero1_matches_dp1(reference: dict, gpt_data: list[str], tmp_path: Path):  # noqa: F811
    run = _uneven_run(tmp_path, 2, "dp2_uneven", f"{UNEVEN} 1,0.4", gpt_data)
    check_run("dp shares dp2 (3,1) vs dp1", "dp2 shares 3+1", run, reference, replicas=2, loaded=False)


def test_uneven_pp2_dp2_matches_dp1(reference: dict, gpt_data: list[str], tmp_path: Path):  # noqa: F811
    """Ranks are TP-fastest then DP then PP (megatron-core's order): replica 1 is ranks 1 and 3."""
    extra = f"--parallel.pp 2 {UNEVEN} 1,0.4,1,0.4"
    run = _uneven_run(tmp_path, 4, "pp2dp2_uneven", extra, gpt_data, init=reference["init_file"])
    check_run(
        "dp shares pp2 x dp2 (3,1) vs dp1", "pp2 dp2 shares 3+1", run, reference, replicas=2, loaded=True
    )


def test_uneven_tp2_dp2_with_a_migrating_replica_matches_dp1(
    reference: dict,  # noqa: F811
    gpt_data: list[str],
    tmp_path: Path,
):
    extra = f"--parallel.tp 2 --resize.migrate 1.1:0.5 {UNEVEN} 1,1,0.4,0.4"
    run = _uneven_run(tmp_path, 4, "tp2dp2_uneven", extra, gpt_data, init=reference["init_file"])
    check_run(
        "dp shares tp2 x dp2 migrating (3,1)", "tp2 dp2 shares 3+1", run, reference, replicas=2, loaded=True
    )


SLOW_FROM, SLOW_UNTIL, REACTION_STEPS = 6, 18, 30


def test_measured_shares_follow_a_slow_replica_and_return_to_even(gpt_data: list[str], tmp_path: Path):
    """16 micro-batches of 1; replica 1 at 1/4 speed gets about 16 / 5 of them, and 8 again after."""
    metrics = tmp_path / "metrics.jsonl"
    profile = f"schedule:0=1,1;{SLOW_FROM}=1,0.25;{SLOW_UNTIL}=1,1"
    args = [
        *("--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_attention_heads", "4"),
        *("--model.seq_length", "32", "--train.micro_batch_size", "1", "--train.global_batch_size", "16"),
        *("--train.train_iters", str(REACTION_STEPS), "--train.log_interval", "1"),
        *("--train.eval_interval", str(REACTION_STEPS), "--train.eval_iters", "1"),
        *("--resize.enabled", "true", "--device.profile", profile, "--device.rate_gflops", "1"),
        *("--hetero.dp_shares", "measured", "--balance.trace", str(tmp_path / "trace.jsonl")),
        *(
            "--logging.wandb",
            "false",
            "--logging.metrics_file",
            str(metrics),
            "--logging.log_dir",
            str(tmp_path),
        ),
        *gpt_data,
    ]
    torchrun("../../pretrain_gpt.py", 2, args, cwd=tmp_path, timeout=300)
    records = read_records(metrics)
    shares = {
        step: (int(r["share_dp0"]), int(r["share_dp1"])) for step, r in records.items() if "share_dp0" in r
    }
    assert len(shares) == REACTION_STEPS
    # Record `step` is step index step - 1 and reports the shares that step ran with.
    assert all(shares[s] == (8, 8) for s in range(1, SLOW_FROM + 1)), shares
    slow = [s for s in range(SLOW_FROM + 1, SLOW_UNTIL + 1) if shares[s][1] <= 4]
    assert slow and slow[0] <= SLOW_FROM + 4, shares  # the median of 3 flips after 2 slow samples
    assert all(shares[s][1] <= 4 for s in range(slow[0], SLOW_UNTIL + 1)), shares
    back = [s for s in range(SLOW_UNTIL + 1, REACTION_STEPS + 1) if shares[s] == (8, 8)]
    assert back and back[0] <= SLOW_UNTIL + 4, shares
    assert all(shares[s] == (8, 8) for s in range(back[0], REACTION_STEPS + 1)), shares
    speed = records[SLOW_UNTIL]["speed_dp1"]  # measured, never read from the device profile
    assert 0.15 < speed < 0.5, speed
    assert (tmp_path / "trace_dp.jsonl").is_file() and (tmp_path / "trace_dp.png").is_file()


def test_resume_continues_with_the_saved_shares(gpt_data: list[str], tmp_path: Path):
    """A run whose replica 1 is 4x slow saves at step 8; resumed, its first step runs the saved uneven
    shares (restored from the checkpoint, not re-measured from even)."""
    common = [
        *("--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_attention_heads", "4"),
        *("--model.seq_length", "32", "--train.micro_batch_size", "1", "--train.global_batch_size", "16"),
        *("--train.log_interval", "1", "--train.eval_interval", "100", "--train.eval_iters", "1"),
        *("--resize.enabled", "true", "--device.profile", "static:1,0.25", "--device.rate_gflops", "1"),
        *("--hetero.dp_shares", "measured", "--train.save", str(tmp_path / "ckpt")),
        *("--logging.wandb", "false", "--logging.log_dir", str(tmp_path)),
        *gpt_data,
    ]
    first, resumed = tmp_path / "first.jsonl", tmp_path / "resumed.jsonl"
    torchrun(
        "../../pretrain_gpt.py",
        2,
        [*common, "--train.train_iters", "8", "--logging.metrics_file", str(first)],
        cwd=tmp_path,
    )
    load = [
        "--train.load",
        str(tmp_path / "ckpt"),
        "--train.train_iters",
        "10",
        "--logging.metrics_file",
        str(resumed),
    ]
    torchrun("../../pretrain_gpt.py", 2, [*common, *load], cwd=tmp_path)
    saved, after = read_records(first), read_records(resumed)
    assert set(after) == {9, 10}, sorted(after)
    last = (int(saved[8]["share_dp0"]), int(saved[8]["share_dp1"]))
    assert last[1] <= 4, last
    assert (int(after[9]["share_dp0"]), int(after[9]["share_dp1"])) == last


def test_declared_speeds_plan_the_tp_group_from_the_first_step(gpt_data: list[str], tmp_path: Path):
    """`--hetero.speeds 1,0.25` at TP=2 with the migrating balancer: the first step already runs with
    work moved off TP rank 1 (nothing is measured yet); without a declaration it runs even."""
    metrics = tmp_path / "metrics.jsonl"
    args = [
        *("--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_attention_heads", "4"),
        *("--model.seq_length", "32", "--train.micro_batch_size", "2", "--train.global_batch_size", "4"),
        *("--train.train_iters", "1", "--train.log_interval", "1", "--train.eval_interval", "10"),
        *("--train.eval_iters", "1", "--parallel.tp", "2", "--balance.mode", "migrate"),
        *("--hetero.speeds", "1,0.25", "--logging.wandb", "false", "--logging.log_dir", str(tmp_path)),
        *("--logging.metrics_file", str(metrics)),
        *gpt_data,
    ]
    torchrun("../../pretrain_gpt.py", 2, args, cwd=tmp_path)
    first = read_records(metrics)[1]
    assert first["moved_tp1"] > 0.5 and first["moved_tp0"] < -0.5, first  # ideal share 0.25 / 1.25 = 0.2
