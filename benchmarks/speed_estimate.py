"""How right the balancer's speed estimate is once work moves (issue 47), and what the plan it gives is worth.

    python benchmarks/speed_estimate.py                         # rates 5, 8, 100 GFLOP/s, ~2 min on 2 cores
    python benchmarks/speed_estimate.py --rates 5 --repeats 3
    python benchmarks/speed_estimate.py --checkout /tmp/before --name speed_estimate_before   # another commit
    python benchmarks/speed_estimate.py --busy --name speed_estimate_busy   # a busy process on each core

The case of tests/distributed/test_balance_e2e.py: pretrain_vit.py at TP=2, `--balance.mode migrate`, TP rank 1
a virtual device at 0.25 from step 6 to 24 of 36. A virtual device charges work / (rate x speed) and its
real compute runs inside that charge (megahet/runtime/devices.py). At 5 and 8 GFLOP/s this host is faster
than the device; at 40 and 100 it is not: a rank's real compute outruns its charge (`device_overrun_s`),
it runs at the host's speed, and the emulated ratio shrinks (the device warns). Before issue 47 the
charge was max(work / rate, real) / speed, which switched to real / speed, and so read as a slower device,
wherever a rank's real fixed work outgrew its units' work / rate: after giving units away, on a busy
host, or with the cold caches its own sleeps leave. `--busy` runs every case with a busy process pinned
to each core (`taskset`), the load of issue 47's slow-host runs.

Per run, from the trace (`units`, `busy_s`, `speed`, `phi`) and the metrics file, in the migrated phase (from
the step after the first plan change to the straggler's end): rank 1's estimated speed (median) and its
error against 0.25; the share of its units it keeps; the balanced share, from each rank's own two measured
points (its layer time at the even split while slow, and at the migrated plan: a line per rank, solved for
equal times; independent of the estimator's pooled fit); the layer-time spread (max / min busy) and the
compute spread (the console's compute_max_s / compute_min_s); the step time (median); E (balance_eff: the
after run's is the affine model's, the before run's the proportional one's, so compare the step times);
the plan changes in the slow phase. At rate 100 every rank is slow at its real fixed work (a tiny ViT's is
most of it): a quarter-speed rank's fixed work alone can outlast its peer's whole step, and no share
balances them (the balanced share is then below 0). `--checkout` runs another commit's pretrain_vit.py (e.g. a `git worktree` of the commit before) with
the same arguments: the before / after of issue 47.

Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, save_results, torchrun
from benchmarks.contention import competing_process

SLOW_FROM, SLOW_UNTIL, STEPS, SLOW = 6, 24, 36, 0.25
COLUMNS = [
    "rate_gflops", "repeat", "speed_est", "speed_err", "kept_share", "balanced_share", "share_err",
    "busy_spread", "compute_spread", "step_s", "E", "slow_plan_changes",
]  # fmt: skip


def run_args(out: Path, rate: float) -> list[str]:
    profile = f"schedule:0=1,1;{SLOW_FROM}=1,{SLOW};{SLOW_UNTIL}=1,1"
    return (
        f"--parallel.tp 2 --device.profile {profile} --device.rate_gflops {rate} --balance.mode migrate "
        f"--balance.healthy_gap 0.2 --train.train_iters {STEPS} --train.log_interval 1 "
        f"--train.eval_interval {STEPS} --train.eval_iters 2 --logging.wandb false "
        f"--logging.metrics_file {out / 'metrics.jsonl'} --logging.log_dir {out} "
        f"--balance.trace {out / 'trace.jsonl'}"
    ).split()


def _line(p: tuple[float, float], q: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two (units, time) points."""
    slope = (q[1] - p[1]) / (q[0] - p[0])
    return p[1] - slope * p[0], slope


def balanced_share(even: list[float], migrated: list[float], units: list[float]) -> float:
    """Rank 1's units at which both ranks' lines (through their even-split and migrated times) meet."""
    (a0, b0), (a1, b1) = (_line((1.0, even[r]), (units[r], migrated[r])) for r in (0, 1))
    # a0 + b0 (2 - x) = a1 + b1 x
    return (a0 + 2 * b0 - a1) / (b0 + b1)


def summarize(out: Path, rate: float, repeat: int) -> dict:
    trace = {r["step"]: r for r in map(json.loads, (out / "trace.jsonl").read_text().splitlines())}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = {r["step"] - 1: r for r in metrics if "loss" in r}  # record `step` is step index step - 1
    sent = {s: trace[s]["sent"][0][1] for s in trace}
    moved = next(s for s in range(SLOW_FROM, SLOW_UNTIL) if sent[s] > 0)
    phase = range(moved + 1, SLOW_UNTIL)
    even = [statistics.median(trace[s]["busy_s"][0][r] for s in range(SLOW_FROM, moved)) for r in (0, 1)]
    migrated = [statistics.median(trace[s]["busy_s"][0][r] for s in phase) for r in (0, 1)]
    units = (
        [statistics.median(trace[s]["units"][0][r] for s in phase) for r in (0, 1)]
        if "units" in trace[moved]
        else [1 + sent[SLOW_UNTIL - 1], 1 - sent[SLOW_UNTIL - 1]]
    )
    speed = statistics.median(trace[s]["speed"][0][1] for s in phase)
    balanced = balanced_share(even, migrated, units)
    changes = [metrics[s]["plan_changes_max"] for s in (SLOW_FROM, SLOW_UNTIL - 1)]
    return {
        "rate_gflops": rate,
        "repeat": repeat,
        "speed_est": speed,
        "speed_err": speed / SLOW - 1,
        "kept_share": units[1],
        "balanced_share": balanced,
        "share_err": units[1] - balanced,
        "busy_spread": statistics.median(
            max(trace[s]["busy_s"][0]) / min(trace[s]["busy_s"][0]) for s in phase
        ),
        "compute_spread": statistics.median(
            metrics[s]["compute_max_s"] / metrics[s]["compute_min_s"] for s in phase if s in metrics
        ),
        "step_s": statistics.median(trace[s]["step_s"] for s in phase),
        "E": statistics.median(trace[s]["efficiency"][0] for s in phase),
        "slow_plan_changes": int(changes[1] - changes[0]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5.0, 8.0, 100.0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose pretrain_vit.py runs")
    parser.add_argument("--name", default="speed_estimate")
    parser.add_argument(
        "--busy", action="store_true", help="a busy process pinned to each core during the runs"
    )
    args = parser.parse_args(argv)
    script = args.checkout.resolve() / "pretrain_vit.py"
    if not script.is_file():
        raise SystemExit(f"--checkout {args.checkout}: no pretrain_vit.py there (give a checkout of megahet)")
    if args.repeats < 1 or any(r <= 0 for r in args.rates):
        raise SystemExit("--repeats must be >= 1 and every --rates value > 0")
    load = contextlib.ExitStack()
    if args.busy:
        for core in sorted(os.sched_getaffinity(0)):
            load.enter_context(competing_process(core))
    with load:
        rows = runs(args, script)
    save_results(args.name, rows, COLUMNS, {"checkout": str(args.checkout), "slow": SLOW, "steps": STEPS,
                                            "busy": args.busy})  # fmt: skip


def runs(args: argparse.Namespace, script: Path) -> list[dict]:
    rows = []
    for repeat in range(args.repeats):
        for rate in args.rates:
            out = RESULTS / f"{args.name}_runs" / f"rate{rate:g}_{repeat}"
            out.mkdir(parents=True, exist_ok=True)
            for old in (
                "metrics.jsonl",
                "trace.jsonl",
            ):  # pretrain appends: a rerun must not read the last one
                (out / old).unlink(missing_ok=True)
            torchrun(str(script), 2, run_args(out, rate), out / "log.txt")
            rows.append(summarize(out, rate, repeat))
    return rows


if __name__ == "__main__":
    main()
