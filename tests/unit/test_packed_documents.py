"""A packed micro-batch of documents equals its documents run alone (issue 28), in one process (TP=1, gloo).

- GPT-2-shaped (learned positions) and Llama-shaped (rope, GQA, SwiGLU) GPTs, plain and resizable specs:
  the per-token losses of a pack of three documents equal each document's own forward, and the
  gradients of the pack's summed loss equal the sum of the documents' gradients, to fp32 tolerance;
- attention never crosses a boundary: changing one document's tokens leaves the others' losses alone;
- the resizable attention counts sum(s^2) score entries for a pack, not t^2;
- the batch a stream collates: positions restart at 0, cu_seqlens at the boundaries, labels shifted.

Run: ``python -m pytest tests/unit/test_packed_documents.py -q``
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core import tensor_parallel
from tiny_models import LLAMA, TINY_GPT

from megahet.config import MegahetConfig, apply_overrides
from megahet.data.documents import DocumentPieces
from megahet.data.packed import collate_documents
from megahet.models.attention import packed_documents
from megahet.models.common import local_layer_spec, resizable_layer_spec
from megahet.models.gpt import build_gpt

VOCAB, SEQ = 64, 32
LENGTHS = (11, 5, 16)


def _gpt(overrides: dict, resizable: bool):
    base = {**TINY_GPT, "model.seq_length": SEQ, "data.packing": "documents"}
    cfg = apply_overrides(MegahetConfig(), {**base, **overrides})
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    build = resizable_layer_spec if resizable else local_layer_spec
    return build_gpt(cfg, VOCAB, build(normalization=cfg.model.normalization))


def _documents(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in LENGTHS]


def _pack_loss(model, docs: list[torch.Tensor]) -> torch.Tensor:
    """Per-token loss (1, t) of the documents packed into one row."""
    lengths = [len(d) - 1 for d in docs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    tokens = torch.cat([d[:-1] for d in docs])[None]
    labels = torch.cat([d[1:] for d in docs])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return model(tokens, positions, None, labels=labels, packed_seq_params=packed_documents(cu, lengths))


def _alone_loss(model, doc: torch.Tensor) -> torch.Tensor:
    n = len(doc) - 1
    return model(doc[None, :-1], torch.arange(n)[None], None, labels=doc[None, 1:])  # (1, n)


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("resizable", [False, True], ids=["plain", "resizable"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_micro_batch_equals_its_documents_alone(world1, arch: str, resizable: bool) -> None:
    model = _gpt(LLAMA if arch == "llama" else {}, resizable)
    docs = _documents()
    model.zero_grad(set_to_none=True)
    packed = _pack_loss(model, docs)  # (1, 32)
    packed.sum().backward()
    packed_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    alone = [_alone_loss(model, d) for d in docs]
    torch.stack([a.sum() for a in alone]).sum().backward()
    alone_grads = _grads(model)
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_attention_stays_inside_each_document(world1) -> None:
    model = _gpt(LLAMA, resizable=False)
    docs = _documents()
    before = _pack_loss(model, docs).detach()
    changed = [docs[0], torch.randint(0, VOCAB, docs[1].shape), docs[2]]
    after = _pack_loss(model, changed).detach()
    a, b = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    torch.testing.assert_close(after[:, :a], before[:, :a])  # the document before: untouched
    torch.testing.assert_close(after[:, b:], before[:, b:])  # the document after: untouched too
    assert not torch.allclose(after[:, a:b], before[:, a:b])


def test_resizable_attention_counts_the_documents_squares(world1) -> None:
    model = _gpt({}, resizable=True)
    attention = model.decoder.layers[0].self_attention
    attention.executed_flops = 0
    with torch.no_grad():
        _pack_loss(model, _documents())
    heads, hn = attention.num_local_heads, attention.hidden_size_per_attention_head
    assert attention.executed_flops == 4 * sum(n * n for n in LENGTHS) * heads * hn


def test_collated_batch_restarts_positions_at_every_document() -> None:
    tokens = np.arange(100, 130, dtype=np.uint16)  # one split's token stream
    pieces = DocumentPieces(tokens, np.array([0, 10, 14]), np.array([9, 3, 15]), max_tokens=16)
    batch = collate_documents(pieces, [2, 0])
    assert batch["doc_lengths"] == [15, 9]
    assert batch["cu_seqlens"].tolist() == [0, 15, 24] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["position_ids"].tolist() == [list(range(15)) + list(range(9))]
    assert batch["tokens"][0, :15].tolist() == list(range(114, 129))
    assert batch["labels"][0, :15].tolist() == list(range(115, 130))
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (1, 24)


def test_the_varlen_kernels_causal_switch_is_read_from_its_signature(monkeypatch) -> None:
    """torch 2.13's varlen_attn takes window_size=(-1, 0) for causal; early releases took is_causal=True."""
    import sys
    import types

    from megahet.models import attention

    attention._varlen_attn.cache_clear()
    kernel = attention._varlen_attn()
    assert kernel.causal == {"window_size": (-1, 0)} and kernel.takes_gqa  # this torch

    def early(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        return query

    def unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return query

    for fake, expected in ((early, {"is_causal": True}), (unknown, None)):
        module = types.ModuleType("torch.nn.attention.varlen")
        module.varlen_attn = fake
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
        attention._varlen_attn.cache_clear()
        found = attention._varlen_attn()
        assert (found.causal if found else None) == expected
        assert found is None or not found.takes_gqa
    monkeypatch.undo()
    attention._varlen_attn.cache_clear()


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["enable_gqa", "no_enable_gqa"])
def test_the_varlen_kernel_gives_grouped_query_heads_their_key_value_heads(takes_gqa: bool) -> None:
    """Grouped-query attention through varlen_attn: torch 2.13's takes enable_gqa; torch 2.11's has no such
    keyword (an H200 run raised TypeError), so the key / value heads are repeated for it. Either way each
    document's causal attention equals SDPA with enable_gqa run on that document alone. The kernel is
    stood in for by per-document SDPA with the same signature (the real one needs CUDA)."""
    import itertools

    import torch.nn.functional as F

    from megahet.models.attention import VarlenKernel

    lengths, heads, groups, hn = [5, 3, 8], 4, 2, 8

    def per_document(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, **gqa):
        assert is_causal and (gqa == {"enable_gqa": True}) == takes_gqa
        assert takes_gqa or key.shape[1] == query.shape[1]
        bounds = cu_q.tolist()
        out = [
            F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (query, key, value)), is_causal=True,
                                           scale=scale, enable_gqa=takes_gqa).transpose(0, 1)
            for a, b in itertools.pairwise(bounds)
        ]  # fmt: skip
        return torch.cat(out)

    t = sum(lengths)
    q, k, v = torch.randn(t, heads, hn), torch.randn(t, groups, hn), torch.randn(t, groups, hn)
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    out = VarlenKernel(per_document, {"is_causal": True}, takes_gqa)(q, k, v, cu, max(lengths), None)
    expected = torch.cat([
        F.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1), is_causal=True,
                                       enable_gqa=True).transpose(0, 1)
        for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))
    ])  # fmt: skip
    torch.testing.assert_close(out, expected)
