"""Context-parallel attention (megahet/models/context_parallel.py, issue 45) against attention over the whole
sequence: 2 and 4 CP ranks (gloo, spawned processes), causal and unmasked, multi-head and grouped-query;
the outputs of each rank's chunks and the gradients of its queries, keys and values match the unsplit
attention's at the same tokens; and packed documents, each split over the CP ranks, against causal attention
inside each whole document. Causal attention both ways: the key blocks merged by log-sum-exp (the CPU's
choice) and SDPA with a lower-right causal bias (CUDA's, and with dropout).

Run: ``python -m pytest tests/unit/test_cp_attention.py -q`` (about 20 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from cp_groups import on_cp4_and_cp2

from megahet.launch import free_port
from megahet.models.context_parallel import (
    cp_attention,
    cp_packed_attention,
    cp_totals,
    head_tail_chunks,
    natural_order,
)
from megahet.models.cp_documents import DocumentLayout

B, NP, HN, L = 2, 4, 8, 5  # batch, query heads, head dim, tokens per chunk


def _sdpa(q, k, v, mask, dropout, causal, gqa):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, enable_gqa=gqa
    )


def _checks(group) -> None:
    """Every attention variant at this group's CP size, and the loss totals."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for ng in (NP, 2):  # multi-head, grouped-query
        _check(group, cp, ng, causal=False)
        for merge in (True, False):  # key blocks merged by log-sum-exp; SDPA, lower-right causal
            _check(group, cp, ng, causal=True, merge=merge)
    for ng in (NP, 2):
        _check_packed(group, cp, ng)
    loss_sum, tokens = cp_totals(torch.tensor(float(rank + 1)), torch.tensor(10.0), group)
    assert loss_sum.item() == cp * (cp + 1) / 2 and tokens.item() == 10.0 * cp


def _check(group, cp: int, ng: int, causal: bool, merge: bool | None = None) -> None:
    """This rank's chunks of CP attention against attention over the whole sequence, forward and backward."""
    rank = dist.get_rank(group)
    s = 2 * cp * L
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, NP, s, HN, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, ng, s, HN, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, ng, s, HN, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, NP, s, HN, generator=gen, dtype=torch.float64)
    full = _sdpa(q, k, v, None, 0.0, causal, ng != NP)  # (b, np, s, hn)
    full.backward(grad_out)

    mine = torch.cat([torch.arange(c * L, (c + 1) * L) for c in head_tail_chunks(rank, cp)])  # (2L,)
    lq, lk, lv = (x.detach()[:, :, mine].clone().requires_grad_() for x in (q, k, v))
    out = cp_attention(lq, lk, lv, group, _sdpa, causal, merge=merge)  # (b, np, 2L, hn)
    out.backward(grad_out[:, :, mine])
    torch.testing.assert_close(out, full.detach()[:, :, mine], rtol=1e-10, atol=1e-10)
    for local, whole in ((lq, q), (lk, k), (lv, v)):
        torch.testing.assert_close(local.grad, whole.grad[:, :, mine], rtol=1e-10, atol=1e-10)


def _check_packed(group, cp: int, ng: int) -> None:
    """Packed documents (padded lengths, each a multiple of 2 cp): this rank's chunks of every document
    against causal attention inside each whole document, forward and backward."""
    rank = dist.get_rank(group)
    lengths = [2 * cp * n for n in (1, 3, 2)]
    layout = DocumentLayout.of(lengths, cp)
    t = sum(lengths)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, HN, generator=gen, dtype=torch.float64) for h in (NP, ng, ng))  # (t, h, hn)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grad_out = torch.randn(t, NP, HN, generator=gen, dtype=torch.float64)
    pieces = [
        _sdpa(*(x.permute(1, 0, 2)[None] for x in (qd, kd, vd)), None, 0.0, True, ng != NP)[0].permute(
            1, 0, 2
        )
        for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ]
    full = torch.cat(pieces)  # (t, np, hn)
    full.backward(grad_out)
    mine = torch.from_numpy(layout.local_positions(rank))  # (t / cp,)
    lq, lk, lv = (x.detach()[mine].clone().requires_grad_() for x in (q, k, v))
    out = cp_packed_attention(lq, lk, lv, lengths, group, _sdpa)  # (t / cp, np, hn)
    out.backward(grad_out[mine])
    torch.testing.assert_close(out, full.detach()[mine], rtol=1e-10, atol=1e-10)
    for local, whole in ((lq, q), (lk, k), (lv, v)):
        torch.testing.assert_close(local.grad, whole.grad[mine], rtol=1e-10, atol=1e-10)


def test_cp_attention_equals_attention_over_the_whole_sequence() -> None:
    """At CP 4 and CP 2; causal and unmasked, multi-head and grouped-query; and the loss totals sum over
    the CP group."""
    mp.spawn(on_cp4_and_cp2, args=(4, free_port(), _checks), nprocs=4, join=True)


def test_the_head_tail_split_gives_every_rank_the_same_causal_work() -> None:
    """Chunk i attends to i + 1 chunks: ranks' pairs (r, 2cp - 1 - r) each sum to 2cp + 1."""
    for cp in (1, 2, 3, 4, 8):
        chunks = [c for r in range(cp) for c in head_tail_chunks(r, cp)]
        assert sorted(chunks) == list(range(2 * cp))  # every chunk on exactly one rank
        assert {sum(c + 1 for c in head_tail_chunks(r, cp)) for r in range(cp)} == {2 * cp + 1}
        where = natural_order(cp)
        assert [chunks[i] for i in where] == list(range(2 * cp))  # gathered rank by rank, put in order


def test_the_gpt_loss_keeps_its_sums_when_the_schedule_divides_it() -> None:
    """pretrain_gpt's loss in megatron-core's per-token form: the schedule divides the returned sum in place
    by the token count and the micro-batch count; the reported sums must not move with it (without CP they
    are this rank's own: copies, not views)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import pretrain_gpt

    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # (b, s): 7 tokens
    per_token = torch.full((2, 4), 2.0)
    loss, tokens, reported = pretrain_gpt.loss_func(mask, per_token)
    loss /= torch.clamp(tokens, min=1)  # what megatron-core's forward_step does with a 3-output loss
    loss /= 2  # ... and its micro-batch count
    assert tokens.item() == 7 and loss.item() == 1.0
    assert reported["loss_sum"].item() == 14.0 and reported["tokens"].item() == 7.0
    assert reported["loss"].item() == 2.0


def test_the_vit_refuses_context_parallelism_before_any_rank_starts() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import pretrain_vit
    from megahet.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"parallel.cp 2: the ViT's sequence .* set parallel.cp 1"):
        pretrain_vit.preflight(load_config(["--parallel.cp", "2"]))
