"""The layout planner against runs on nodes whose speeds are real (issue 49, item 2): no virtual devices.

    python benchmarks/plan_accuracy_real.py                   # both clusters (~8 min on 2 quiet cores)
    python benchmarks/plan_accuracy_real.py --clusters 2n-t2 --top 2 --low 1

benchmarks/plan_accuracy.py validates on virtual devices, which charge the layers' own FLOP counters at
a declared rate: the compute part of its error is zero by construction (the planner counts the same
FLOPs). Here each "node" is one CPU core, its rank pinned to it (tools/pin_ranks.py), and node 1 is
slow because busy processes share its core (multi-tenant contention: the kernel gives it what it
gives). Nothing declares a speed:

1. **Calibration**: profiling runs with no tenant (TP 1, PP 1: each node a replica; micro-batches of 1
   and of 4, for the layers' rate per size): the two nodes are alike then. Node 0's measured layer rate
   (micro-batch 1) is the calibration's reference `tflops`.
2. **Node speeds**: the micro-batch 1 profiling run with the tenants on node 1's core. Each node's `tflops` in
   the cluster description is the layer rate it measured (`megahet.policy.calibration.node_tflops`).
3. The planner ranks every plan on that description; its `--top` plans and `--low` of its lower half run
   with the tenants on, each with its nodes launched in its order (ranks pinned to their node's core),
   and the median step time after the start-up steps is compared with the prediction.

The report sets the error beside the emulated clusters' (benchmarks/results/plan_accuracy.json).
Writes benchmarks/results/plan_accuracy_real.{md,json,png}; runs' logs in plan_accuracy_real_runs/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pretrain_gpt
from benchmarks.common import RESULTS, save_results
from benchmarks.contention import competing_process, two_cores
from benchmarks.plan_accuracy import (
    COLUMNS,
    LINK_GBPS,
    MODEL,
    accuracy_parser,
    chosen,
    chosen_clusters,
    launch,
    plot,
    run_plan,
    summarize,
)
from megahet.config import MegahetConfig, load_config
from megahet.layout_plan import PROFILE_START_STEPS, plan_layouts
from megahet.policy.calibration import Profile, fit_calibration, node_tflops
from megahet.policy.cluster import Cluster, parse_cluster
from megahet.policy.layout_cost import ModelShape

RUNS = RESULTS / "plan_accuracy_real_runs"
CALIBRATION_MICRO_BATCHES = (1, 4)
"""The calm profiles' micro-batch sizes: larger GEMMs run at a higher rate on this CPU as on a GPU, a
difference the planner's choice of micro-batch size depends on."""


@dataclasses.dataclass(frozen=True)
class RealCluster:
    """Two nodes of one rank each: node n is core n (a rank per core: ranks that shared a core would not be
    devices of their own, issue 49 item 15), node 1 shared with `tenants` busy processes."""

    name: str
    tenants: int
    """Busy processes on node 1's core (each in a session of its own: a tenant of the rank's weight)."""
    gpus: int = 1
    world_size: int = 2

    def rank_cores(self, node_order: tuple[int, ...], cores: list[int]) -> list[int]:
        """The core of each global rank: rank r runs on node node_order[r], node n on cores[n]."""
        return [cores[n] for n in node_order]

    def cluster(self, tflops: list[float]) -> Cluster:
        """The description with each node's measured rate (docs/planning.md's format), loopback links."""
        nodes = [
            {"name": f"core{n}", "gpus": self.gpus, "memory_gib": 16, "tflops": rate,
             "intra_gbps": LINK_GBPS, "network_gbps": LINK_GBPS}
            for n, rate in enumerate(tflops)
        ]  # fmt: skip
        return parse_cluster({"nodes": nodes}, self.name, "fp32")


CLUSTERS = (
    RealCluster("2n-t1", tenants=1),  # node 1's rank gets ~1/2 of its core
    RealCluster("2n-t2", tenants=2),  # ~1/3
)


def profile(
    rc: RealCluster, cfg: MegahetConfig, cores: list[int], steps: int, tag: str, mb: int = 1
) -> Profile:
    """A profiling run across both nodes (node 0 first), PP 1, TP 1, micro-batches of `mb`, layers timed
    (--balance.trace)."""
    trace = RUNS / f"{rc.name}_{tag}.trace.jsonl"
    trace.unlink(missing_ok=True)
    args = [
        *MODEL, "--parallel.tp", "1", "--train.micro_batch_size", str(mb),
        "--balance.trace", str(trace),
    ]  # fmt: skip
    launch(f"{rc.name}_{tag}", rc.world_size, args, steps, RUNS, rc.rank_cores((0, 1), cores))
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    return Profile.from_trace_rows(
        rows, cfg.model.num_layers, cfg.train.global_batch_size, PROFILE_START_STEPS
    )


def bench_cluster(
    rc: RealCluster, cores: list[int], top: int, low: int, steps: int
) -> tuple[list[dict], dict]:
    cfg = load_config(MODEL)
    vocab = pretrain_gpt.vocab_size(cfg)
    shape = ModelShape.of(cfg.model, vocab, 1)
    calm = [profile(rc, cfg, cores, steps, f"calm_mb{mb}", mb) for mb in CALIBRATION_MICRO_BATCHES]
    calm_rates = node_tflops(calm[0], shape, rc.gpus)
    cal = fit_calibration(
        calm, shape, reference_tflops=calm_rates[0], precision="fp32",
        link_gbps=LINK_GBPS,
    )  # fmt: skip
    with competing_process(cores[1], rc.tenants):
        rates = node_tflops(profile(rc, cfg, cores, steps, "speeds"), shape, rc.gpus)
        speeds = [r / rates[0] for r in rates]
        plans = plan_layouts(cfg, rc.cluster(rates), vocab, calibration=cal)
        print(f"{rc.name}: node rates calm {_gflops(calm_rates)}, with {rc.tenants} tenant(s) on node 1 "
              f"{_gflops(rates)} (speeds {speeds[0]:.2f}, {speeds[1]:.2f}); {len(plans)} plans; {cal}")  # fmt: skip
        rows = [
            run_plan(rc.name, cfg, plans, at, rc.world_size, steps, [], RUNS, rc.rank_cores(plans[at].node_order, cores))
            for at in chosen(plans, top, low)
        ]  # fmt: skip
    summary = summarize(rc.name, rows, cal, len(plans))
    by_size = {mb: node_tflops(c, shape, rc.gpus)[0] for mb, c in zip(CALIBRATION_MICRO_BATCHES, calm)}
    summary.update(calm_tflops=calm_rates, tflops=rates, speeds=speeds, node0_tflops_by_micro_batch=by_size)
    return rows, summary


def _gflops(rates: list[float]) -> str:
    return "/".join(f"{r * 1e3:.2f}" for r in rates) + " GFLOP/s"


def emulated() -> dict | None:
    """The emulated clusters' summary (benchmarks/plan_accuracy.py's last results), if there are any."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        meta = json.loads((RESULTS / "plan_accuracy.json").read_text())["meta"]
        return {"mean_error": meta["mean_error"], "worst_error": meta["worst_error"]}
    return None


def main(argv: list[str] | None = None) -> None:
    args = accuracy_parser(__doc__.splitlines()[0], CLUSTERS).parse_args(argv)
    clusters = chosen_clusters(args, CLUSTERS)
    cores = two_cores()
    if cores is None:
        raise SystemExit("needs two CPU cores (one per node): run it where os.sched_getaffinity has two")
    RUNS.mkdir(parents=True, exist_ok=True)
    rows, summaries = [], []
    for cluster in clusters:
        cluster_rows, summary = bench_cluster(cluster, cores, args.top, args.low, args.steps)
        rows += cluster_rows
        summaries.append(summary)
    meta = {"model": MODEL, "steps": args.steps, "cores": cores, "clusters": summaries}
    meta["mean_error"] = statistics.mean(abs(r["error"]) for r in rows)
    meta["worst_error"] = max(abs(r["error"]) for r in rows)
    meta["emulated"] = emulated()
    save_results("plan_accuracy_real", rows, COLUMNS, meta)
    plot(rows, RESULTS / "plan_accuracy_real.png")
    for s in summaries:
        print(f"{s['cluster']}: node speeds {s['speeds'][0]:.2f}, {s['speeds'][1]:.2f} (measured); mean error "
              f"{s['mean_error']:.1%}, worst {s['worst_error']:.1%}; chosen plan {s['chosen_vs_best']:.3f}x "
              f"the best measured")  # fmt: skip
    beside = meta["emulated"]
    print(f"real node speeds: mean error {meta['mean_error']:.1%}, worst {meta['worst_error']:.1%}"
          + (f"; emulated (plan_accuracy.json): mean {beside['mean_error']:.1%}, worst "
             f"{beside['worst_error']:.1%}" if beside else ""))  # fmt: skip


if __name__ == "__main__":
    main()
