"""The layout planner's predictions against measured runs (issue 30): on clusters of virtual devices,
does the planner predict each plan's step time, and is the plan it ranks first the fastest one?

    python benchmarks/plan_accuracy.py                          # every cluster (~30 min on 2 quiet cores)
    python benchmarks/plan_accuracy.py --clusters 4r-2c --top 2 --low 1 --steps 6
    python benchmarks/plan_accuracy.py --rescore        # the stored runs against today's cost model

A CPU cluster is made of ranks with emulated speeds (virtual devices, `--device.profile static:...`, one
speed per global rank; megahet/runtime/devices.py): mixes of 2 and 4 speed classes, for 4 and 8 ranks.
Its description (docs/planning.md) gives each node's rate as `device.rate_gflops` x its speed, and the
links' bandwidth as measured on this machine (gloo over loopback).

Per cluster:
1. **Calibration** (`megahet.policy.calibration`): one short profiling run of the model on the cluster's
   ranks, all at speed 1 (TP 1, PP 1: every rank a replica), with the layers timed as the pipeline
   balancer times them. It measures the layers' effective rate, the other compute per micro-batch
   (embedding, output layer, loss), the framework's time per micro-batch and per step.
2. The planner (`megahet.layout_plan.plan_layouts`, with the calibration) ranks every plan that fits.
3. Its `--top` plans and `--low` plans it ranked low (spread over the lower half) are run, each with
   its nodes launched in its order (the device profile follows the plan's node order), and the median
   step time after `--warmup` steps is measured.

Report, per plan: predicted and measured step time and the error; per cluster: mean and worst error,
and whether the top-ranked plan is the fastest measured one or within 5 % of it. Goals on CPU: mean
error <= 10 %, the chosen plan within 5 % of the best measured one on every cluster.

Writes benchmarks/results/plan_accuracy.{md,json,png}; logs and metrics of every run go to
benchmarks/results/plan_accuracy_runs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pretrain_gpt
from benchmarks.common import RESULTS, save_results, torchrun
from benchmarks.contention import pinned_launch
from megahet.config import MegahetConfig, load_config
from megahet.layout_plan import PROFILE_START_STEPS, plan_layouts, plan_overrides_yaml
from megahet.policy.calibration import Calibration, Profile, SizePoint, fit_calibration
from megahet.policy.cluster import Cluster, parse_cluster
from megahet.policy.layout_cost import ModelShape
from megahet.policy.layout_search import Plan

RUNS = RESULTS / "plan_accuracy_runs"
RATE_GFLOPS = 5.0
"""A speed-1 virtual device's rate: well below what a rank computes on a shared core, so that the
emulated layers' time is the charge, not the host's load."""
LINK_GBPS = 1.0
"""The description's bandwidth inside and between the virtual nodes (gloo over loopback); what each
message costs beyond it is the calibration's latency."""
MODEL = [
    *("--model.num_layers", "8", "--model.hidden_size", "256", "--model.num_attention_heads", "4"),
    *("--model.ffn_hidden_size", "1024", "--model.seq_length", "128", "--data.vocab_size", "1024"),
    *("--train.global_batch_size", "16", "--train.precision", "fp32", "--plan.micro_batches", "1,2,4"),
    *("--resize.enabled", "true"),  # the resizable layers count the FLOPs a virtual device charges
]


@dataclasses.dataclass(frozen=True)
class VirtualCluster:
    name: str
    gpus: int
    """Ranks per node."""
    speeds: tuple[float, ...]
    """Each node's speed (its ranks' virtual devices), in the description's order."""

    @property
    def world_size(self) -> int:
        return self.gpus * len(self.speeds)

    def description(self) -> dict:
        """The cluster file's content (docs/planning.md): rates from the speeds, loopback links."""
        return {
            "nodes": [
                {"name": f"n{i}x{s:g}", "gpus": self.gpus, "memory_gib": 16, "tflops": RATE_GFLOPS * s / 1e3,
                 "intra_gbps": LINK_GBPS, "network_gbps": LINK_GBPS}
                for i, s in enumerate(self.speeds)
            ]
        }  # fmt: skip

    def cluster(self) -> Cluster:
        return parse_cluster(self.description(), self.name, "fp32")

    def device_profile(self, node_order: tuple[int, ...]) -> str:
        """`--device.profile` with the nodes launched in `node_order`: global rank r runs on node
        node_order[r // gpus]."""
        return "static:" + ",".join(
            f"{self.speeds[node_order[r // self.gpus]]:g}" for r in range(self.world_size)
        )


CLUSTERS = (
    VirtualCluster("4r-2c", gpus=2, speeds=(1.0, 0.4)),
    VirtualCluster("4r-4c", gpus=1, speeds=(1.0, 0.7, 0.5, 0.3)),
    VirtualCluster("8r-2c", gpus=4, speeds=(1.0, 0.5)),
    VirtualCluster("8r-4c", gpus=2, speeds=(1.0, 0.75, 0.5, 0.25)),
)


def chosen(plans: list[Plan], top: int, low: int) -> list[int]:
    """Positions (0 = fastest) of the plans to run: the first `top`, and `low` spread over the lower half
    of the ranking, its last included."""
    picks = list(range(min(top, len(plans))))
    half = len(plans) // 2
    for k in range(low):
        at = half + (len(plans) - 1 - half) * k // max(low - 1, 1) if low > 1 else len(plans) - 1
        if at not in picks and at < len(plans):
            picks.append(at)
    return picks


def launch(
    name: str, nproc: int, args: list[str], steps: int, runs: Path = RUNS, cores: list[int] | None = None
) -> list[dict]:
    """One pretrain_gpt.py launch (`nproc` ranks; rank r pinned to cores[r] when given, one per listed core:
    tools/pin_ranks.py); its metrics rows after the start-up steps."""
    metrics = runs / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    run_args = [
        *args, "--device.rate_gflops", str(RATE_GFLOPS), "--train.train_iters", str(steps),
        "--train.log_interval", "1", "--train.eval_interval", str(10 * steps), "--train.eval_iters", "1",
        "--logging.wandb", "false", "--logging.metrics_file", str(metrics), "--logging.log_dir", str(runs / "logs"),
    ]  # fmt: skip
    if cores is None:
        wall = torchrun("pretrain_gpt.py", nproc, run_args, runs / f"{name}.log")
    else:
        pinned = [str(ROOT / "pretrain_gpt.py"), *run_args]
        wall = pinned_launch(torchrun, pinned, cores, runs / f"{name}.log", contended=False)
    print(f"  {name}: {wall:.0f} s", flush=True)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r and r["step"] > PROFILE_START_STEPS]


def calibrate(vc: VirtualCluster, cfg: MegahetConfig, vocab: int, steps: int) -> Calibration:
    """The profiling run: every rank at speed 1, TP 2 where nodes have 2 GPUs (else 1), PP 1."""
    tp = min(2, vc.gpus)
    trace = RUNS / f"{vc.name}_profile.trace.jsonl"
    trace.unlink(missing_ok=True)
    args = [
        *MODEL, "--parallel.tp", str(tp), "--train.micro_batch_size", "1",
        "--device.profile", "static:" + ",".join(["1"] * vc.world_size), "--balance.trace", str(trace),
    ]  # fmt: skip
    launch(f"{vc.name}_profile", vc.world_size, args, steps)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    profile = Profile.from_trace_rows(
        rows, cfg.model.num_layers, cfg.train.global_batch_size, PROFILE_START_STEPS
    )
    # Virtual devices slow only the layers: the rest runs at the host's speed on every node.
    return fit_calibration(
        profile, ModelShape.of(cfg.model, vocab, 1), reference_tflops=RATE_GFLOPS / 1e3, precision="fp32",
        link_gbps=LINK_GBPS, extra_follows_rate=False,
    )  # fmt: skip


def bench_cluster(vc: VirtualCluster, top: int, low: int, steps: int) -> tuple[list[dict], dict]:
    cfg = load_config(MODEL)
    vocab = pretrain_gpt.vocab_size(cfg)
    cal = calibrate(vc, cfg, vocab, steps)
    plans = plan_layouts(cfg, vc.cluster(), vocab, calibration=cal)
    print(f"{vc.name}: {len(plans)} plans; {cal}", flush=True)
    rows = [
        run_plan(vc.name, cfg, plans, at, vc.world_size, steps,
                 ["--device.profile", vc.device_profile(plans[at].node_order)])
        for at in chosen(plans, top, low)
    ]  # fmt: skip
    return rows, summarize(vc.name, rows, cal, len(plans))


def run_plan(
    cluster: str, cfg: MegahetConfig, plans: list[Plan], at: int, nproc: int, steps: int, extra: list[str],
    runs: Path = RUNS, cores: list[int] | None = None,
) -> dict:  # fmt: skip
    """Plan `at` of the ranking run as its configuration file (plus `extra` settings): its row, predicted
    against the median measured step time."""
    plan = plans[at]
    config = runs / f"{cluster}_plan{at + 1:02d}.yaml"
    config.write_text(yaml.safe_dump(plan_overrides_yaml(cfg, plan), sort_keys=False))
    metrics = launch(config.stem, nproc, ["--config", str(config), *extra], steps, runs, cores)
    measured = statistics.median(r["step_time_s"] for r in metrics)
    row = {
        "cluster": cluster, "rank": at + 1, "plan": plan.layout, "micro_batch": plan.micro_batch,
        "zero": plan.zero_stage, "node_order": ",".join(map(str, plan.node_order)),
        "predicted_s": plan.step_s, "measured_s": measured, "error": measured / plan.step_s - 1,
    }  # fmt: skip
    print(f"  #{at + 1} {plan.layout} mb {plan.micro_batch} order {row['node_order']}: predicted "
          f"{plan.step_s:.3f} s, measured {measured:.3f} s ({row['error']:+.1%})", flush=True)  # fmt: skip
    return row


def summarize(name: str, rows: list[dict], cal: Calibration, plans: int) -> dict:
    """Per cluster: mean and worst absolute error, and the chosen plan against the best measured."""
    errors = [abs(r["error"]) for r in rows]
    best = min(r["measured_s"] for r in rows)
    top = next(r for r in rows if r["rank"] == 1)
    return {
        "cluster": name, "plans": plans, "run": len(rows), "mean_error": statistics.mean(errors),
        "worst_error": max(errors), "chosen_vs_best": top["measured_s"] / best,
        "chosen_is_fastest": top["measured_s"] == best, "calibration": dataclasses.asdict(cal),
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    for name in dict.fromkeys(r["cluster"] for r in rows):
        mine = [r for r in rows if r["cluster"] == name]
        ax.scatter([r["predicted_s"] for r in mine], [r["measured_s"] for r in mine], label=name)
    top = max(max(r["predicted_s"], r["measured_s"]) for r in rows) * 1.05
    ax.plot([0, top], [0, top], color="black", linestyle=":", label="measured = predicted")
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.15, label="±10 %")
    ax.set(xlabel="predicted step time (s)", ylabel="measured step time (s)", xlim=(0, top), ylim=(0, top),
           title="Layout planner: predicted against measured")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ["cluster", "rank", "plan", "micro_batch", "node_order", "predicted_s", "measured_s", "error"]


def rescore(saved: Path = RESULTS / "plan_accuracy.json") -> None:
    """The stored runs' step times against the current cost model's predictions (the runs do not depend
    on the model: a model change is checked without running them again). Each cluster's calibration is
    the stored one; a run whose plan the model no longer makes (another split or shares) is left out, and
    said. Writes results/plan_accuracy_rescored.{md,json}."""
    data = json.loads(saved.read_text())
    cfg = load_config(MODEL)
    vocab = pretrain_gpt.vocab_size(cfg)
    known = {c.name: c for c in CLUSTERS}
    rows = []
    for summary in data["meta"]["clusters"]:
        vc = known[summary["cluster"]]
        stored = dict(summary["calibration"])
        stored["sizes"] = tuple(SizePoint(**p) for p in stored.get("sizes", ()))
        plans = plan_layouts(cfg, vc.cluster(), vocab, calibration=Calibration(**stored))
        made = {(p.layout, p.micro_batch, ",".join(map(str, p.node_order))): p for p in plans}
        for run in (r for r in data["rows"] if r["cluster"] == vc.name):
            plan = made.get((run["plan"], run["micro_batch"], run["node_order"]))
            if plan is None:
                print(f"{vc.name} #{run['rank']} {run['plan']}: no longer planned (left out)")
                continue
            rows.append({**run, "predicted_before_s": run["predicted_s"], "error_before": run["error"],
                         "predicted_s": plan.step_s, "error": run["measured_s"] / plan.step_s - 1})  # fmt: skip
    meta = {
        "from": str(saved), "runs": len(rows), "mean_error": statistics.mean(abs(r["error"]) for r in rows),
        "worst_error": max(abs(r["error"]) for r in rows),
        "mean_error_before": statistics.mean(abs(r["error_before"]) for r in rows),
        "worst_error_before": max(abs(r["error_before"]) for r in rows),
    }  # fmt: skip
    save_results("plan_accuracy_rescored", rows, [*COLUMNS, "predicted_before_s", "error_before"], meta)
    print(f"rescored {len(rows)} runs: mean error {meta['mean_error']:.1%} (before {meta['mean_error_before']:.1%}), "
          f"worst {meta['worst_error']:.1%} (before {meta['worst_error_before']:.1%})")  # fmt: skip


def accuracy_parser(description: str, clusters) -> argparse.ArgumentParser:
    """The options this benchmark and benchmarks/plan_accuracy_real.py share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--clusters", default=",".join(c.name for c in clusters))
    parser.add_argument("--top", type=int, default=3, help="the planner's fastest plans to run")
    parser.add_argument("--low", type=int, default=2, help="plans ranked in the lower half to run")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first 2 are start-up)")
    return parser


def chosen_clusters(args, clusters) -> list:
    """The clusters --clusters names, in its order; SystemExit for an unknown one or too few --steps."""
    known = {c.name: c for c in clusters}
    names = args.clusters.split(",")
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"--clusters: unknown {unknown}: choose from {sorted(known)}")
    if args.steps <= PROFILE_START_STEPS:
        raise SystemExit(f"--steps must be more than the {PROFILE_START_STEPS} start-up steps")
    return [known[n] for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = accuracy_parser(__doc__.splitlines()[0], CLUSTERS)
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="no runs: the stored runs against the current model's predictions",
    )
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore()
    RUNS.mkdir(parents=True, exist_ok=True)
    rows, summaries = [], []
    for cluster in chosen_clusters(args, CLUSTERS):
        cluster_rows, summary = bench_cluster(cluster, args.top, args.low, args.steps)
        rows += cluster_rows
        summaries.append(summary)
    meta = {"rate_gflops": RATE_GFLOPS, "model": MODEL, "steps": args.steps, "clusters": summaries}
    meta["mean_error"] = statistics.mean(abs(r["error"]) for r in rows)
    meta["worst_error"] = max(abs(r["error"]) for r in rows)
    save_results("plan_accuracy", rows, COLUMNS, meta)
    plot(rows, RESULTS / "plan_accuracy.png")
    for s in summaries:
        print(f"{s['cluster']}: mean error {s['mean_error']:.1%}, worst {s['worst_error']:.1%}; chosen plan "
              f"{s['chosen_vs_best']:.3f}x the best measured")  # fmt: skip
    ok_mean = meta["mean_error"] <= 0.10
    ok_choice = all(s["chosen_vs_best"] <= 1.05 for s in summaries)
    print(f"goal mean error <= 10 %: {meta['mean_error']:.1%} ({'met' if ok_mean else 'MISSED'}); chosen "
          f"within 5 % of the best on every cluster: {'met' if ok_choice else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
