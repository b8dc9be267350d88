"""Documents of one packed micro-batch -> context-parallel ranks: each document whole on one rank, or cut
into query slices spread over several, by cost and by each rank's speed. Pure and deterministic.

Role: policy (issue 45: long documents across devices; DCP and Hydraulis place work per document, not
per fixed sequence; megahet adds the rank's speed).

A document's causal attention makes its tokens unequal: query token q attends to the q + 1 keys before
it, so the cost of the query slice [q0, q1) of a document is `a (q1^2 - q0^2) + b (q1 - q0)` under the
packing cost model `DocCost` (a s^2 + b s for the whole document: the same a and b). A rank that holds
a slice needs the keys and values of every earlier token of the document; those another rank holds
cross ranks (`kv_seconds` per token, the exchange's cost). A rank's predicted time is the cost of its
slices over its speed, plus its received tokens' exchange.

Planners, each from the same documents (benchmarks/long_context.py compares them):
- `static_cp_plan`: every document cut head-tail into 2 cp chunks, rank r keeping chunks r and
  2 cp - 1 - r (megatron-core's `get_batch_on_this_cp_rank`, torchtitan's load-balanced SDPA split):
  even work for equal ranks, and every document's K/V crosses every rank;
- `power_of_two_plan`: megatron-core's hybrid CP rule: a document gets the next power of two of
  ceil(s / cap) ranks (one if it fits the cap), head-tail over the least-loaded ones;
- `block_plan`: DCP-style, every document in blocks of `block` tokens, each block (heaviest first) on
  the rank that would finish it first;
- `dynamic_cp_plan`: longest-first, each document goes whole to the rank that would finish it first
  (if it fits), or is cut into blocks spread by speed when that finishes the step sooner, counting the
  exchange (no step ends before its perfectly even split: a whole document that ends by then is no
  slower): short documents stay whole with no communication, long ones spread.

    plan = dynamic_cp_plan(lengths, cost, speeds=(1.0, 0.5), cap=4096, block=512, kv_seconds=2e-7)
    plan.slices_of(0)                          # rank 0's (document, start, stop) query slices
    cp_times(plan, cost, speeds, kv_seconds)   # predicted seconds per rank
    plan.kv_tokens()                           # K/V tokens each rank receives
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from megahet.policy.packing import DocCost


@dataclasses.dataclass(frozen=True, order=True)
class Slice:
    """The query tokens [start, stop) of document `doc`, computed on CP rank `rank`."""

    doc: int
    start: int
    stop: int
    rank: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class CPPlan:
    """Where every query token of one micro-batch's documents is computed. `slices` are sorted by
    document and start, and cover each document [0, length) exactly once."""

    cp: int
    lengths: tuple[int, ...]
    slices: tuple[Slice, ...]

    def slices_of(self, rank: int) -> list[Slice]:
        return [s for s in self.slices if s.rank == rank]

    def tokens(self) -> list[int]:
        """Query tokens per rank (its activation memory)."""
        out = [0] * self.cp
        for s in self.slices:
            out[s.rank] += s.tokens
        return out

    def kv_tokens(self) -> list[int]:
        """K/V tokens each rank receives: of every document it holds a slice of, the earlier tokens (up to
        its last slice's end) that other ranks hold."""
        out = [0] * self.cp
        by_doc: dict[int, list[Slice]] = {}
        for s in self.slices:
            by_doc.setdefault(s.doc, []).append(s)
        for pieces in by_doc.values():
            for rank, tokens in _received(pieces).items():
                out[rank] += tokens
        return out

    def whole(self) -> list[bool]:
        """Per document: computed on one rank (no exchange)."""
        ranks: dict[int, set[int]] = {}
        for s in self.slices:
            ranks.setdefault(s.doc, set()).add(s.rank)
        return [len(ranks.get(d, ())) == 1 for d in range(len(self.lengths))]


def _received(pieces: Sequence[Slice]) -> dict[int, int]:
    """Per rank holding one of a document's `pieces` (ranks in order): the document's earlier tokens, up to
    its last piece's end, that other ranks hold."""
    out = {}
    for rank in sorted({s.rank for s in pieces}):
        end = max(s.stop for s in pieces if s.rank == rank)
        out[rank] = sum(min(s.stop, end) - s.start for s in pieces if s.rank != rank and s.start < end)
    return out


def slice_cost(cost: DocCost, start: int, stop: int) -> float:
    """Seconds (at speed 1) of the query slice [start, stop) of a document under causal attention."""
    return cost.a * (stop * stop - start * start) + cost.b * (stop - start)


def cp_times(plan: CPPlan, cost: DocCost, speeds: Sequence[float], kv_seconds: float = 0.0) -> list[float]:
    """Each rank's predicted seconds: its slices' cost over its speed, plus its received K/V tokens'."""
    work = [0.0] * plan.cp
    for s in plan.slices:
        work[s.rank] += slice_cost(cost, s.start, s.stop)
    return [w / v + k * kv_seconds for w, v, k in zip(work, speeds, plan.kv_tokens(), strict=True)]


def _check(lengths: Sequence[int], speeds: Sequence[float], cap: int | None) -> None:
    if not speeds or any(not math.isfinite(v) or v <= 0 for v in speeds):
        raise ValueError(f"CP rank speeds must be positive, got {list(speeds)}")
    if any(n <= 0 for n in lengths):
        raise ValueError(f"document lengths must be positive, got {list(lengths)}")
    if cap is not None and sum(lengths) > cap * len(speeds):
        raise ValueError(f"{sum(lengths)} tokens do not fit {len(speeds)} CP ranks of {cap}: raise the cap")


def _plan(cp: int, lengths: Sequence[int], slices: list[Slice]) -> CPPlan:
    return CPPlan(cp, tuple(int(n) for n in lengths), tuple(sorted(s for s in slices if s.tokens > 0)))


def _head_tail(doc: int, length: int, ranks: Sequence[int]) -> list[Slice]:
    """Document `doc` cut into 2k chunks (k = len(ranks)), the i-th rank keeping chunks i and 2k - 1 - i."""
    k = len(ranks)
    bounds = [length * i // (2 * k) for i in range(2 * k + 1)]
    return [Slice(doc, bounds[c], bounds[c + 1], ranks[min(c, 2 * k - 1 - c)]) for c in range(2 * k)]


def static_cp_plan(lengths: Sequence[int], cp: int) -> CPPlan:
    """Every document head-tail over all cp ranks."""
    _check(lengths, [1.0] * cp, None)
    return _plan(cp, lengths, [s for d, n in enumerate(lengths) for s in _head_tail(d, n, range(cp))])


class _Loads:
    """Predicted seconds and query tokens per rank while a plan is built."""

    def __init__(self, cost: DocCost, speeds: Sequence[float], cap: int | None, kv_seconds: float):
        self.cost, self.speeds, self.cap, self.kv_seconds = cost, list(speeds), cap, kv_seconds
        self.seconds = [0.0] * len(speeds)
        self.tokens = [0] * len(speeds)

    def finish(self, rank: int, start: int, stop: int, received: int = 0) -> float:
        return (
            self.seconds[rank]
            + slice_cost(self.cost, start, stop) / self.speeds[rank]
            + received * self.kv_seconds
        )

    def fits(self, rank: int, tokens: int) -> bool:
        return self.cap is None or self.tokens[rank] + tokens <= self.cap

    def add(self, s: Slice, received: int = 0) -> None:
        self.seconds[s.rank] = self.finish(s.rank, s.start, s.stop, received)
        self.tokens[s.rank] += s.tokens

    def order(self) -> list[int]:
        """Ranks, least loaded first (ties: lower rank)."""
        return sorted(range(len(self.speeds)), key=lambda r: (self.seconds[r], r))


def _longest_first(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))


def power_of_two_plan(
    lengths: Sequence[int], cp: int, cap: int, cost: DocCost, speeds: Sequence[float] | None = None
) -> CPPlan:
    """megatron-core's hybrid CP: a document of s tokens over the next power of two of ceil(s / cap) ranks
    (at most cp), head-tail over the least-loaded ones, longest first."""
    speeds = list(speeds or [1.0] * cp)
    _check(lengths, speeds, None)  # the cap sets a document's ranks here, not a memory bound
    loads, slices = _Loads(cost, speeds, None, 0.0), []
    for d in _longest_first(lengths):
        k = min(1 << max(math.ceil(lengths[d] / cap) - 1, 0).bit_length(), cp)
        ranks = sorted(loads.order()[:k])
        for s in _head_tail(d, lengths[d], ranks):
            loads.add(s)
            slices.append(s)
    return _plan(cp, lengths, slices)


def _blocks(length: int, block: int) -> list[tuple[int, int]]:
    return [(b, min(b + block, length)) for b in range(0, length, block)]


def _spread(d: int, length: int, block: int, loads: _Loads) -> tuple[list[tuple[Slice, int]], float]:
    """Document d's blocks, heaviest (last) first, each on the rank that would finish it first (among those
    it fits), each rank then charged the earlier tokens other ranks hold. Returns the slices with their
    received tokens (charged with each rank's first slice), and the resulting slowest finish; `loads` is
    left unchanged."""
    seconds, tokens = list(loads.seconds), list(loads.tokens)
    placed: list[Slice] = []
    for start, stop in reversed(_blocks(length, block)):
        options = [r for r in range(len(loads.speeds)) if loads.fits(r, stop - start)] or [loads.order()[0]]
        rank = min(options, key=lambda r: (loads.finish(r, start, stop), r))
        placed.append(Slice(d, start, stop, rank))
        loads.add(placed[-1])
    result = []
    for rank, received in _received(placed).items():
        loads.seconds[rank] += received * loads.kv_seconds
        mine = [s for s in placed if s.rank == rank]
        result += [(s, received if i == 0 else 0) for i, s in enumerate(mine)]
    worst = max(loads.seconds)
    loads.seconds, loads.tokens = seconds, tokens
    return result, worst


def block_plan(
    lengths: Sequence[int], cost: DocCost, speeds: Sequence[float], cap: int | None = None, block: int = 512,
    kv_seconds: float = 0.0,
) -> CPPlan:  # fmt: skip
    """DCP-style: every document in blocks of `block` tokens, each on the rank that would finish it first."""
    _check(lengths, speeds, cap)
    loads, slices = _Loads(cost, speeds, cap, kv_seconds), []
    for d in _longest_first(lengths):
        placed, _ = _spread(d, lengths[d], block, loads)
        for s, received in placed:
            loads.add(s, received)
            slices.append(s)
    return _plan(len(speeds), lengths, slices)


def dynamic_cp_plan(
    lengths: Sequence[int], cost: DocCost, speeds: Sequence[float], cap: int | None = None, block: int = 512,
    kv_seconds: float = 0.0,
) -> CPPlan:  # fmt: skip
    """Longest first: each document whole on the rank that would finish it first, unless spreading its
    blocks by speed (`block_plan`'s rule, exchange counted) finishes the step sooner, or it fits no
    rank's remaining cap. Deterministic: the same documents and speeds give the same plan."""
    _check(lengths, speeds, cap)
    loads, slices = _Loads(cost, speeds, cap, kv_seconds), []
    ideal = sum(slice_cost(cost, 0, n) for n in lengths) / sum(speeds)  # the step's end, perfectly even
    for d in _longest_first(lengths):
        n = lengths[d]
        fitting = [r for r in range(len(speeds)) if loads.fits(r, n)]
        whole = min(fitting, key=lambda r: (loads.finish(r, 0, n), r)) if fitting else None
        spread, spread_worst = _spread(d, n, block, loads)
        if whole is not None:
            whole_worst = max(
                loads.finish(r, 0, n) if r == whole else loads.seconds[r] for r in range(len(speeds))
            )
            # no slower whole (the step cannot end before `ideal`, whichever way this one goes): no
            # exchange, fewer launches
            if max(whole_worst, ideal) <= max(spread_worst, ideal):
                s = Slice(d, 0, n, whole)
                loads.add(s)
                slices.append(s)
                continue
        for s, received in spread:
            loads.add(s, received)
            slices.append(s)
    return _plan(len(speeds), lengths, slices)
