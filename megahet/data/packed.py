"""Packed micro-batches of whole documents for one data-parallel replica, planned per global batch.

Role: data (issue 28; executes the plan of the pure `megahet.policy.packing`).

Global batch g takes the next documents (pieces, megahet/data/documents.py) of the per-epoch shuffled
order: `documents_per_batch` of them, or as many as fit in `tokens_per_batch` tokens (at least one per
replica). Every rank plans the same global batch from the same inputs (the documents' lengths, the
cost model, the replicas' speeds, a seed derived from the step), so the plan is the same everywhere
without a collective: replica r runs its micro-batches, every document is used exactly once, and the
stream is a function of the step (a resumed run continues exactly).

A micro-batch is one row of concatenated documents (b = 1, t = their tokens) with positions restarting
at 0 in each, `cu_seqlens` at their boundaries and the lengths on the host (`doc_lengths`):

    stream = PackedStream(pieces, dp_rank=0, dp_size=2, documents_per_batch=32, cap=2048, seed=1234)
    # cap=(4096, 2048): replica 1 (less memory) takes micro-batches of at most 2048 tokens
    step = stream.begin_step()      # plans the next global batch: step.counts[r] micro-batches on replica r
    batch = next(stream)            # tokens/labels/position_ids int64 [1, t], loss_mask float [1, t], cu_seqlens int32 [k+1]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from megahet.data.documents import DocumentPieces
from megahet.data.sampling import sample_order
from megahet.policy.packing import (
    BatchPlan,
    DocCost,
    cost_balanced_plan,
    micro_batch_bound,
    micro_batch_costs,
    pipeline_time,
    round_robin_plan,
    token_balanced_plan,
)

STRATEGIES = ("cost", "tokens", "round_robin")

DEFAULT_COST = DocCost(a=1.0 / 8192, b=1.0, c=16.0)
"""Before any measurement: attention as costly as the rest at 8192 tokens per document, and a micro-batch's
fixed cost as 16 tokens' (relative units; the start-up profile replaces it)."""


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One global batch's plan, the same on every rank."""

    step: int
    documents: np.ndarray
    """Piece index (into the DocumentPieces) of each of the global batch's documents, int64 [n]."""
    lengths: np.ndarray
    """Their positions, int64 [n]."""
    starts: np.ndarray
    """Their first tokens in the split's token stream, int64 [n]."""
    plan: BatchPlan
    """Indices into `documents` per replica and micro-batch."""
    cost: DocCost

    @property
    def counts(self) -> tuple[int, ...]:
        """Micro-batches per replica."""
        return self.plan.num_micro_batches()

    @property
    def tokens(self) -> int:
        """Positions with a label over the whole global batch (every one counts in the loss)."""
        return int(self.lengths.sum())

    @functools.cached_property
    def micro_batch_costs(self) -> list[list[float]]:
        """Predicted cost at speed 1 of every replica's micro-batches (computed once per plan: the trainer,
        the balancer and the telemetry all read it)."""
        return [micro_batch_costs(mbs, self.lengths, self.cost) for mbs in self.plan.replicas]

    def replica_work(self, pp: int = 1) -> list[float]:
        """Each replica's predicted step time at speed 1: its 1F1B time of micro-batch costs, each stage
        running 1 / PP of every micro-batch."""
        return [pipeline_time(costs, pp) / pp for costs in self.micro_batch_costs]

    def micro_batch_spread(self) -> float:
        """Slowest over mean predicted micro-batch cost, over every replica's micro-batches."""
        costs = [c for replica in self.micro_batch_costs for c in replica]
        return max(costs) / (sum(costs) / len(costs))

    def micro_batch_bound(self) -> float:
        """The least slowest / mean micro-batch any packing could reach here (`policy.packing.micro_batch_bound`)."""
        return micro_batch_bound(
            [c for replica in self.micro_batch_costs for c in replica], self.lengths, self.cost
        )

    def padding_fraction(self, caps: Sequence[int]) -> float:
        """The share of the micro-batches' token capacity (replica r's `caps[r]` each) left empty: what
        padding to the cap would waste (packed micro-batches run unpadded here)."""
        return 1.0 - self.tokens / sum(n * cap for n, cap in zip(self.counts, caps, strict=True))

    def replica_stats(self) -> list[dict[str, float]]:
        """Per replica: tokens, sum of s^2 and micro-batches (telemetry)."""
        out = []
        for mbs in self.plan.replicas:
            s = self.lengths[[i for mb in mbs for i in mb]].astype(np.float64)
            out.append(
                {"tokens": float(s.sum()), "sum_sq": float((s * s).sum()), "micro_batches": float(len(mbs))}
            )
        return out


def collate_documents(pieces: DocumentPieces, indices: Sequence[int]) -> dict:
    """One packed micro-batch of these pieces, in order."""
    return collate_spans(pieces, [(int(pieces.starts[i]), int(pieces.lengths[i])) for i in indices])


def collate_spans(pieces: DocumentPieces, spans: Sequence[tuple[int, int]]) -> dict:
    """One packed micro-batch of these (first token, positions) spans of the split, in order. No spans: one
    masked token (a replica whose cap no document of the global batch fits still runs a micro-batch, so
    that its gradients join the reduction; it adds no loss and no token)."""
    if not spans:
        batch = collate_spans(pieces, [(0, 1)])
        batch["loss_mask"].zero_()
        return batch
    reads = [pieces.read_span(start, length) for start, length in spans]
    lengths = [len(x) for x, _ in reads]
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    tokens = torch.from_numpy(np.concatenate([x for x, _ in reads]))[None]  # (1, t)
    return {
        "tokens": tokens,
        "labels": torch.from_numpy(np.concatenate([y for _, y in reads]))[None],  # (1, t)
        "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),  # (1, t)
        "position_ids": torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None],  # (1, t)
        "cu_seqlens": torch.from_numpy(cu),  # (k + 1,)
        "doc_lengths": lengths,  # host ints: attention splits and counts with them
    }


class PackedStream:
    """This replica's packed micro-batches, global batch after global batch (see the module docstring)."""

    def __init__(
        self,
        pieces: DocumentPieces,
        *,
        dp_rank: int,
        dp_size: int,
        cap: int | Sequence[int],
        documents_per_batch: int | None = None,
        tokens_per_batch: int | None = None,
        pp: int = 1,
        seed: int = 1234,
        shuffle: bool = True,
        start_step: int = 0,
        strategy: str = "cost",
        tries: int = 16,
        cost: DocCost = DEFAULT_COST,
    ):
        if (documents_per_batch is None) == (tokens_per_batch is None):
            raise ValueError("give the global batch in documents or in tokens, not both")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown packing strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
        caps = tuple(cap) if isinstance(cap, Sequence) else (cap,) * dp_size
        if len(caps) != dp_size:
            raise ValueError(f"need one token cap per replica ({dp_size}), got {list(caps)}")
        if int(pieces.lengths.max()) > max(caps):
            raise ValueError(
                f"pieces of up to {int(pieces.lengths.max())} tokens exceed the token cap {max(caps)}"
            )
        self.pieces, self.dp_rank, self.dp_size, self.caps, self.pp = pieces, dp_rank, dp_size, caps, pp
        self.documents_per_batch, self.tokens_per_batch = documents_per_batch, tokens_per_batch
        self.seed, self.shuffle, self.strategy, self.tries = seed, shuffle, strategy, tries
        self.cost = cost
        self.speeds: tuple[float, ...] = (1.0,) * dp_size
        self.step = start_step
        """The next global batch to plan."""
        self.current: StepPlan | None = None
        self._queue: list[tuple[int, ...]] = []
        self._starts = [0]  # first document position of global batch g (token-sized batches walk forward)
        self._orders: dict[int, np.ndarray] = {}

    def set_speeds(self, speeds: Sequence[float]) -> None:
        """Replica speeds (fastest = 1) for the plans of the next global batches."""
        if len(speeds) != self.dp_size:
            raise ValueError(f"need {self.dp_size} replica speeds, got {list(speeds)}")
        self.speeds = tuple(float(s) for s in speeds)

    def set_cost(self, cost: DocCost) -> None:
        self.cost = cost

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.pieces)
            self._orders = {epoch: sample_order(n, epoch, self.seed if self.shuffle else None)}
        return self._orders[epoch]

    def _take(self, start: int, count: int) -> np.ndarray:
        """Pieces at positions [start, start + count) of the endless epoch-by-epoch order."""
        n = len(self.pieces)
        positions = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            out[mask] = self._order(int(epoch))[positions[mask] % n]
        return out

    def _batch_bounds(self, step: int) -> tuple[int, int]:
        if self.documents_per_batch is not None:
            return step * self.documents_per_batch, (step + 1) * self.documents_per_batch
        while len(self._starts) <= step + 1:
            start = self._starts[-1]
            window = max(self.dp_size, 2 * self.tokens_per_batch // max(1, int(self.pieces.lengths.min())))
            window = min(window, 4 * len(self.pieces))
            lengths = self.pieces.lengths[self._take(start, window)]
            fit = int(np.searchsorted(np.cumsum(lengths), self.tokens_per_batch, side="right"))
            self._starts.append(start + max(fit, self.dp_size))
        return self._starts[step], self._starts[step + 1]

    def plan(self, step: int) -> StepPlan:
        """The plan of global batch `step` (pure in the stream's settings: every rank gets the same one)."""
        start, end = self._batch_bounds(step)
        documents = self._take(start, end - start)
        starts = self.pieces.starts[documents].astype(np.int64)
        lengths = self.pieces.lengths[documents].astype(np.int64)
        if self.strategy == "cost":
            plan = cost_balanced_plan(
                lengths, self.cost, self.speeds, self.caps, self.pp, seed=(self.seed * 1_000_003 + step) % 2**32,
                tries=self.tries,
            )  # fmt: skip
        elif self.strategy == "tokens":
            plan = token_balanced_plan(lengths, self.dp_size, min(self.caps))
        else:
            plan = round_robin_plan(lengths, self.dp_size, min(self.caps))
        return StepPlan(step, documents, lengths, starts, plan, self.cost)

    def seek(self, *, iteration: int, consumed_samples: int) -> None:
        """Go on from a resumed step: the next global batch planned is step `iteration`'s (a step's
        documents are a function of the step; `consumed_samples` is unused here)."""
        self.step, self.current, self._queue = iteration, None, []

    def begin_step(self) -> StepPlan:
        """Plan the next global batch; this replica's micro-batches of it follow from `next()`."""
        if self._queue:
            raise RuntimeError(f"{len(self._queue)} micro-batches of step {self.step - 1} were not consumed")
        self.current = self.plan(self.step)
        self._queue = list(self.current.plan.replicas[self.dp_rank])
        self.step += 1
        return self.current

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError(
                "the packed stream's step is used up: call begin_step() for the next global batch"
            )
        micro_batch = self._queue.pop(0)
        plan = self.current
        return collate_spans(self.pieces, [(int(plan.starts[i]), int(plan.lengths[i])) for i in micro_batch])


def packed_eval_batches(
    pieces: DocumentPieces, *, dp_rank: int, dp_size: int, cap: int, iters: int
) -> Iterator[dict]:
    """`iters` packed micro-batches for this replica from the start of a split: documents in order, a new
    micro-batch when the next does not fit, micro-batch k to replica k mod D (cycling the split)."""
    position, made = 0, 0
    n = len(pieces)
    while made < iters * dp_size:
        batch, used = [], 0
        while not batch or used + int(pieces.lengths[position % n]) <= cap:
            used += int(pieces.lengths[position % n])
            batch.append(position % n)
            position += 1
        if made % dp_size == dp_rank:
            yield collate_documents(pieces, batch)
        made += 1
