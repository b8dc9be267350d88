"""Packed documents placed over CP ranks by a plan (megahet/models/cp_placed.py, issue 45): the layout's index
arithmetic on the host, and placed attention on 2 and 4 spawned gloo ranks against causal attention inside
each whole document, forward and backward, multi-head and grouped-query, for every planner's plans (dynamic
by speed, DCP-style blocks, static head-tail: a placement is exact whatever it is).

Run: ``python -m pytest tests/unit/test_cp_placed.py -q`` (about 15 s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from cp_groups import on_cp4_and_cp2

from megahet.launch import free_port
from megahet.models.cp_placed import PlacedLayout, placed_attention, placed_batch_on_this_cp_rank
from megahet.policy.cp_placement import CPPlan, Slice, block_plan, dynamic_cp_plan, static_cp_plan
from megahet.policy.packing import DocCost

NP, HN = 4, 8  # query heads, head dim
LENGTHS = [37, 5, 64, 12, 3, 29]
COST = DocCost(a=1e-8, b=1e-6, c=0.0)


def _sdpa(q, k, v, mask, dropout, causal, gqa):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, enable_gqa=gqa
    )


def plans(cp: int) -> dict[str, CPPlan]:
    """Every planner's plan of LENGTHS at CP `cp`, blocks small enough that long documents spread."""
    slow = [1.0] * (cp - 1) + [0.5]
    return {
        "dynamic": dynamic_cp_plan(LENGTHS, COST, slow, block=8),
        "dynamic equal": dynamic_cp_plan(LENGTHS, COST, [1.0] * cp, block=16),
        "blocks": block_plan(LENGTHS, COST, slow, block=8),
        "static": static_cp_plan(LENGTHS, cp),
    }


def _reference(q, k, v, lengths, gqa: bool) -> torch.Tensor:
    """Causal attention inside each document of the packed (t, heads, hn) tensors -> (t, np, hn)."""
    pieces = [
        _sdpa(*(x.permute(1, 0, 2)[None] for x in (qd, kd, vd)), None, 0.0, True, gqa)[0].permute(1, 0, 2)
        for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    return torch.cat(pieces)


def _check(group, plan: CPPlan, ng: int) -> None:
    rank = dist.get_rank(group)
    t = sum(plan.lengths)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, h, HN, generator=gen, dtype=torch.float64) for h in (NP, ng, ng))  # (t, h, hn)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grad_out = torch.randn(t, NP, HN, generator=gen, dtype=torch.float64)
    full = _reference(q, k, v, list(plan.lengths), ng != NP)  # (t, np, hn)
    full.backward(grad_out)

    layout = PlacedLayout(plan)
    mine = torch.from_numpy(layout.local_positions(rank))  # (t_r,)
    lq, lk, lv = (x.detach()[mine].clone().requires_grad_() for x in (q, k, v))
    out = placed_attention(lq, lk, lv, layout.on_rank(rank, group, lq.device), _sdpa)  # (t_r, np, hn)
    out.backward(grad_out[mine])
    torch.testing.assert_close(out, full.detach()[mine], rtol=1e-10, atol=1e-10)
    for local, whole in ((lq, q), (lk, k), (lv, v)):
        torch.testing.assert_close(local.grad, whole.grad[mine], rtol=1e-10, atol=1e-10)


def _checks(group) -> None:
    """Every planner's plan at this group's CP size, multi-head and grouped-query; the batch split."""
    for plan in plans(dist.get_world_size(group)).values():
        for ng in (NP, 2):
            _check(group, plan, ng)
    _check_batch(group)


def _check_batch(group) -> None:
    """The batch split: each rank's tokens, labels, mask and positions are those of its slices."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = plans(cp)["dynamic"]
    t = sum(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # (1, t)
    batch = {
        "tokens": torch.arange(t)[None],
        "labels": torch.arange(t)[None] + 1,
        "loss_mask": torch.ones(1, t),
    }
    local = placed_batch_on_this_cp_rank(
        {**batch, "position_ids": positions, "doc_lengths": LENGTHS}, plan, group
    )
    mine = torch.from_numpy(PlacedLayout(plan).local_positions(rank))
    assert torch.equal(local["tokens"][0], mine) and torch.equal(local["labels"][0], mine + 1)
    expected = torch.cat([torch.arange(s.start, s.stop) for s in plan.slices_of(rank)])
    assert torch.equal(local["position_ids"][0], expected)
    assert local["placement"].recv_splits == tuple(
        len(PlacedLayout(plan).sends(src, rank)) for src in range(cp)
    )


def test_placed_attention_equals_attention_inside_each_whole_document() -> None:
    """At CP 4 and CP 2, for dynamic (by speed and equal), block and static plans, MHA and GQA."""
    mp.spawn(on_cp4_and_cp2, args=(4, free_port(), _checks), nprocs=4, join=True)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["dynamic", "dynamic equal", "blocks", "static"])
def test_every_token_is_held_once_and_each_rank_receives_what_the_plan_counts(cp: int, name: str) -> None:
    plan = plans(cp)[name]
    layout = PlacedLayout(plan)
    held = np.concatenate([layout.local_positions(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(sum(LENGTHS)))
    received = [sum(len(layout.sends(src, dst)) for src in range(cp)) for dst in range(cp)]
    assert received == plan.kv_tokens()
    for rank in range(cp):  # its keys: its own tokens where it holds them, then what it receives, in order
        keys = layout.key_positions(rank)
        local = layout.local_positions(rank)
        pool = np.concatenate(
            [local, *(layout.local_positions(src)[layout.sends(src, rank)] for src in range(cp))]
        )
        assert np.array_equal(pool[layout.key_index(rank)], keys)


def test_a_rank_with_whole_documents_only_exchanges_nothing() -> None:
    plan = CPPlan(2, (4, 6), (Slice(0, 0, 4, 0), Slice(1, 0, 6, 1)))
    layout = PlacedLayout(plan)
    assert not layout.on_rank(0, None, torch.device("cpu")).moves
    assert layout.spans(1) == [((0, 6), [(0, 6, True)])]
    spread = CPPlan(2, (8,), (Slice(0, 0, 3, 1), Slice(0, 3, 8, 0)))
    assert PlacedLayout(spread).spans(0) == [((0, 5), [(0, 3, False), (3, 8, True)])]
    assert PlacedLayout(spread).on_rank(0, None, torch.device("cpu")).recv_splits == (0, 3)
