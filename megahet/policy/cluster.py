"""A mixed cluster's description (`--cluster cluster.yaml`): its nodes in launch order, each with its GPUs'
kind, memory, matmul rate and links. Pure; every error is one line naming the key and the fix.

Role: policy (input of the layout planner, megahet/policy/layout_search.py).

    nodes:                                  # in launch order: node i runs ranks i*G .. i*G+G-1
      - {kind: A100-80GB, gpus: 8, count: 4}
      - {kind: V100-32GB, gpus: 8, count: 4, tflops: 14.2}     # a measured rate overrides the table
      - {name: box, gpus: 2, memory_gib: 24, tflops: 35.6, intra_gbps: 16}   # a kind not in the table
    network_gbps: 12.5                      # between nodes, per direction (default 12.5 GB/s = 100 Gb/s)

    cluster = read_cluster("cluster.yaml", precision="bf16")
    cluster.world_size, cluster.gpus_per_node, cluster.rank_tflops()

A node's `tflops` is per GPU at the run's precision; without it, the kind's datasheet peak
(megahet/policy/gpu_kinds.py). Every node has the same number of GPUs (one `--nproc-per-node`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from megahet.policy.gpu_kinds import gpu_kind

DEFAULT_NETWORK_GBPS = 12.5
NODE_KEYS = {"kind", "name", "gpus", "count", "memory_gib", "tflops", "intra_gbps", "network_gbps"}
CLUSTER_KEYS = {"nodes", "network_gbps"}


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    gpus: int
    memory_gib: float
    tflops: float
    """Per GPU, at the run's precision: the datasheet peak, or a measured rate."""
    intra_gbps: float
    """GPU to GPU inside the node, per direction."""
    network_gbps: float
    """The node's link to the others, per direction."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]

    @property
    def gpus_per_node(self) -> int:
        return self.nodes[0].gpus

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * len(self.nodes)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank_tflops(self) -> list[float]:
        """Each global rank's rate, in launch order."""
        return [node.tflops for node in self.nodes for _ in range(node.gpus)]

    def with_node_order(self, order: tuple[int, ...]) -> Cluster:
        """The same nodes launched in `order` (node i of the result is node order[i] of this one)."""
        return Cluster(tuple(self.nodes[i] for i in order))


def read_cluster(path: str, precision: str) -> Cluster:
    """The cluster a YAML (or JSON) file describes, for a run at `precision` ('bf16' or 'fp32')."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"cluster file {path} not found: pass an existing YAML file with --cluster")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError:
        raise ValueError(f"cluster file {path} is not valid YAML: fix its syntax") from None
    return parse_cluster(data, path, precision)


def parse_cluster(data: Any, source: str, precision: str) -> Cluster:
    if not isinstance(data, dict) or "nodes" not in data:
        raise ValueError(f"{source}: a cluster is a mapping with a `nodes:` list (see docs/planning.md)")
    unknown = set(data) - CLUSTER_KEYS
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)}: a cluster has {sorted(CLUSTER_KEYS)}")
    network = _positive(data.get("network_gbps", DEFAULT_NETWORK_GBPS), f"{source}: network_gbps")
    entries = data["nodes"]
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: `nodes:` must be a non-empty list of node descriptions")
    nodes: list[Node] = []
    for i, entry in enumerate(entries):
        where = f"{source}: nodes[{i}]"
        node, count = _node(entry, where, precision, network)
        nodes += [
            dataclasses.replace(node, name=f"{node.name}-{n}") if count > 1 else node for n in range(count)
        ]
    sizes = sorted({n.gpus for n in nodes})
    if len(sizes) > 1:
        raise ValueError(
            f"{source}: nodes have {sizes} GPUs: launchers start the same number of ranks per node "
            f"(--nproc-per-node): describe only that many GPUs of each node"
        )
    return Cluster(tuple(nodes))


def _node(entry: Any, where: str, precision: str, network: float) -> tuple[Node, int]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping such as {{kind: A100-80GB, gpus: 8}}")  # noqa: TRY004 (a bad input)
    unknown = set(entry) - NODE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}: a node has {sorted(NODE_KEYS)}")
    gpus = _count(entry.get("gpus"), f"{where}: gpus")
    count = _count(entry.get("count", 1), f"{where}: count")
    try:
        kind = gpu_kind(str(entry["kind"])) if "kind" in entry else None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    name = str(entry.get("name", kind.name if kind else f"node{where.rsplit('[', 1)[-1].rstrip(']')}"))
    if kind is None:
        missing = [k for k in ("memory_gib", "tflops", "intra_gbps") if k not in entry]
        if missing:
            raise ValueError(f"{where}: without a kind, give {', '.join(missing)} (or a kind from the table)")
    tflops = entry.get("tflops", kind.tflops(precision) if kind else None)
    if tflops is None:
        raise ValueError(
            f"{where}: {kind.name} has no {precision} (datasheet): plan with train.precision fp32, or give "
            f"the node's measured tflops"
        )
    return (
        Node(
            name=name,
            gpus=gpus,
            memory_gib=_positive(entry.get("memory_gib", kind.memory_gib if kind else None), f"{where}: memory_gib"),
            tflops=_positive(tflops, f"{where}: tflops"),
            intra_gbps=_positive(entry.get("intra_gbps", kind.intra_node_gbps if kind else None), f"{where}: intra_gbps"),
            network_gbps=_positive(entry.get("network_gbps", network), f"{where}: network_gbps"),
        ),
        count,
    )  # fmt: skip


def _positive(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive number, got {value!r}") from None
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return number


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    return value
