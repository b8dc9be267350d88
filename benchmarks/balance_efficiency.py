"""How close the balancer gets to the physical limit: E = T_opt / T_measured per profile x mode.

    python benchmarks/balance_efficiency.py                      # every profile (~25 min on 2 quiet cores)
    python benchmarks/balance_efficiency.py --profiles tp4_4x --steps 12   # one, shorter
    python benchmarks/balance_efficiency.py --profiles tp4_2x --update     # rerun one into the table
    python benchmarks/balance_efficiency.py --overhead-only --overhead-repeats 8   # only the overhead

For each straggler profile, real torchrun launches of pretrain_gpt.py (a small GPT with many heads
so that whole units can follow the speeds; virtual devices, `--balance.trace`) run the same job in
four modes — static, resize, migrate, semi — and once on its homogeneous *twin*: every device at the
profile's mean speed at that step (same total speed, same all-reduces, same framework overhead).
T_opt is the twin's measured step time, so communication and overheads cancel (docs/design.md §2). Runs of
one profile follow each other, so machine noise hits them alike. Static profiles start homogeneous
for `--warmup` steps, so that the straggler's arrival is an event the balancer must react to.

Per profile x mode: median step time over the steps after the warm-up, T_opt (the twin's median),
E = T_opt / T, the speed-up over static, and the reaction: after each change of the speeds (not the
first, which is the warm-up), the steps until the step time is within 5 % of the twin's at that
phase (max over changes); the same on the slowest rank's compute time (`reaction_compute_steps`,
immune to communication noise from other jobs on the machine). Also the compute-only bound
mean(s) / min(s), and the balancer's overhead on a homogeneous group (static without any balancer vs
semi, interleaved runs). Run it on a quiet machine: other jobs slow the real (uncharged) part of a
step, and the twin is measured in other minutes than the run it is compared with.

Writes benchmarks/results/balance_efficiency.{md,json,png}; traces and per-run PNGs go to
benchmarks/results/balance_efficiency_runs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, markdown_table, save_results, torchrun
from megahet.policy.speed_profile import parse_profile
from megahet.runtime.trace_plot import plot_trace, read_trace

RUNS = RESULTS / "balance_efficiency_runs"
MODES = ("static", "resize", "migrate", "semi")
# A small GPT whose blocks have many units per rank (64 heads: 16 per rank at TP=4, 8 at TP=8), so a
# 1/8-speed rank's share is still a whole number of heads; seq 64 x micro-batch 2 per step; a 1k
# vocabulary keeps the (unbalanced, equal on every rank) output layer small.
MODEL = [
    *("--model.num_layers", "2", "--model.hidden_size", "256", "--model.num_attention_heads", "64"),
    *("--model.ffn_hidden_size", "1024", "--model.seq_length", "64", "--data.vocab_size", "1024"),
    *("--train.micro_batch_size", "2", "--train.global_batch_size", "2"),
]


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    tp: int
    spec: str
    """A megahet device profile (what --device.profile takes): per TP rank, the same on every CP rank."""
    steps: int
    cp: int = 1
    """Context parallelism: CP ranks per sequence (the world is TP x CP)."""

    def speeds(self, step: int) -> list[float]:
        profile = parse_profile(self.spec)
        return [profile.speed(r, step, self.tp) for r in range(self.tp)]

    def twin(self) -> str:
        """A schedule profile giving every rank the mean speed of this profile at each step."""
        entries, last = [], None
        for step in range(self.steps):
            mean = statistics.fmean(self.speeds(step))
            if mean != last:
                entries.append(f"{step}=" + ",".join([f"{mean:.6f}"] * self.tp))
                last = mean
        return "schedule:" + ";".join(entries)

    def changes(self, first: int) -> list[int]:
        """Steps at or after `first` where the speeds change."""
        return [s for s in range(max(first, 1), self.steps) if self.speeds(s) != self.speeds(s - 1)]


def straggler(name: str, tp: int, speeds: list[float], warmup: int, steps: int, cp: int = 1) -> Profile:
    fmt = ",".join(f"{s:.6g}" for s in speeds)
    return Profile(name, tp, f"schedule:0={','.join(['1'] * tp)};{warmup}={fmt}", steps, cp)


def profiles(warmup: int, steps: int) -> list[Profile]:
    return [
        straggler("tp4_2x", 4, [1, 1, 1, 1 / 2], warmup, steps),
        straggler("tp4_4x", 4, [1, 1, 1, 1 / 4], warmup, steps),
        straggler("tp4_8x", 4, [1, 1, 1, 1 / 8], warmup, steps),
        straggler("tp8_mixed", 8, [1 / 8, 1 / 6, 1 / 4, 1 / 2, 1, 1, 1, 1], warmup, steps),
        # TP 2 x CP 2: TP rank 1 of both CP ranks 4x slow (one plan serves both CP ranks)
        straggler("tp2_cp2_4x", 2, [1, 1 / 4], warmup, steps, cp=2),
        Profile("tp4_rotating_4x", 4, "rotating:4,6", 4 * 6),
        # Seed 10: rank 2 slow for 20 steps, then ranks 0 and 2 (of 4).
        Profile("tp4_contention_4x", 4, "contention:4,20,10", 40),
    ]


def launch(tp: int, args: list[str], log: Path, cp: int = 1) -> float:
    """One pretrain_gpt.py launch of the benchmark's GPT at TP=`tp` x CP=`cp` (benchmarks.common.torchrun)."""
    parallel = ["--parallel.tp", str(tp), "--parallel.cp", str(cp)]
    return torchrun("pretrain_gpt.py", tp * cp, [*parallel, *MODEL, *args], log)


def run(profile: Profile, mode: str, spec: str, rate: float) -> list[dict]:
    name = f"{profile.name}_{mode}"
    trace = RUNS / f"{name}.jsonl"
    args = f"--device.profile {spec} --device.rate_gflops {rate} --balance.mode {'static' if mode == 'twin' else mode}"
    args += (
        f" --balance.trace {trace} --train.train_iters {profile.steps} --train.log_interval {profile.steps}"
    )
    args += f" --train.eval_interval {10 * profile.steps} --train.eval_iters 1 --logging.wandb false"
    args += f" --logging.log_dir {RUNS / 'logs'}"
    wall = launch(profile.tp, args.split(), RUNS / f"{name}.log", profile.cp)
    print(f"  {name}: {wall:.0f} s", flush=True)
    return read_trace(trace)


def reaction(times: list[float], twin: list[float], changes: list[int], steps: int) -> int:
    """Max over the speed changes of the steps until the step time is within 5 % of the twin's
    median over that phase."""
    worst = 0
    bounds = [*changes, steps]
    for start, end in itertools.pairwise(bounds):
        ideal = statistics.median(twin[start:end])
        late = next((k for k in range(end - start) if times[start + k] <= 1.05 * ideal), end - start)
        worst = max(worst, late)
    return worst


def bench_profile(profile: Profile, warmup: int, rate: float) -> tuple[list[dict], dict]:
    traces = {
        mode: run(profile, mode, profile.twin() if mode == "twin" else profile.spec, rate)
        for mode in ("twin", *MODES)
    }
    times = {mode: [r["step_s"] for r in rows] for mode, rows in traces.items()}
    slowest = {mode: [max(r["busy_s"][0]) for r in rows] for mode, rows in traces.items()}
    changes = profile.changes(warmup)
    measured = slice(warmup, profile.steps)
    t_opt = statistics.median(times["twin"][measured])
    static = statistics.median(times["static"][measured])
    bound = statistics.median(
        statistics.fmean(s) / min(s) for s in (profile.speeds(t) for t in range(warmup, profile.steps))
    )
    rows = []
    for mode in MODES:
        t = statistics.median(times[mode][measured])
        balanced = mode != "static"
        react = reaction(times[mode], times["twin"], changes, profile.steps) if balanced else None
        react_compute = reaction(slowest[mode], slowest["twin"], changes, profile.steps) if balanced else None
        rows.append(
            {
                "profile": profile.name,
                "mode": mode,
                "step_time_s": t,
                "t_opt_s": t_opt,
                "efficiency": t_opt / t,
                "speedup_vs_static": static / t,
                "reaction_steps": react,
                "reaction_compute_steps": react_compute,
                "compute_bound": bound,
                "online_eff": statistics.median(r["efficiency"][0] for r in traces[mode][measured]),
            }
        )
        plot_trace(
            RUNS / f"{profile.name}_{mode}.jsonl",
            RUNS / f"{profile.name}_{mode}.png",
            title=f"{profile.name}, {mode}: {profile.spec}",
        )
    return rows, times


def overhead(rate: float, steps: int, repeats: int) -> dict:
    """The balancer's cost on a homogeneous TP=4 group, two ways. A/B: median step time with no
    balancer at all vs semi (which measures, gathers, keeps priority statistics and plans every step
    but never moves anything), in `repeats` interleaved pairs of runs. In-run: the semi run's own time
    in the step hooks (`hooks_s`: balancer and resizer) over the unbalanced step time, which machine
    noise barely touches (the gradient hooks inside backward are only in the A/B figure)."""
    samples: dict[str, list[float]] = {"off": [], "semi": []}
    pairs, hooks = [], []
    for i in range(repeats):
        medians = {}
        for mode in samples:
            metrics = RUNS / f"overhead_{mode}_{i}.jsonl"
            metrics.unlink(missing_ok=True)
            args = f"--device.profile static:1,1,1,1 --device.rate_gflops {rate} --train.train_iters {steps}"
            args += f" --train.log_interval 1 --train.eval_interval {10 * steps} --train.eval_iters 1"
            args += (
                f" --logging.wandb false --logging.metrics_file {metrics} --logging.log_dir {RUNS / 'logs'}"
            )
            if mode == "semi":
                args += " --balance.mode semi"
            launch(4, args.split(), RUNS / f"overhead_{mode}_{i}.log")
            rows = [json.loads(line) for line in metrics.read_text().splitlines()][2:]  # after warm-up
            times = [r["step_time_s"] for r in rows if "step_time_s" in r]
            samples[mode] += times
            medians[mode] = statistics.median(times)
            if mode == "semi":
                hooks += [r["hooks_s"] for r in rows if "hooks_s" in r]
        pairs.append(medians["semi"] / medians["off"] - 1)
    off, semi = statistics.median(samples["off"]), statistics.median(samples["semi"])
    return {
        "off_step_s": off,
        "semi_step_s": semi,
        "overhead": semi / off - 1,
        "pair_overheads": pairs,
        "hooks_s": statistics.median(hooks),
        "hooks_overhead": statistics.median(hooks) / off,
        "steps": len(samples["off"]),
    }


def plot(all_times: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, (len(all_times) + 1) // 2, figsize=(15, 7), squeeze=False)
    for ax, (name, times) in zip(axes.flat, all_times.items()):
        for mode, values in times.items():
            ax.plot(
                values,
                label=mode,
                color="black" if mode == "twin" else None,
                linestyle="--" if mode == "twin" else "-",
            )
        ax.set_title(name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


GOALS = {"migrate": 0.90, "semi": 0.95}  # E goals; reaction <= 3 steps; overhead <= 1 %


def goals(rows: list[dict], overhead: dict | None) -> list[str]:
    """The issue's goals per cell, with the distance to each (lines for the Markdown file)."""
    lines = []
    for row in rows:
        goal = GOALS.get(row["mode"])
        if goal is None:
            continue
        e, react = row["efficiency"], row["reaction_steps"]
        lines.append(
            f"- {row['profile']} {row['mode']}: E {e:.3f} vs >= {goal:.2f} ({e - goal:+.3f}) "
            f"-> {'met' if e >= goal else 'MISSED'}; reaction {react} (compute {row['reaction_compute_steps']}) "
            f"vs <= 3 -> {'met' if react <= 3 else 'MISSED'}"
        )
    if overhead:
        a_b, hooks = overhead["overhead"], overhead["hooks_overhead"]
        pairs = " ".join(f"{100 * p:+.1f}" for p in overhead["pair_overheads"])
        lines.append(
            f"- balancer overhead, homogeneous TP=4: A/B {100 * a_b:+.2f} % (median over "
            f"{overhead['steps']} steps a side; per pair {pairs} %), in-run hooks {100 * hooks:.2f} % "
            f"vs <= 1 % -> A/B {'met' if a_b <= 0.01 else 'MISSED'}, hooks {'met' if hooks <= 0.01 else 'MISSED'}"
        )
    return lines


def write_results(
    name: str, rows: list[dict], columns: list[str], meta: dict, lines: list[str], all_times
) -> None:
    """results/<name>.{json,md} with the goal lines appended to the table, and the step-time plot."""
    folder = save_results(name, rows, columns, meta)
    with (folder / f"{name}.md").open("a") as md:
        md.write("\nGoals (computed from the rows above):\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(all_times, folder / f"{name}.png")


def merge_rerun(name: str, rows: list[dict], meta: dict, all_times: dict, warmup: int, steps: int):
    """Put a rerun's rows into results/<name>.json in place of its profiles' old rows (profile order
    kept); the step times of the profiles not rerun come back from their traces for the plot."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"balance_efficiency: --update needs an earlier {path}: run without --update first")
    old = json.loads(path.read_text())
    rerun = {row["profile"] for row in rows}
    order = [p.name for p in profiles(warmup, steps)]
    merged = sorted(
        [r for r in old["rows"] if r["profile"] not in rerun] + rows,
        key=lambda r: (order.index(r["profile"]), MODES.index(r["mode"])),
    )
    note = {"profiles": sorted(rerun), "wall_s": meta["wall_s"], "date": time.strftime("%Y-%m-%d %H:%M")}
    kept = {k: v for k, v in meta.items() if k not in ("profiles", "wall_s")}
    if rows or "balancer_overhead" in meta:  # else: only the table and plots written again
        note["overhead_repeats"] = len(meta.get("balancer_overhead", {}).get("pair_overheads", []))
        kept["reruns"] = [*old["meta"].get("reruns", []), note]
    merged_meta = {**old["meta"], **kept}
    for profile in dict.fromkeys(r["profile"] for r in merged):
        traces = [RUNS / f"{profile}_{mode}.jsonl" for mode in ("twin", *MODES)]
        # the plot keeps the old profiles whose traces are here (runs/ is not committed: a fresh clone has none)
        if profile not in all_times and all(t.exists() for t in traces):
            all_times[profile] = {
                mode: [r["step_s"] for r in read_trace(t)] for mode, t in zip(("twin", *MODES), traces)
            }
    return (
        merged,
        merged_meta,
        {p: all_times[p] for p in dict.fromkeys(r["profile"] for r in merged) if p in all_times},
    )


def run_profiles(
    name: str, profiles: list, wanted: list[str] | None, bench, describe
) -> tuple[list, list, dict, float]:
    """Run `bench(profile)` -> (rows, step times) for each profile named in `wanted` (None: all), printing
    `describe(profile)` and its table; (the profiles run, all rows, step times by profile, wall seconds)."""
    chosen = [p for p in profiles if wanted is None or p.name in wanted]
    if not chosen:
        raise SystemExit(f"{name}: no profile named {wanted}: choose from {[p.name for p in profiles]}")
    rows, all_times = [], {}
    t0 = time.perf_counter()
    for profile in chosen:
        print(describe(profile), flush=True)
        profile_rows, all_times[profile.name] = bench(profile)
        rows += profile_rows
        print(markdown_table(profile_rows, list(profile_rows[-1])), flush=True)
    return chosen, rows, all_times, time.perf_counter() - t0


def slow_phase_args(
    doc: str, name: str, arrives: str, slow_steps: int, after: str, argv
) -> argparse.Namespace:
    """The options of a benchmark whose profiles slow something down for a phase (dp_efficiency,
    pp_efficiency): profile_parser's, --slow-steps and --rate."""
    parser = profile_parser(doc, name, f"homogeneous steps before {arrives}")
    parser.add_argument(
        "--slow-steps", type=int, default=slow_steps, help=f"steps slow, then {after} recovered"
    )
    parser.add_argument("--rate", type=float, default=3.0, help="GFLOP/s of a speed-1 device")
    return parser.parse_args(argv)


def slow_phase_meta(model: list[str], args: argparse.Namespace, chosen: list, wall: float) -> dict:
    """The settings of a slow-phase benchmark's results (JSON meta)."""
    return {
        "model": " ".join(model),
        "warmup": args.warmup,
        "slow_steps": args.slow_steps,
        "rate_gflops": args.rate,
        "profiles": {p.name: p.spec(args.warmup, args.slow_steps) for p in chosen},
        "wall_s": wall,
    }


def profile_parser(doc: str, name: str, warmup_help: str) -> argparse.ArgumentParser:
    """The efficiency benchmarks' common options: --profiles, --warmup, --name."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--profiles", nargs="*", default=None, help="names to run (default: all)")
    parser.add_argument("--warmup", type=int, default=4, help=warmup_help)
    parser.add_argument("--name", default=name)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = profile_parser(__doc__, "balance_efficiency", "homogeneous steps before a static straggler")
    parser.add_argument("--steps", type=int, default=16, help="steps of the static-straggler profiles")
    parser.add_argument(
        "--rate-tp4",
        type=float,
        default=0.6,
        help="GFLOP/s of a speed-1 device at TP=4 (x 4/TP elsewhere, so that a step's compute at speed 1 "
        "is the same ~0.5 s at every TP, as the work per rank shrinks with TP)",
    )
    parser.add_argument("--overhead-repeats", type=int, default=4, help="0 skips the overhead runs")
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="measure only the balancer's overhead (--overhead-repeats pairs) into the existing table",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="rerun only --profiles into the existing results/<name>.json: their rows are replaced, the "
        "others (and the overhead, with --overhead-repeats 0) kept; the rerun is recorded in the meta",
    )
    args = parser.parse_args(argv)
    RUNS.mkdir(parents=True, exist_ok=True)
    chosen = [
        p for p in profiles(args.warmup, args.steps) if args.profiles is None or p.name in args.profiles
    ]
    if args.overhead_only:
        chosen, args.update = [], True
    elif not chosen:
        raise SystemExit(f"balance_efficiency: no profile named {args.profiles}")
    rows, all_times = [], {}
    t0 = time.perf_counter()
    for profile in chosen:
        print(
            f"{profile.name} (TP={profile.tp}, CP={profile.cp}, {profile.spec}, twin {profile.twin()})",
            flush=True,
        )
        profile_rows, all_times[profile.name] = bench_profile(  # a rank's share of the work as at TP 4
            profile, args.warmup, args.rate_tp4 * 4 / (profile.tp * profile.cp)
        )
        rows += profile_rows
        print(markdown_table(profile_rows, list(profile_rows[0])), flush=True)
    meta = {
        "model": " ".join(MODEL),
        "warmup": args.warmup,
        "rate_tp4_gflops": args.rate_tp4,
        "profiles": {p.name: p.spec for p in chosen},
    }
    if args.overhead_repeats:
        meta["balancer_overhead"] = overhead(args.rate_tp4, args.steps, args.overhead_repeats)
        print(f"balancer overhead on a homogeneous TP=4 group: {meta['balancer_overhead']}", flush=True)
    meta["wall_s"] = time.perf_counter() - t0
    if args.update:
        rows, meta, all_times = merge_rerun(args.name, rows, meta, all_times, args.warmup, args.steps)
    columns = [
        "profile",
        "mode",
        "step_time_s",
        "t_opt_s",
        "efficiency",
        "speedup_vs_static",
        "reaction_steps",
        "reaction_compute_steps",
        "compute_bound",
    ]
    write_results(args.name, rows, columns, meta, goals(rows, meta.get("balancer_overhead")), all_times)


if __name__ == "__main__":
    main()
