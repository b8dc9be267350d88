"""The balancers against a real straggler: two ranks pinned to two cores, another process busy on one.

    python benchmarks/real_contention.py                          # TP, DP and PP cases (~12 min)
    python benchmarks/real_contention.py --cases tp --modes static migrate --steps 30
    python benchmarks/real_contention.py --set balance.whole_step=false --name real_contention_movable

No virtual device. Each rank of a two-rank GPT job (pretrain_gpt.py) is pinned to a core of its own
(tools/pin_ranks.py), and a busy loop pinned to rank 1's core competes with it for the whole run
(multi-tenant contention). Three cases, each in its balance modes and once without the competing
process (the homogeneous run, static), all in one invocation:

- tp: TP=2, `balance.mode` static, resize, migrate, semi;
- dp: DP=2, `hetero.dp_shares` even (static) and measured;
- pp: PP=2, `hetero.pp_split` even (static) and measured.

Per run, over the steps after `--skip`: the median step time; each rank's share of its core while it
wanted to run (kernel scheduler statistics, /proc/PID/schedstat, sampled through the run); and each
rank's step split into movable compute (its transformer layers), fixed work (the rest of its own
compute and its optimizer step: `StepTimes.fixed_s`) and waits (the rest of the step), from the
balancer's trace (`--balance.trace`, which every run writes).

The physical limit: if rank i gets the fraction r_i of its core, the two cores do sum(r_i) / N of the
work per second of two whole cores, so no plan beats the capacity ideal T_cap = T_homog x N / sum(r_i)
(docs/design.md, section 2). The homogeneous run's ranks do not get whole cores either (measured: about 0.91
each, the rest going to the launcher and the machine's other processes), so its N becomes its own
sum of shares: T_cap = T_homog x sum(r_homog) / sum(r_i).
The gain captured of a run is (T_static / T - 1) / (T_static / T_cap - 1): 1 reaches the capacity
ideal, 0 is static. Beside it (TP), the old compute-only ideal: static's step minus the layers' compute
it loses to their imbalance. Goal: gain captured >= 0.8 in every case's balanced mode.

Moving ownership with migrated units (TP, issue 31): `ownership_s` is the most a step would gain if the
units' optimizer work moved with them, from each rank's measured optimizer step (the trace's
`optimizer_s`), the units it sent and hosted, and its work units' share of its parameters.

Writes benchmarks/results/real_contention.{md,json,png}; logs and traces go to
benchmarks/results/real_contention_runs/.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from megahet.policy.layout_cost import ModelShape
from megahet.runtime.balancer import compute_efficiency
from megahet.runtime.trace_plot import read_trace
from megahet.runtime.trace_writer import trace_path

RUNS = RESULTS / "real_contention_runs"
RANKS = 2
# A GPT whose compute dominates its step on two CPU ranks (hidden 512: the TP all-reduces are small
# against the GEMMs), four layers of 128-token sequences; each case sets its batch.
SHAPE = ModelShape(layers=4, hidden=512, heads=8, query_groups=8, ffn=2048, seq=128, vocab=1024)
MODEL = [
    *("--model.num_layers", str(SHAPE.layers), "--model.hidden_size", str(SHAPE.hidden)),
    *("--model.num_attention_heads", str(SHAPE.heads), "--model.seq_length", str(SHAPE.seq)),
    *("--data.vocab_size", str(SHAPE.vocab)),
]
BATCH = ("--train.micro_batch_size", "2", "--train.global_batch_size", "8")
"""TP and PP: four micro-batches of 2 sequences a step."""
DP_BATCH = ("--train.micro_batch_size", "1", "--train.global_batch_size", "16")
"""DP: sixteen micro-batches of one sequence, eight per replica when even. Shares move whole
micro-batches: with four (two per replica) the best split of a replica at half speed is 3/1, 12 %
above the capacity ideal before any other loss; with sixteen it is 11/5, within 3 %."""
UNIT_SHARE = (
    SHAPE.layers * SHAPE.split_layer_params(2) / SHAPE.rank_params(2, SHAPE.layers, first=True, last=True)
)
"""TP=2: the share of a rank's parameters (and so of its optimizer step) that belongs to its work units."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout and its modes: the settings of each mode (static first: the reference)."""

    layout: tuple[str, ...]
    modes: dict[str, tuple[str, ...]]
    balanced: tuple[str, ...]
    """The modes the goal applies to."""
    batch: tuple[str, ...] = BATCH


CASES = {
    "tp": Case(
        ("--parallel.tp", "2"),
        {m: ("--balance.mode", m) for m in ("static", "resize", "migrate", "semi")},
        ("migrate", "semi"),
    ),
    "dp": Case(
        ("--hetero.dp_shares", "even"),
        {"static": (), "measured": ("--hetero.dp_shares", "measured")},
        ("measured",),
        DP_BATCH,
    ),
    "pp": Case(
        ("--parallel.pp", "2", "--hetero.pp_split", "even"),
        {"static": (), "measured": ("--hetero.pp_split", "measured", "--hetero.pp_patience", "2")},
        ("measured",),
    ),
}
COLUMNS = [
    "case",
    "mode",
    "contended",
    "step_s",
    "speedup",
    "core_share",
    "capacity_s",
    "gain_captured",
    "compute_ideal_s",
    "movable_s",
    "fixed_s",
    "wait_s",
    "balance_eff",
    "ownership_s",
]


class ShareMonitor(threading.Thread):
    """Samples every rank's scheduler statistics while the run lasts: per local rank, (on-CPU s, waiting s)."""

    def __init__(self, ranks: int = RANKS):
        super().__init__(daemon=True)
        self.samples: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
        self.done = threading.Event()

    def run(self) -> None:
        pids: list[int | None] = [None] * len(self.samples)
        while not self.done.wait(0.2):
            for rank, samples in enumerate(self.samples):
                pids[rank] = pids[rank] or rank_pid(rank)
                if pids[rank] is None:
                    continue
                try:
                    samples.append(schedstat(pids[rank]))
                except OSError:
                    pids[rank] = None

    def shares(self, skip_fraction: float) -> list[float]:
        """Each rank's core share over the run after its first `skip_fraction` (start-up) of samples."""
        out = []
        for samples in self.samples:
            if len(samples) < 2:
                out.append(float("nan"))
                continue
            out.append(core_share(samples[int(len(samples) * skip_fraction)], samples[-1]))
        return out


# Settings every run's identity rests on: not overridable with --set.
RESERVED = (
    "parallel.",
    "balance.mode",
    "balance.trace",
    "hetero.",
    "train.train_iters",
    "train.log_interval",
)


def run(
    case: str, mode: str, contended: bool, steps: int, cores: list[int], overrides=(), tag: str = ""
) -> tuple[list[list[dict]], list[float]]:
    """One pinned launch; (its trace rows per pipeline stage, each rank's core share)."""
    name = f"{tag}{case}_{mode}{'' if contended else '_calm'}"
    trace = RUNS / f"{name}.jsonl"
    spec = CASES[case]
    args = [
        str(ROOT / "pretrain_gpt.py"),
        *MODEL,
        *spec.batch,
        *spec.layout,
        *spec.modes[mode],
        *("--balance.trace", str(trace)),
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
    stages = 2 if case == "pp" else 1
    traces = [read_trace(trace_path(str(trace), f"stage{s}" if stages > 1 else None)) for s in range(stages)]
    return traces, monitor.shares(0.3)


def rank_steps(traces: list[list[dict]], skip: int) -> dict[str, list[float]]:
    """Per rank (stage-major, then DP replica, then TP rank), medians over the steps after `skip`:
    movable compute, fixed work, waits and the rest of the step; and the step time."""
    out: dict[str, list[float]] = {"movable_s": [], "fixed_s": [], "wait_s": []}
    step_s = statistics.median(r["step_s"] for r in traces[0][skip:])
    for rows in traces:
        rows = rows[skip:]
        for dp in range(len(rows[0]["busy_s"])):
            for tp in range(len(rows[0]["busy_s"][dp])):
                movable = statistics.median(r["busy_s"][dp][tp] for r in rows)
                fixed = statistics.median(r["fixed_s"][dp][tp] for r in rows)
                out["movable_s"].append(movable)
                out["fixed_s"].append(fixed)
                out["wait_s"].append(max(step_s - movable - fixed, 0.0))
    out["step_s"] = [step_s]
    return out


def compute_only_ideal(traces: list[list[dict]], skip: int) -> float:
    """The old ideal (TP): the step minus the layers' compute lost to their imbalance, max x (1 - E) with
    E the layers' compute efficiency alone (no fixed work)."""
    rows = traces[0][skip:]
    step_s = statistics.median(r["step_s"] for r in rows)
    work = [statistics.median(r["work_gflop"][0][t] for r in rows) for t in range(len(rows[0]["busy_s"][0]))]
    busy = [statistics.median(r["busy_s"][0][t] for r in rows) for t in range(len(work))]
    return step_s - max(busy) * (1 - compute_efficiency(work, busy))


def ownership_saving(traces: list[list[dict]], skip: int, unit_share: float = UNIT_SHARE) -> float:
    """TP: the most a step would gain if the migrated units' ownership (weights, fp32 masters, Adam
    moments) moved with them, so that their optimizer work did too. The optimizer step is a synchronous
    phase, so that is the slowest rank's optimizer time minus the slowest one's once every rank's is
    scaled by 1 - unit_share x (units sent - units hosted), medians over the steps after `skip`."""
    rows = traces[0][skip:]
    if not rows or "optimizer_s" not in rows[0]:
        return float("nan")
    ranks = range(len(rows[0]["optimizer_s"][0]))
    optimizer = [statistics.median(r["optimizer_s"][0][t] for r in rows) for t in ranks]
    moved = [statistics.median(r["sent"][0][t] - r["hosted"][0][t] for r in rows) for t in ranks]
    return max(optimizer) - max(o * (1 - unit_share * m) for o, m in zip(optimizer, moved))


def summarize(case: str, mode: str, contended: bool, traces: list[list[dict]], shares, skip: int) -> dict:
    parts = rank_steps(traces, skip)
    rows = [r for trace in traces for r in trace[skip:]]
    return {
        "case": case,
        "mode": mode,
        "contended": contended,
        "step_s": parts["step_s"][0],
        "core_shares": list(shares),
        "core_share": min(shares),
        "movable": parts["movable_s"],
        "fixed": parts["fixed_s"],
        "waits": parts["wait_s"],
        "movable_s": max(parts["movable_s"]),
        "fixed_s": max(parts["fixed_s"]),
        "wait_s": min(parts["wait_s"]),
        "balance_eff": statistics.median(e for r in rows for e in r["efficiency"]),
        "compute_ideal_s": compute_only_ideal(traces, skip) if case == "tp" else float("nan"),
        "ownership_s": ownership_saving(traces, skip) if case == "tp" else float("nan"),
    }


def add_capacity(rows: list[dict]) -> None:
    """Per case: speed-up over static; each run's capacity ideal from its own core shares and the
    homogeneous run's step; the gain captured."""
    for case in {r["case"] for r in rows}:
        mine = [r for r in rows if r["case"] == case]
        static = next(r for r in mine if r["mode"] == "static" and r["contended"])
        homogeneous = next(r for r in mine if not r["contended"])
        for row in mine:
            row["speedup"] = static["step_s"] / row["step_s"]
            calm = sum(min(s, 1.0) for s in homogeneous["core_shares"])
            row["capacity_s"] = homogeneous["step_s"] * calm / sum(min(s, 1.0) for s in row["core_shares"])
            possible = static["step_s"] / row["capacity_s"] - 1
            row["gain_captured"] = (row["speedup"] - 1) / possible if possible > 0 else float("nan")


def goals(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["contended"] and row["mode"] in CASES[row["case"]].balanced:
            met = row["gain_captured"] >= 0.8
            lines.append(
                f"{row['case']} {row['mode']}: {row['step_s']:.3f} s/step, speed-up {row['speedup']:.3f}, "
                f"capacity ideal {row['capacity_s']:.3f} s (core shares "
                f"{' '.join(f'{s:.2f}' for s in row['core_shares'])}): gain captured "
                f"{row['gain_captured']:.2f} (goal >= 0.8) -> {'met' if met else 'MISSED'}"
            )
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Per case, per run, each rank's step split into movable compute, fixed work and waits (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows}, key=list(CASES).index)
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        mine = [r for r in rows if r["case"] == case]
        labels, x = [], 0
        for row in mine:
            for rank, (movable, fixed, wait) in enumerate(zip(row["movable"], row["fixed"], row["waits"])):
                bars = [(movable, "tab:blue", "movable compute"), (fixed, "tab:orange", "fixed work")]
                bottom = 0.0
                for height, color, label in [*bars, (wait, "tab:gray", "waits and rest")]:
                    ax.bar(x, height, bottom=bottom, color=color, label=label if x == 0 else None)
                    bottom += height
                labels.append(f"{row['mode']}{'' if row['contended'] else ' calm'}\nr{rank}")
                x += 1
            x += 0.5
        static = next(r for r in mine if r["mode"] == "static" and r["contended"])
        ax.axhline(
            static["capacity_s"], color="black", linestyle=":", label="capacity ideal (static's shares)"
        )
        ax.set_xticks([i + 0.5 * (i // RANKS) for i in range(len(labels))], labels, fontsize=6)
        ax.set(ylabel="seconds per step", title=f"{case.upper()}=2, a process competing for rank 1's core")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=12, help="steps left out of the medians (reaction)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", help="modes to run (static is always run: the reference)")
    parser.add_argument("--name", default="real_contention")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a megahet setting for every run"
    )
    args = parser.parse_args(argv)
    why = "the benchmark sets it per run; override another setting"
    overrides = settings_to_args(args.set, "--set", RESERVED, why)
    if overrides and args.name == "real_contention":
        sys.exit("real_contention: error: --set changes the runs: give them their own --name")
    unknown = set(args.modes or ()) - {m for c in args.cases for m in CASES[c].modes}
    if unknown:
        sys.exit(f"real_contention: error: no case has mode(s) {sorted(unknown)}: see --help")
    cores = two_cores()
    if cores is None:
        sys.exit("real_contention: error: needs two CPU cores to pin the ranks to")
    RUNS.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    tag = "" if args.name == "real_contention" else f"{args.name}_"
    for case in args.cases:
        modes = [m for m in CASES[case].modes if m == "static" or args.modes is None or m in args.modes]
        for mode, contended in [("static", False), *((m, True) for m in modes)]:
            traces, shares = run(case, mode, contended, args.steps, cores, overrides, tag)
            rows.append(summarize(case, mode, contended, traces, shares, args.skip))
            print(
                f"{case} {mode} contended={contended}: {rows[-1]['step_s']:.3f} s/step, shares {shares}",
                flush=True,
            )
    add_capacity(rows)
    meta = {
        "steps": args.steps,
        "skip": args.skip,
        "set": args.set,
        "cores": cores,
        "wall_s": time.perf_counter() - t0,
        "goals": goals(rows),
        "per_rank": [
            {k: r[k] for k in ("case", "mode", "contended", "core_shares", "movable", "fixed", "waits")}
            for r in rows
        ],
    }
    folder = save_results(args.name, rows, COLUMNS, meta)
    plot(rows, folder / f"{args.name}.png")
    with (folder / f"{args.name}.md").open("a") as md:
        md.write("\n" + "\n".join(f"- {line}" for line in meta["goals"]) + "\n")
    print("\n".join(meta["goals"]))
    print(json.dumps({"wall_s": round(meta["wall_s"], 1)}))


if __name__ == "__main__":
    main()
