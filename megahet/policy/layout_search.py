"""The layout planner's search: every TP x PP x DP layout of a mixed cluster that fits, with its predicted
step time and memory, ranked, and the Pareto set of memory against time. Pure.

Role: policy (tools/plan.py runs it and writes each plan's configuration).

    plans = search(cluster, shape_for, TrainSetting(global_batch=256, micro_batches=(1, 2, 4)), fits=...)
    plans[0].step_s, plans[0].overrides()          # the fastest plan and its --section.key values
    pareto(plans)                                  # no other plan is both faster and smaller

For each layout (TP inside a node, PP, DP, the micro-batch size, the ZeRO stage) and each launch order
of the nodes (as given, fastest first, slowest first, kinds interleaved: which GPUs share a stage and
which a replica), it places the ranks as megatron-core does (megahet/policy/mesh.py) and runs
megahet's own planners on the cost model's times (megahet/policy/layout_cost.py): the stage split
(`best_split`: layers by each stage's slowest replica) and the DP shares (`dp_shares`: micro-batches by
each replica's pace). The step is the slowest replica's 1F1B time over its share plus the DP gradient
reduction. A plan whose memory exceeds any GPU's (less `memory_reserve`) is left out. Its configuration
reproduces the same split and shares at run time: `parallel.stage_layers`, and `hetero.speeds` with
each replica's modeled pace under `hetero.dp_shares declared`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from megahet.policy.calibration import Calibration
from megahet.policy.cluster import Cluster
from megahet.policy.dp_shares import DataParallelShares, dp_shares
from megahet.policy.layout_cost import (
    ModelShape,
    gradient_sync_seconds,
    layer_seconds,
    one_f_one_b_seconds,
    output_seconds,
    rank_memory_bytes,
    send_seconds,
)
from megahet.policy.mesh import coords_of
from megahet.policy.stage_split import StageSplit, best_split, format_split

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TrainSetting:
    global_batch: int
    """Samples per step (train.global_batch_size)."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes to try (those that divide the global batch)."""
    zero_stages: tuple[int, ...] = (1, 2)
    precision: str = "bf16"
    memory_reserve: float = 0.1
    """Fraction of every GPU's memory kept free (CUDA context, allocator fragmentation)."""
    efficiency: float = 1.0
    """Fraction of a node's `tflops` the matmuls reach (1: the rates given are effective ones)."""
    calibration: Calibration | None = None
    """A profiling run's measurements (megahet/policy/calibration.py): the layers' efficiency (in place
    of `efficiency`), the compute outside the layers, the per-step time and each message's latency."""

    @property
    def latency_s(self) -> float:
        """Each collective's and each pipeline send's fixed time (from the calibration; else none)."""
        return self.calibration.latency_s if self.calibration is not None else 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    zero_stage: int
    node_order: tuple[int, ...]
    """Launch order: node_rank i is the cluster file's node node_order[i]."""
    split: StageSplit
    shares: DataParallelShares
    step_s: float
    """Predicted seconds per step."""
    memory_fraction: float
    """The fullest GPU's predicted memory over what it may use (<= 1)."""
    peak_gib: float
    """The fullest GPU's predicted memory (the one of `memory_fraction`: on a mixed cluster not always the
    largest in bytes)."""
    rank_speeds: tuple[float, ...]
    """Per global rank, its replica's modeled pace (relative): what `hetero.speeds` declares."""
    fullest: str = ""
    """The fullest GPU: its node's name and global rank, e.g. 'a100-0 rank 3'."""

    def overrides(self) -> dict[str, str]:
        """The `--section.key value` settings that run this plan (with the launch order of its nodes)."""
        out = {
            "parallel.tp": str(self.tp),
            "parallel.pp": str(self.pp),
            "parallel.zero_stage": str(self.zero_stage),
            "train.micro_batch_size": str(self.micro_batch),
        }
        if self.split.uneven:
            out["parallel.stage_layers"] = format_split(self.split)
        if not self.shares.even:
            out["hetero.speeds"] = ",".join(f"{s:.4g}" for s in self.rank_speeds)
            out["hetero.dp_shares"] = "declared"
        return out

    @property
    def layout(self) -> str:
        split = f" layers {format_split(self.split)}" if self.split.uneven else ""
        return f"TP {self.tp} x PP {self.pp}{split} x DP {self.dp}"


def node_orders(cluster: Cluster) -> list[tuple[int, ...]]:
    """Launch orders worth trying: as given, fastest nodes first, slowest first, and the kinds
    interleaved (fastest first); orders that put the same rates on the same ranks are tried once."""
    n = len(cluster.nodes)
    rate = [node.tflops for node in cluster.nodes]
    by_rate = sorted(range(n), key=lambda i: (-rate[i], i))
    kinds: dict[float, list[int]] = {}
    for i in by_rate:
        kinds.setdefault(rate[i], []).append(i)
    interleaved = [i for group in _round_robin(list(kinds.values())) for i in group]
    orders, seen = [], set()
    for order in (tuple(range(n)), tuple(by_rate), tuple(reversed(by_rate)), tuple(interleaved)):
        key = tuple(rate[i] for i in order)
        if key not in seen:
            seen.add(key)
            orders.append(order)
    return orders


def _round_robin(groups: list[list[int]]) -> list[list[int]]:
    rounds = max(len(g) for g in groups)
    return [[g[r] for g in groups if r < len(g)] for r in range(rounds)]


def evaluate(
    cluster: Cluster,
    shape: ModelShape,
    setting: TrainSetting,
    *,
    tp: int,
    pp: int,
    micro_batch: int,
    zero_stage: int,
    node_order: tuple[int, ...],
) -> Plan | None:
    """The plan for one layout and launch order, or None where it cannot run (TP across nodes, fewer
    micro-batches than replicas, more stages than layers) or does not fit in memory."""
    placed = cluster.with_node_order(node_order)
    world, per_node = placed.world_size, placed.gpus_per_node
    if per_node % tp or world % (tp * pp) or pp > shape.layers or setting.global_batch % micro_batch:
        return None
    dp = world // (tp * pp)
    microbatches = setting.global_batch // micro_batch
    if microbatches < dp or (zero_stage >= 2 and pp > 1):
        return None
    cells = _cells(world, tp, dp)
    cal = setting.calibration
    tokens = micro_batch * shape.seq
    rate = cal.efficiency(tokens) if cal is not None else setting.efficiency
    layer = [[0.0] * pp for _ in range(dp)]
    extra = [[0.0] * pp for _ in range(dp)]
    for (d, s), ranks in cells.items():
        node = placed.nodes[placed.node_of(ranks[0])]
        nominal = min(placed.nodes[placed.node_of(r)].tflops for r in ranks)
        layer[d][s] = layer_seconds(
            shape, micro_batch=micro_batch, tp=tp, tflops=nominal * rate, intra_gbps=node.intra_gbps,
            precision=setting.precision, latency_s=setting.latency_s,
        )  # fmt: skip
        if s == pp - 1 and cal is not None:
            extra[d][s] = cal.extra_seconds(micro_batch, nominal, tp, tokens)
        elif s == pp - 1:
            extra[d][s] = output_seconds(shape, micro_batch=micro_batch, tp=tp, tflops=nominal * rate)
    layer_s = [max(layer[d][s] for d in range(dp)) for s in range(pp)]
    extra_s = [max(extra[d][s] for d in range(dp)) for s in range(pp)]
    split = best_split(layer_s, extra_s, shape.layers) if pp > 1 else StageSplit((shape.layers,))
    stage_s = [
        [
            split[s] * layer[d][s] + extra[d][s]
            + (_send(placed, shape, cells[d, s], cells[d, s + 1], micro_batch, setting) if s < pp - 1 else 0.0)
            for s in range(pp)
        ]
        for d in range(dp)
    ]  # fmt: skip
    paces = [1.0 / max(times) for times in stage_s]
    shares = dp_shares(paces, microbatches)
    replica_s = max(one_f_one_b_seconds(times, n) for times, n in zip(stage_s, shares))
    sync_s = max(_gradient_sync(placed, shape, cells, split, tp, pp, dp, s, setting) for s in range(pp))
    fraction, peak, fullest = 0.0, 0, ""
    for (d, s), ranks in cells.items():
        used = rank_memory_bytes(
            shape, tp=tp, layers=split[s], first=s == 0, last=s == pp - 1, pp=pp, dp=dp,
            in_flight=min(pp - s, shares[d]), micro_batch=micro_batch, zero_stage=zero_stage,
            precision=setting.precision,
        )  # fmt: skip
        for r in ranks:
            node = placed.nodes[placed.node_of(r)]
            capacity = node.memory_gib * GIB * (1 - setting.memory_reserve)
            if used / capacity > fraction:
                fraction, peak, fullest = used / capacity, used, f"{node.name} rank {r}"
    if fraction > 1:
        return None
    fastest = max(paces)
    speeds = [0.0] * world
    for (d, _s), ranks in cells.items():
        for r in ranks:
            speeds[r] = paces[d] / fastest
    return Plan(
        tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, zero_stage=zero_stage, node_order=node_order,
        split=split, shares=shares, step_s=replica_s + sync_s + _per_step(cal, placed),
        memory_fraction=fraction,
        peak_gib=peak / GIB, rank_speeds=tuple(speeds), fullest=fullest,
    )  # fmt: skip


def _per_step(cal: Calibration | None, placed: Cluster) -> float:
    """The step's work outside the micro-batches (the calibration's; none without one): at the slowest
    device's rate (every node holds ranks, and a slow device runs its optimizer step slower too)."""
    return cal.step_seconds(min(n.tflops for n in placed.nodes)) if cal is not None else 0.0


def _cells(world: int, tp: int, dp: int) -> dict[tuple[int, int], list[int]]:
    """(replica, stage) -> its TP group's global ranks."""
    cells: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        d, s, _ = coords_of(rank, tp, dp)
        cells.setdefault((d, s), []).append(rank)
    return cells


def _link_gbps(cluster: Cluster, ranks: list[int]) -> float:
    """The bandwidth between `ranks`: the node's own links if they share one, else the slowest network."""
    nodes = {cluster.node_of(r) for r in ranks}
    if len(nodes) == 1:
        return cluster.nodes[nodes.pop()].intra_gbps
    return min(cluster.nodes[n].network_gbps for n in nodes)


def _send(cluster, shape, here, there, micro_batch, setting) -> float:
    gbps = _link_gbps(cluster, [here[0], there[0]])
    return send_seconds(
        shape, micro_batch=micro_batch, gbps=gbps, precision=setting.precision, latency_s=setting.latency_s
    )


def _gradient_sync(cluster, shape, cells, split, tp, pp, dp, stage, setting) -> float:
    """Stage `stage`'s DP gradient reduction (ZeRO-1/2: reduce-scatter of the gradients, all-gather of the
    updated weights: an all-reduce's volume), over its replicas' slowest link."""
    params = shape.rank_params(tp, split[stage], stage == 0, stage == pp - 1, pp)
    ranks = [cells[d, stage][0] for d in range(dp)]
    return gradient_sync_seconds(params, dp, _link_gbps(cluster, ranks), setting.precision, setting.latency_s)


def search(
    cluster: Cluster,
    shape_for: Callable[[int], ModelShape],
    setting: TrainSetting,
    fits: Callable[[Plan], bool] = lambda plan: True,
    orders: list[tuple[int, ...]] | None = None,
) -> list[Plan]:
    """Every plan that runs and fits, fastest first (ties: less memory; of plans that differ only by which
    replica runs where, the first launch order). `shape_for(tp)`: the model's
    shape with its vocabulary padded for that TP; `fits(tp, pp, micro_batch, zero_stage)`: the
    configuration's own checks of a plan's settings (heads, groups and layers divisible, ZeRO-2 without
    DP shares, ...: megahet/layout_plan.py passes megahet's validation); `orders`: the launch orders to
    try (default `node_orders`; a job already launched has only its own)."""
    plans = []
    world, per_node = cluster.world_size, cluster.gpus_per_node
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            for micro_batch in setting.micro_batches:
                for zero_stage in setting.zero_stages:
                    for order in orders if orders is not None else node_orders(cluster):
                        plan = evaluate(
                            cluster, shape_for(tp), setting, tp=tp, pp=pp, micro_batch=micro_batch,
                            zero_stage=zero_stage, node_order=order,
                        )  # fmt: skip
                        if plan is not None and fits(plan):
                            plans.append(plan)
    unique: dict[tuple, Plan] = {}
    for plan in sorted(plans, key=lambda p: (p.step_s, p.peak_gib)):
        same = (plan.tp, plan.pp, plan.micro_batch, plan.zero_stage, plan.split, tuple(sorted(plan.shares)),
                round(plan.step_s, 9), round(plan.memory_fraction, 6))  # fmt: skip
        unique.setdefault(same, plan)  # launch orders that only permute replicas: the first one
    return list(unique.values())


def pareto(plans: list[Plan]) -> list[Plan]:
    """The plans no other plan beats on both step time and memory (the fullest GPU's fraction), fastest
    first: the trade-off TensorOpt offers."""
    front, best_memory = [], math.inf
    for plan in sorted(plans, key=lambda p: (p.step_s, p.memory_fraction)):
        if plan.memory_fraction < best_memory:
            front.append(plan)
            best_memory = plan.memory_fraction
    return front
