"""The balancer against a real straggler: TP=2 ranks pinned to two cores, another process busy on one.

    python benchmarks/real_contention.py                     # 4 modes + an uncontended run (~6 min)
    python benchmarks/real_contention.py --steps 30 --modes static migrate
    python benchmarks/real_contention.py --set resize.selection=random --name real_contention_random

No virtual device. Each rank of a TP=2 GPT (pretrain_gpt.py) is pinned to a core of its own
(tools/pin_ranks.py), and a busy loop pinned to TP rank 1's core competes with it for the whole run
(multi-tenant contention, the paper's own scenario). The same job runs in each balance mode
(static, resize, migrate, semi) and once without the competing process (static). Per mode, over the
steps after `--skip`:

- the median step time and the speed-up over static;
- the balancer's estimated speed of rank 1 (median of the trace) against the share of its core the
  rank really got while it wanted to run (kernel scheduler statistics, /proc/PID/schedstat);
- the reaction: the first step that executes a changed plan;
- balance_eff, the compute efficiency (ideal split of the measured speeds over the slowest compute);
- the ideal step time a perfect split of static's measured speeds would reach: static's step time
  minus the compute it loses to the imbalance, max compute x (1 - E_static); its speed-up is the
  target (goal: migrate and semi reach >= 0.9 of it).

Writes benchmarks/results/real_contention.{md,json,png}; logs and traces go to
benchmarks/results/real_contention_runs/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, save_results, settings_to_args, torchrun
from benchmarks.contention import core_share, pinned_launch, rank_pid, schedstat, two_cores
from megahet.runtime.trace_plot import read_trace

RUNS = RESULTS / "real_contention_runs"
MODES = ("static", "resize", "migrate", "semi")
# A GPT whose compute dominates its step on two CPU ranks (hidden 512: the TP all-reduces are small
# against the GEMMs), two micro-batches of 4 x 128 tokens per step.
MODEL = [
    *("--model.num_layers", "2", "--model.hidden_size", "512", "--model.num_attention_heads", "8"),
    *("--model.seq_length", "128", "--data.vocab_size", "1024"),
    *("--train.micro_batch_size", "4", "--train.global_batch_size", "8"),
]
COLUMNS = [
    "mode",
    "contended",
    "step_s",
    "speedup",
    "ideal_speedup",
    "of_ideal",
    "est_speed_tp1",
    "core_share_tp1",
    "reaction_steps",
    "balance_eff",
]


class ShareMonitor(threading.Thread):
    """Samples rank 1's scheduler statistics while the run lasts: (time, on-CPU s, waiting s)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        pid = None
        while not self.done.wait(0.2):
            pid = pid or rank_pid(1)
            if pid is not None:
                try:
                    self.samples.append((time.monotonic(), *schedstat(pid)))
                except OSError:
                    pid = None

    def share(self, skip_fraction: float) -> float:
        """Core share over the run after its first `skip_fraction` (start-up) of samples."""
        if len(self.samples) < 2:
            return float("nan")
        first = self.samples[int(len(self.samples) * skip_fraction)]
        return core_share(first[1:], self.samples[-1][1:])


# Settings every run's identity rests on: not overridable with --set.
RESERVED = ("parallel.", "balance.", "train.train_iters", "train.log_interval", "device.")


def run(
    mode: str, contended: bool, steps: int, cores: list[int], overrides: list[str] = (), tag: str = ""
) -> tuple[list[dict], float]:
    name = f"{tag}{mode}{'' if contended else '_calm'}"
    trace = RUNS / f"{name}.jsonl"
    args = [
        str(ROOT / "pretrain_gpt.py"),
        *MODEL,
        *("--parallel.tp", "2", "--balance.mode", mode, "--balance.trace", str(trace)),
        *("--train.train_iters", str(steps), "--train.log_interval", str(steps)),
        *("--train.eval_interval", str(steps), "--train.eval_iters", "1", "--logging.wandb", "false"),
        *overrides,
    ]
    monitor = ShareMonitor()
    monitor.start()
    try:
        pinned_launch(torchrun, args, cores, RUNS / f"{name}.log", contended)
    finally:
        monitor.done.set()
        monitor.join()
    return read_trace(trace), monitor.share(0.5)


def summarize(mode: str, contended: bool, rows: list[dict], share: float, skip: int) -> dict:
    measured = rows[skip:]
    speeds = [r["speed"][0][1] for r in measured if r["speed"][0] is not None]
    changed = [r["step"] for r in rows if r["sent"][0][1] > 0 or max(r["dropped"][0]) > 0]
    busy = [max(r["busy_s"][0]) for r in measured]
    return {
        "mode": mode,
        "contended": contended,
        "step_s": statistics.median(r["step_s"] for r in measured),
        "est_speed_tp1": statistics.median(speeds) if speeds else float("nan"),
        "core_share_tp1": share,
        "reaction_steps": changed[0] if changed else "-",
        "balance_eff": statistics.median(r["efficiency"][0] for r in measured),
        "max_compute_s": statistics.median(busy),
    }


def add_speedups(rows: list[dict]) -> None:
    """Speed-up over static; the ideal speed-up of a perfect split of static's measured speeds."""
    static = next(r for r in rows if r["mode"] == "static" and r["contended"])
    ideal_step = static["step_s"] - static["max_compute_s"] * (1 - static["balance_eff"])
    ideal = static["step_s"] / ideal_step
    for row in rows:
        row["speedup"] = static["step_s"] / row["step_s"]
        row["ideal_speedup"] = ideal
        row["of_ideal"] = row["speedup"] / ideal
        row["ideal_step_s"] = ideal_step


def plot(traces: dict[str, list[dict]], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, trace in traces.items():
        steps = [r["step"] for r in trace]
        ax_time.plot(steps, [r["step_s"] for r in trace], label=name)
        ax_speed.plot(steps, [r["speed"][0][1] if r["speed"][0] else None for r in trace], label=name)
    ideal = rows[0]["ideal_step_s"]
    ax_time.axhline(ideal, color="black", linestyle=":", label=f"ideal split ({ideal:.3f} s)")
    share = next(r["core_share_tp1"] for r in rows if r["mode"] == "static" and r["contended"])
    ax_speed.axhline(share, color="black", linestyle=":", label=f"real core share ({share:.2f})")
    ax_time.set(xlabel="step", ylabel="step time (s)", title="TP=2, a process competing for rank 1's core")
    ax_speed.set(xlabel="step", ylabel="estimated speed of TP rank 1", ylim=(0, 1.1))
    for ax in (ax_time, ax_speed):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["contended"] and row["mode"] in ("migrate", "semi"):
            met = row["of_ideal"] >= 0.9
            lines.append(
                f"{row['mode']}: speed-up {row['speedup']:.3f} = {row['of_ideal']:.3f} of the ideal "
                f"{row['ideal_speedup']:.3f} (goal >= 0.9) -> {'met' if met else 'MISSED'}"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=15, help="steps left out of the medians (reaction)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--name", default="real_contention")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a megahet setting for every run"
    )
    args = parser.parse_args(argv)
    why = "the benchmark sets it per run; override another setting"
    overrides = settings_to_args(args.set, "--set", RESERVED, why)
    if overrides and args.name == "real_contention":
        sys.exit("real_contention: error: --set changes the runs: give them their own --name")
    cores = two_cores()
    if cores is None:
        sys.exit("real_contention: error: needs two CPU cores to pin the ranks to")
    if "static" not in args.modes:
        sys.exit("real_contention: error: --modes must include static (the reference)")
    RUNS.mkdir(parents=True, exist_ok=True)
    rows, traces = [], {}
    t0 = time.perf_counter()
    for mode, contended in [*((m, True) for m in args.modes), ("static", False)]:
        tag = "" if args.name == "real_contention" else f"{args.name}_"
        trace, share = run(mode, contended, args.steps, cores, overrides, tag)
        rows.append(summarize(mode, contended, trace, share, args.skip))
        traces[f"{mode}{'' if contended else ' (no contention)'}"] = trace
        print(f"{mode} contended={contended}: {rows[-1]['step_s']:.3f} s/step", flush=True)
    add_speedups(rows)
    meta = {
        "steps": args.steps,
        "set": args.set,
        "skip": args.skip,
        "cores": cores,
        "wall_s": time.perf_counter() - t0,
        "ideal_step_s": rows[0]["ideal_step_s"],
        "goals": goals(rows),
    }
    folder = save_results(args.name, rows, COLUMNS, meta)
    plot(traces, rows, folder / f"{args.name}.png")
    with (folder / f"{args.name}.md").open("a") as md:
        md.write("\n" + "\n".join(f"- {line}" for line in meta["goals"]) + "\n")
    print("\n".join(meta["goals"]))
    print(json.dumps({"ideal_step_s": meta["ideal_step_s"], "wall_s": round(meta["wall_s"], 1)}))


if __name__ == "__main__":
    main()
