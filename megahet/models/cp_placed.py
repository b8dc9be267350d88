"""Packed documents placed by a dynamic CP plan (issue 45): each CP rank computes the query slices the plan
gives it (whole documents, or pieces of long ones) and receives only the keys and values of the earlier
tokens of its documents that other ranks hold.

Role: models (the plan is data, from megahet/policy/cp_placement.py; this is index arithmetic on the host and
the one exchange of keys and values per layer that executes it).

Static CP (cp_documents.py) pads every document to 2 x cp chunks and gathers every key on every rank. A
placement instead keeps a short document whole on one rank (no exchange, no padding) and spreads a long one;
a rank that holds the query slice [s, e) of a document needs that document's keys [0, e): its own, plus those
the other ranks hold, sent in one uneven all-to-all (`all_to_all_single` with split sizes; the backward is
the reverse all-to-all, each sent token's gradients summed back where it came from).

Megatron-core sees each rank's tokens as one sequence of batch 1 (`qkv_format` sbhd): rotary embeddings
take each token's own position in its document (megahet/models/gpt.py), attention takes the `RankPlacement`
the packed parameters carry.

    layout = PlacedLayout(plan)                            # plan: a CPPlan of the micro-batch's documents
    layout.local_positions(rank)                           # its tokens' places in the packed micro-batch
    placement = layout.on_rank(rank, group, device)        # what its attention executes, on `device`
    out = placed_attention(q, k, v, placement, sdpa, scale)   # (t, np, hn), (t, ng, hn) x2 -> (t, np, hn)
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import torch.distributed as dist

from megahet.models.block_attention import Span
from megahet.models.context_parallel import attend_spans
from megahet.policy.cp_placement import CPPlan


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """What one CP rank executes of a placement, its index tensors on its device.

    `send_index` (s,): its local tokens it sends, grouped by destination rank (`send_splits` per rank);
    `recv_splits`: tokens it receives from each rank; `key_index` (k,): index into its local tokens followed
    by the received ones that lists the keys it attends to, document after document; `spans`: its queries'
    key blocks (block_attention.py) over those keys; `moves`: whether any rank of the group exchanges
    anything (the same on every rank: every rank holds the same plan)."""

    group: object
    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    key_index: torch.Tensor
    spans: tuple[Span, ...]
    moves: bool


@dataclasses.dataclass(frozen=True)
class PlacedLayout:
    """Where each token of a packed micro-batch lives, and which keys each rank needs, under `plan`."""

    plan: CPPlan

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Each document's first token in the packed micro-batch."""
        return np.concatenate([[0], np.cumsum(self.plan.lengths)[:-1]]).astype(np.int64)

    def local_positions(self, rank: int) -> np.ndarray:
        """Places in the packed micro-batch of rank `rank`'s tokens: its slices, document after document."""
        pieces = [self.offsets[s.doc] + np.arange(s.start, s.stop) for s in self.plan.slices_of(rank)]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    @functools.cached_property
    def owners(self) -> tuple[np.ndarray, np.ndarray]:
        """Per token of the packed micro-batch: the rank holding it, and its index among that rank's tokens."""
        total = int(sum(self.plan.lengths))
        rank_of, local = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        for rank in range(self.plan.cp):
            where = self.local_positions(rank)
            rank_of[where], local[where] = rank, np.arange(len(where))
        return rank_of, local

    def key_ends(self, rank: int) -> dict[int, int]:
        """Per document rank `rank` holds a slice of (in document order): the end of its keys (its last
        slice's end: causal attention reads no later token)."""
        ends: dict[int, int] = {}
        for s in self.plan.slices_of(rank):
            ends[s.doc] = max(ends.get(s.doc, 0), s.stop)
        return dict(sorted(ends.items()))

    def key_positions(self, rank: int) -> np.ndarray:
        """Places in the packed micro-batch of the keys rank `rank` attends to, document after document."""
        pieces = [self.offsets[d] + np.arange(end) for d, end in self.key_ends(rank).items()]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def sends(self, src: int, dst: int) -> np.ndarray:
        """`src`'s local indices of the tokens `dst` needs from it, in `dst`'s key order (none to itself)."""
        if src == dst:
            return np.zeros(0, dtype=np.int64)
        rank_of, local = self.owners
        keys = self.key_positions(dst)
        return local[keys[rank_of[keys] == src]]

    def key_index(self, rank: int) -> np.ndarray:
        """Index into rank `rank`'s local tokens followed by what it receives (rank after rank) that lists its
        keys in order."""
        rank_of, local = self.owners
        keys = self.key_positions(rank)
        owner = rank_of[keys]
        index = local[keys].copy()  # its own tokens: their local index
        base = len(self.local_positions(rank))
        for src in range(self.plan.cp):
            if src != rank:
                mine = owner == src
                index[mine] = base + np.arange(int(mine.sum()))
                base += int(mine.sum())
        return index

    def spans(self, rank: int) -> list[Span]:
        """block_attention spans of rank `rank`'s queries over its keys: each slice [s, e) of a document attends
        to the document's keys [0, s) unmasked and to its own [s, e) causally."""
        key_start, start = {}, 0
        for d, end in self.key_ends(rank).items():
            key_start[d], start = start, start + end
        spans, q = [], 0
        for s in self.plan.slices_of(rank):
            k0 = key_start[s.doc]
            before = [(k0, k0 + s.start, False)] if s.start else []
            spans.append(((q, q + s.tokens), [*before, (k0 + s.start, k0 + s.stop, True)]))
            q += s.tokens
        return spans

    def on_rank(self, rank: int, group, device: torch.device) -> RankPlacement:
        """Rank `rank`'s part of the placement, its index tensors on `device`."""
        cp = self.plan.cp
        sends = [self.sends(rank, dst) for dst in range(cp)]
        recv = tuple(len(self.sends(src, rank)) for src in range(cp))
        return RankPlacement(
            group=group,
            send_index=torch.from_numpy(np.concatenate(sends)).to(device),
            send_splits=tuple(len(s) for s in sends),
            recv_splits=recv,
            key_index=torch.from_numpy(self.key_index(rank)).to(device),
            spans=tuple(self.spans(rank)),
            moves=any(self.plan.kv_tokens()),
        )


class _SendKeys(torch.autograd.Function):
    """(t, ...) local tokens -> (r, ...) the tokens received from the other ranks (one all-to-all); the
    backward sends each received token's gradient back and sums it into the token it came from."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, placement: RankPlacement) -> torch.Tensor:
        ctx.placement, ctx.tokens = placement, local.shape[0]
        send = local.index_select(0, placement.send_index).contiguous()  # (s, ...)
        received = local.new_empty((sum(placement.recv_splits), *local.shape[1:]))  # (r, ...)
        dist.all_to_all_single(
            received, send, list(placement.recv_splits), list(placement.send_splits), group=placement.group
        )
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p = ctx.placement
        back = grad.new_empty((sum(p.send_splits), *grad.shape[1:]))  # (s, ...)
        dist.all_to_all_single(
            back, grad.contiguous(), list(p.send_splits), list(p.recv_splits), group=p.group
        )
        out = grad.new_zeros((ctx.tokens, *grad.shape[1:]))  # (t, ...)
        return out.index_add_(0, p.send_index, back), None


def placed_keys(local: torch.Tensor, placement: RankPlacement) -> torch.Tensor:
    """This rank's (t, ...) tokens -> the (k, ...) keys it attends to, document after document: its own and
    those received from the other ranks."""
    if not placement.moves:  # every document whole on one rank: nothing crosses
        return local.index_select(0, placement.key_index)
    received = _SendKeys.apply(local, placement)  # (r, ...)
    return torch.cat([local, received]).index_select(0, placement.key_index)  # (k, ...)


def placed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    placement: RankPlacement,
    sdpa,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention inside each document, documents placed over the CP group by a plan: q (t, np, hn),
    k, v (t, ng, hn) this rank's tokens. Returns (t, np, hn)."""
    hn = k.shape[-1]
    keys = placed_keys(torch.cat([k, v], dim=-1), placement)  # (kt, ng, 2 hn): one exchange for both
    k_all, v_all = keys[..., :hn], keys[..., hn:]
    q4, k4, v4 = (x.permute(1, 0, 2)[None] for x in (q, k_all, v_all))  # (1, heads, tokens, hn)
    out = attend_spans(q4, k4, v4, placement.spans, sdpa, 0.0, scale)  # (1, np, t, hn)
    return out[0].permute(1, 0, 2)  # (t, np, hn)


PLACED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The (1, t) tensors of a packed micro-batch (megahet/data/packed.py) that follow its tokens."""


def placed_batch_on_this_cp_rank(batch: dict, plan: CPPlan, group) -> dict:
    """This rank's part of a packed micro-batch placed by `plan`: the tokens of its slices (1, t_r), each
    with its position in its document, and the `placement` its attention executes."""
    rank, device = dist.get_rank(group), batch["tokens"].device
    layout = PlacedLayout(plan)
    index = torch.from_numpy(layout.local_positions(rank)).to(device)  # (t_r,)
    out = {**batch, **{key: batch[key][:, index] for key in PLACED_KEYS}}  # (1, t_r) each
    out["placement"] = layout.on_rank(rank, group, device)
    return out
