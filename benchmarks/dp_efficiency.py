"""The efficiency benchmark's data-parallel profiles: whole replicas slow, shares of the batch by speed.

    python benchmarks/dp_efficiency.py                          # every profile (~10 min on 2 quiet cores)
    python benchmarks/dp_efficiency.py --profiles tp2dp2_4x --slow-steps 10

As benchmarks/balance_efficiency.py does for TP groups: for each profile, real torchrun launches of
pretrain_gpt.py (virtual devices over the whole mesh: one speed per global rank, `--device.profile
schedule:...`) run the same job with even data-parallel shares (`static`: what plain data parallelism
gets, mean / min of the replica speeds), with `--hetero.dp_shares measured`, and once on the profile's
homogeneous *twin*: every device at the profile's mean speed at that step, even shares (same total speed,
same all-reduces, same framework overhead). A profile is homogeneous for `--warmup` steps, then the
slow replicas arrive (an event the balancer must react to), and after `--slow-steps` they recover.

Per profile x mode: the median step time over the slow phase, T_opt (the twin's median over it),
E = T_opt / T, the speed-up over static, and the reaction: after the slow replicas arrive (`react_slow`)
and after they recover (`react_back`), the steps until the step time is within 5 % of the twin's median
over that phase. Also the bound whole-micro-batch shares allow: the slowest replica's time under the
best split of M micro-batches over the replica speeds, against the twin's M / sum(speeds) (`split_bound`).

Writes benchmarks/results/dp_efficiency.{md,json,png}; metrics and per-run DP trace PNGs go to
benchmarks/results/dp_efficiency_runs/.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.balance_efficiency import (
    reaction,
    run_profiles,
    slow_phase_args,
    slow_phase_meta,
    write_results,
)
from benchmarks.common import RESULTS, torchrun
from megahet.policy.dp_shares import dp_shares, step_time

RUNS = RESULTS / "dp_efficiency_runs"
MODES = ("static", "measured")
MICRO_BATCHES = 16
# The TP benchmark's GPT (many small units), 16 micro-batches of one sample per step: shares in
# sixteenths of the global batch.
MODEL = [
    *("--model.num_layers", "2", "--model.hidden_size", "256", "--model.num_attention_heads", "64"),
    *("--model.ffn_hidden_size", "1024", "--model.seq_length", "64", "--data.vocab_size", "1024"),
    *("--train.micro_batch_size", "1", "--train.global_batch_size", str(MICRO_BATCHES)),
    *("--resize.enabled", "true"),  # the resizable layers count the FLOPs a virtual device charges
]


@dataclasses.dataclass(frozen=True)
class DpProfile:
    name: str
    tp: int
    replicas: tuple[float, ...]
    """Each DP replica's speed while slow (every TP rank of a replica alike)."""

    @property
    def world(self) -> int:
        return self.tp * len(self.replicas)

    def rank_speeds(self, replicas) -> str:
        """One speed per global rank (TP fastest, then DP: megatron-core's order at PP=1)."""
        return ",".join(f"{s:.6g}" for s in replicas for _ in range(self.tp))

    def spec(self, warmup: int, slow: int, twin: bool = False) -> str:
        mean = statistics.fmean(self.replicas)
        slow_speeds = [mean] * len(self.replicas) if twin else self.replicas
        even = self.rank_speeds([1] * len(self.replicas))
        return f"schedule:0={even};{warmup}={self.rank_speeds(slow_speeds)};{warmup + slow}={even}"

    def split_bound(self) -> float:
        """Twin time over the best whole-micro-batch split's slowest replica time (<= 1)."""
        shares = dp_shares(self.replicas, MICRO_BATCHES, healthy_gap=0.0)
        return (MICRO_BATCHES / sum(self.replicas)) / step_time(shares, self.replicas)


PROFILES = [
    DpProfile("tp2dp2_2x", 2, (1.0, 0.5)),
    DpProfile("tp2dp2_4x", 2, (1.0, 0.25)),
    DpProfile("dp4_mixed", 1, (1.0, 1.0, 0.5, 0.25)),
]


def run(profile: DpProfile, mode: str, spec: str, rate: float, steps: int) -> list[dict]:
    """One launch; its per-step metrics records (step time per step: log_interval 1)."""
    name = f"{profile.name}_{mode}"
    metrics = RUNS / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    shares = "measured" if mode == "measured" else "even"
    args = [
        *MODEL,
        *("--parallel.tp", str(profile.tp), "--device.profile", spec, "--device.rate_gflops", str(rate)),
        *("--hetero.dp_shares", shares, "--train.train_iters", str(steps), "--train.log_interval", "1"),
        *("--train.eval_interval", str(10 * steps), "--train.eval_iters", "1", "--logging.wandb", "false"),
        *("--logging.metrics_file", str(metrics), "--logging.log_dir", str(RUNS / "logs")),
    ]
    if mode == "measured":
        args += ["--balance.trace", str(RUNS / f"{name}_trace.jsonl")]  # the DP trace: <name>_trace_dp.jsonl
    wall = torchrun("pretrain_gpt.py", profile.world, args, RUNS / f"{name}.log")
    print(f"  {name}: {wall:.0f} s", flush=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return sorted((r for r in rows if "step_time_s" in r), key=lambda r: r["step"])


def bench_profile(profile: DpProfile, warmup: int, slow: int, rate: float) -> tuple[list[dict], dict]:
    steps = warmup + 2 * slow
    records = {
        mode: run(profile, mode, profile.spec(warmup, slow, twin=mode == "twin"), rate, steps)
        for mode in ("twin", *MODES)
    }
    times = {mode: [r["step_time_s"] for r in rows] for mode, rows in records.items()}
    phase = slice(warmup, warmup + slow)
    t_opt = statistics.median(times["twin"][phase])
    static = statistics.median(times["static"][phase])
    out = []
    for mode in MODES:
        t = statistics.median(times[mode][phase])
        row = {
            "profile": profile.name,
            "mode": mode,
            "speeds": "/".join(f"{s:g}" for s in profile.replicas),
            "step_time_s": t,
            "t_opt_s": t_opt,
            "efficiency": t_opt / t,
            "speedup_vs_static": static / t,
            "static_bound": min(profile.replicas) / statistics.fmean(profile.replicas),
            "split_bound": profile.split_bound(),
            "shares_slow": None,
            "react_slow": None,
            "react_back": None,
        }
        if mode == "measured":
            shares = [[int(r[f"share_dp{d}"]) for d in range(len(profile.replicas))] for r in records[mode]]
            row["shares_slow"] = "/".join(map(str, shares[warmup + slow - 1]))
            row["react_slow"] = reaction(times[mode], times["twin"], [warmup], warmup + slow)
            row["react_back"] = reaction(times[mode], times["twin"], [warmup + slow], steps)
            trace = RUNS / f"{profile.name}_measured_trace_dp.jsonl"
            from megahet.runtime.trace_plot import plot_dp_trace

            plot_dp_trace(
                trace, trace.with_suffix(".png"), title=f"{profile.name}: replica speeds {row['speeds']}"
            )
        out.append(row)
    return out, times


GOAL = 0.90


def main(argv: list[str] | None = None) -> None:
    args = slow_phase_args(__doc__, "dp_efficiency", "the slow replicas", 12, "as many", argv)
    RUNS.mkdir(parents=True, exist_ok=True)
    chosen, rows, all_times, wall = run_profiles(
        "dp_efficiency",
        PROFILES,
        args.profiles,
        lambda p: bench_profile(p, args.warmup, args.slow_steps, args.rate),
        lambda p: f"{p.name} (TP={p.tp} x DP={len(p.replicas)}, {p.spec(args.warmup, args.slow_steps)})",
    )
    meta = slow_phase_meta(MODEL, args, chosen, wall)
    columns = list(rows[-1])
    lines = [
        f"- {r['profile']} measured: E {r['efficiency']:.3f} vs >= {GOAL:.2f} -> "
        f"{'met' if r['efficiency'] >= GOAL else 'MISSED'} (static {s['efficiency']:.3f}, static bound "
        f"{r['static_bound']:.3f}; speed-up over static {r['speedup_vs_static']:.2f}x); reaction "
        f"{r['react_slow']} steps to the slow replicas, {r['react_back']} back"
        for r, s in zip(rows[1::2], rows[0::2])
    ]
    write_results(args.name, rows, columns, meta, lines, all_times)


if __name__ == "__main__":
    main()
