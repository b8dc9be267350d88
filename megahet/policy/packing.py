"""Documents of one global batch -> data-parallel replicas -> packed micro-batches, by cost and speed. Pure.

Role: policy (issue 28: variable-length documents; the data stream executes the plan, megahet/data/packed.py).

A packed micro-batch holds whole documents (or pieces of documents longer than the token cap) whose
attention stays inside each document, so its cost is not its token count: about a*sum(s^2) + b*sum(s)
+ c (`DocCost`). Two imbalances follow from the length mix, and the plan fixes both (Hydraulis):

- *sampling*: replicas with the same number of documents but different lengths finish at different
  times. Stage 1 (`assign_replicas`) gives each document to the replica whose predicted finish time
  (its cost over its measured speed) grows least, in longest-first order and then in `tries` seeded
  random orders, and keeps the order whose slowest replica is fastest;
- *packing*: packs of the same token count take different times. Stage 2 (`pack_micro_batches`)
  packs one replica's documents under its token cap into v micro-batches, cheapest-bin-first in
  longest-first order then evened out by moves and swaps out of the costliest, for v from the fewest
  that fit upwards, and keeps the v that minimizes the replica's 1F1B time: sum over micro-batches of
  (cost + c) plus (PP - 1) x the slowest one. One document costlier than the mean micro-batch bounds how
  even they can be (`micro_batch_bound`).

The baselines of the ladder in benchmarks/varlen_efficiency.py are here too, so that they are planned
from the same documents: `round_robin_plan` (documents dealt in order, packed in order) and
`token_balanced_plan` (Karmarkar-Karp on token counts over replicas and micro-batches, as verl).

    cost = DocCost(a=2e-9, b=1e-5, c=1e-3)
    plan = cost_balanced_plan(lengths, cost, speeds=(1.0, 0.5), caps=(2048, 2048), pp=1, seed=7)
    plan.replicas[1]        # replica 1's micro-batches, each a tuple of indices into `lengths`
    replica_times(plan, lengths, cost, speeds, pp=1)   # predicted seconds per replica
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

import numpy as np

MicroBatch = tuple[int, ...]
"""Indices of the documents (pieces) of one packed micro-batch, into the global batch's lengths."""


@dataclasses.dataclass(frozen=True)
class DocCost:
    """t = a*s^2 + b*s seconds per document of s tokens (attention, then everything linear in s), plus
    c per micro-batch (launches, the output layer's fixed part, the pipeline's per-micro-batch sends)."""

    a: float
    b: float
    c: float

    def __post_init__(self):
        values = (self.a, self.b, self.c)
        if any(not math.isfinite(v) or v < 0 for v in values) or self.a + self.b <= 0:
            raise ValueError(f"document cost needs finite a, b, c >= 0 with a + b > 0, got {values}")

    def docs(self, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """Each document's cost, float64 [n]."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.a * s * s + self.b * s

    def micro_batch(self, lengths: np.ndarray | Sequence[int]) -> float:
        """One packed micro-batch of these documents, c included."""
        return float(self.docs(lengths).sum()) + self.c


TOKEN_COST = DocCost(a=0.0, b=1.0, c=0.0)
"""Cost = tokens: the token-count view of the baselines."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """replicas[r] = replica r's micro-batches in the order it runs them."""

    replicas: tuple[tuple[MicroBatch, ...], ...]

    def num_micro_batches(self) -> tuple[int, ...]:
        return tuple(len(mbs) for mbs in self.replicas)

    def documents(self) -> list[int]:
        """Every document index the plan uses, once per use, sorted."""
        return sorted(i for mbs in self.replicas for mb in mbs for i in mb)


def pipeline_time(micro_batch_costs: Sequence[float], pp: int) -> float:
    """A replica's 1F1B time in units of whole-model micro-batch cost: sum + (PP - 1) x the slowest
    (each stage runs 1 / PP of every micro-batch; the warm-up and cool-down run the slowest PP - 1 more)."""
    if not micro_batch_costs:
        return 0.0
    return float(sum(micro_batch_costs)) + (pp - 1) * float(max(micro_batch_costs))


def micro_batch_bound(mb_costs: Sequence[float], lengths: Sequence[int], cost: DocCost) -> float:
    """The least slowest / mean micro-batch cost any packing into micro-batches of these costs (`mb_costs`,
    every replica's) can reach: the costliest single document (+ c) over the mean (a micro-batch cannot be
    cheaper than its costliest document), or 1."""
    return max(1.0, (float(cost.docs(lengths).max()) + cost.c) / (sum(mb_costs) / len(mb_costs)))


def micro_batch_costs(micro_batches: Sequence[MicroBatch], lengths: np.ndarray, cost: DocCost) -> list[float]:
    per_doc = cost.docs(lengths)
    return [float(per_doc[list(mb)].sum()) + cost.c for mb in micro_batches]


def replica_times(
    plan: BatchPlan, lengths: Sequence[int], cost: DocCost, speeds: Sequence[float], pp: int = 1
) -> list[float]:
    """Predicted time of every replica: its pipeline time at speed 1 over its speed."""
    lengths = np.asarray(lengths)
    return [
        pipeline_time(micro_batch_costs(mbs, lengths, cost), pp) / speed
        for mbs, speed in zip(plan.replicas, speeds, strict=True)
    ]


def _check(lengths: np.ndarray, speeds: Sequence[float], caps: Sequence[int]) -> None:
    if len(speeds) != len(caps) or not speeds:
        raise ValueError(f"need one speed and one token cap per replica, got {list(speeds)} and {list(caps)}")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(f"replica speeds must be positive and finite, got {list(speeds)}")
    if min(caps) < 1:
        raise ValueError(f"token caps must be positive, got {list(caps)}")
    if len(lengths) < len(speeds):
        raise ValueError(f"{len(lengths)} documents cannot give each of {len(speeds)} replicas one")
    if lengths.size and (lengths.min() < 1 or lengths.max() > max(caps)):
        raise ValueError(f"document lengths must be in [1, {max(caps)}] (the largest token cap)")


def _greedy_assign(
    order: np.ndarray, costs: np.ndarray, lengths: np.ndarray, speeds: np.ndarray, caps: np.ndarray, c: float
) -> tuple[np.ndarray, float]:
    """Each document in `order` to the replica (that can hold it) whose predicted finish grows least;
    a replica's load counts c per cap's worth of tokens. Returns (replica per document, slowest time)."""
    load = np.zeros(len(speeds))  # cost at speed 1
    owner = np.empty(len(lengths), dtype=np.int64)
    per_token_c = c / caps
    for i in order:
        finish = (load + costs[i] + per_token_c * lengths[i]) / speeds
        finish[caps < lengths[i]] = np.inf
        r = int(np.argmin(finish))
        owner[i] = r
        load[r] += costs[i] + per_token_c[r] * lengths[i]
    return owner, float((load / speeds).max())


def _fill_empty(owner: np.ndarray, lengths: np.ndarray, caps: np.ndarray, replicas: int) -> np.ndarray:
    """An empty replica takes the shortest document it can hold from the replica with the most documents;
    one whose cap none of them fits stays empty (it then runs one empty micro-batch)."""
    owner = owner.copy()
    for r in range(replicas):
        if (owner == r).any():
            continue
        counts = np.bincount(owner, minlength=replicas)
        donors = np.flatnonzero((counts[owner] > 1) & (lengths <= caps[r]))
        if donors.size:
            owner[donors[np.argmin(lengths[donors])]] = r
    return owner


def assign_replicas(
    lengths: Sequence[int],
    cost: DocCost,
    speeds: Sequence[float],
    caps: Sequence[int],
    *,
    seed: int = 0,
    tries: int = 16,
) -> np.ndarray:
    """Stage 1: the replica of each document, minimizing the slowest replica's predicted time (longest
    first, then `tries` random orders from `seed`; the same inputs give the same answer). int64 [n]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, speeds, caps)
    speeds_, caps_ = np.asarray(speeds, dtype=np.float64), np.asarray(caps, dtype=np.int64)
    costs = cost.docs(lengths)
    # Documents that fit only the largest caps go first, then the costliest (LPT).
    fits = (lengths[:, None] <= caps_[None, :]).sum(axis=1)
    best_owner, best = _greedy_assign(np.lexsort((-costs, fits)), costs, lengths, speeds_, caps_, cost.c)
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        order = np.lexsort((rng.permutation(len(lengths)), fits))  # random within each fit class
        owner, slowest = _greedy_assign(order, costs, lengths, speeds_, caps_, cost.c)
        if slowest < best:
            best_owner, best = owner, slowest
    return _fill_empty(best_owner, lengths, caps_, len(speeds))


def _lpt_bins(costs: np.ndarray, lengths: np.ndarray, cap: int, bins: int) -> list[list[int]] | None:
    """Longest-processing-time packing into `bins` micro-batches under `cap` tokens each: every document
    (costliest first) to the cheapest micro-batch with room. None when some document finds no room."""
    load, room = np.zeros(bins), np.full(bins, cap, dtype=np.int64)
    packed: list[list[int]] = [[] for _ in range(bins)]
    for i in np.lexsort((-lengths, -costs)):
        candidates = np.flatnonzero(room >= lengths[i])
        if candidates.size == 0:
            return None
        b = int(candidates[np.argmin(load[candidates])])
        packed[b].append(int(i))
        load[b] += costs[i]
        room[b] -= lengths[i]
    return packed


def _even_out(
    packed: list[list[int]], costs: np.ndarray, lengths: np.ndarray, cap: int, rounds: int = 64
) -> None:
    """Local search after LPT, in place: move a document out of the costliest micro-batch, or swap it for a
    cheaper one, whenever that lowers the costliest of the two under the cap (the pipeline's slowest
    micro-batch; the sum stays the same)."""
    for _ in range(rounds):
        load = [float(costs[mb].sum()) for mb in packed]
        used = [int(lengths[mb].sum()) for mb in packed]
        top = int(np.argmax(load))
        best = None  # (new max of the pair, other bin, document out, document in or None)
        for other in range(len(packed)):
            if other == top:
                continue
            for d in packed[top]:
                if used[other] + lengths[d] <= cap:
                    pair = max(load[top] - costs[d], load[other] + costs[d])
                    if pair < load[top] - 1e-12 and (best is None or pair < best[0]):
                        best = (pair, other, d, None)
                for e in packed[other]:
                    if costs[e] >= costs[d] or used[other] - lengths[e] + lengths[d] > cap:
                        continue
                    if used[top] - lengths[d] + lengths[e] > cap:
                        continue
                    pair = max(load[top] - costs[d] + costs[e], load[other] + costs[d] - costs[e])
                    if pair < load[top] - 1e-12 and (best is None or pair < best[0]):
                        best = (pair, other, d, e)
        if best is None:
            return
        _, other, d, e = best
        packed[top].remove(d)
        packed[other].append(d)
        if e is not None:
            packed[other].remove(e)
            packed[top].append(e)


def pack_micro_batches(
    lengths: Sequence[int], cost: DocCost, cap: int, pp: int = 1, extra_bins: int = 4
) -> list[list[int]]:
    """Stage 2: one replica's documents (indices into `lengths`) in micro-batches of at most `cap` tokens,
    minimizing sum(cost + c) + (PP - 1) x max(cost + c) over the number of micro-batches (from the fewest
    that hold them up to `extra_bins` more). Micro-batches run costliest first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return []
    if lengths.max() > cap:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds the token cap {cap}")
    costs = cost.docs(lengths)
    fewest = max(1, -(-int(lengths.sum()) // cap))
    best, best_time = None, math.inf
    bins = fewest
    while bins <= min(len(lengths), fewest + extra_bins) or best is None:
        packed = _lpt_bins(costs, lengths, cap, bins)
        if packed is not None:
            packed = [mb for mb in packed if mb]
            _even_out(packed, costs, lengths, cap)
            mb_costs = [float(costs[mb].sum()) + cost.c for mb in packed]
            time = pipeline_time(mb_costs, pp)
            if time < best_time - 1e-12 * abs(time):
                best, best_time = packed, time
        bins += 1
    order = np.argsort([-float(costs[mb].sum()) for mb in best], kind="stable")
    return [sorted(best[k]) for k in order]


def _plan_from_owner(
    owner: np.ndarray, lengths: np.ndarray, cost: DocCost, caps: Sequence[int], pp: int
) -> BatchPlan:
    replicas = []
    for r, cap in enumerate(caps):
        mine = np.flatnonzero(owner == r)
        packed = pack_micro_batches(lengths[mine], cost, cap, pp) or [[]]  # none it can hold: one empty
        replicas.append(tuple(tuple(int(mine[i]) for i in mb) for mb in packed))
    return BatchPlan(tuple(replicas))


def cost_balanced_plan(
    lengths: Sequence[int],
    cost: DocCost,
    speeds: Sequence[float],
    caps: Sequence[int],
    pp: int = 1,
    *,
    seed: int = 0,
    tries: int = 16,
) -> BatchPlan:
    """This issue's plan: stage 1 by predicted cost over measured speed, stage 2 by the replica's 1F1B time.
    Every replica runs at least one micro-batch: an empty one (no document) when its cap fits none."""
    lengths = np.asarray(lengths, dtype=np.int64)
    owner = assign_replicas(lengths, cost, speeds, caps, seed=seed, tries=tries)
    return _plan_from_owner(owner, lengths, cost, caps, pp)


def _check_fits(lengths: np.ndarray, cap: int) -> None:
    if lengths.size and lengths.max() > cap:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds the token cap {cap}")


def karmarkar_karp(values: Sequence[float], parts: int) -> list[list[int]]:
    """Largest differencing method into `parts` sets of near-equal sums (indices into `values`), as verl's
    seqlen_balancing; every set non-empty when there are at least `parts` values."""
    if parts < 1 or len(values) < parts:
        raise ValueError(f"{len(values)} values cannot fill {parts} parts")
    # A heap entry: (-spread, tie, sums sorted descending, sets in the same order).
    heap = []
    for i, v in enumerate(values):
        sums = [float(v)] + [0.0] * (parts - 1)
        sets = [[i]] + [[] for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(v), i, sums, sets))
    tie = len(values)
    while len(heap) > 1:
        _, _, sums_a, sets_a = heapq.heappop(heap)
        _, _, sums_b, sets_b = heapq.heappop(heap)
        # Largest with smallest: the differences cancel.
        merged = sorted(
            ((sums_a[k] + sums_b[parts - 1 - k], sets_a[k] + sets_b[parts - 1 - k]) for k in range(parts)),
            key=lambda pair: -pair[0],
        )
        sums, sets = [m[0] for m in merged], [m[1] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, sets))
        tie += 1
    return [sorted(s) for s in heap[0][3]]


def token_balanced_plan(lengths: Sequence[int], dp: int, cap: int) -> BatchPlan:
    """The verl baseline: Karmarkar-Karp on token counts over the replicas, then over the fewest micro-batches
    of at most `cap` tokens (one more while a part overflows); blind to cost and speed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_fits(lengths, cap)
    replicas = []
    for part in karmarkar_karp(lengths.tolist(), dp):
        mine = lengths[part]
        bins = max(1, -(-int(mine.sum()) // cap))
        while True:
            packed = karmarkar_karp(mine.tolist(), min(bins, len(part)))
            if all(mine[mb].sum() <= cap for mb in packed):
                break
            bins += 1
        replicas.append(tuple(tuple(part[i] for i in mb) for mb in packed))
    return BatchPlan(tuple(replicas))


def round_robin_plan(lengths: Sequence[int], dp: int, cap: int) -> BatchPlan:
    """Documents dealt to replicas in order (i -> i mod D), each replica packing them in order, a new
    micro-batch when the next document does not fit: what packing without balancing gives."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_fits(lengths, cap)
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} documents cannot give each of {dp} replicas one")
    replicas = []
    for r in range(dp):
        packed: list[list[int]] = []
        used = cap
        for i in range(r, len(lengths), dp):
            if used + lengths[i] > cap:
                packed.append([])
                used = 0
            packed[-1].append(i)
            used += int(lengths[i])
        replicas.append(tuple(tuple(mb) for mb in packed))
    return BatchPlan(tuple(replicas))
