"""Tests of megahet's SDPA core attention (megahet/models/attention.py) against megatron-core's local
`DotProductAttention`, in one process (TP=1, gloo):

- the same GPT / ViT / Llama-shaped GPT built with `model.attention=sdpa` and `local` from one seed:
  same parameters, logits and every gradient to fp32 tolerance;
- with heads dropped (a resize plan), sdpa still equals local (the head count comes from the shape);
- grouped-query attention (fewer key/value heads) matches the local path's repeated keys and values;
- dropout runs under megatron-core's RNG tracker: reproducible from the tracker's seed, off in eval;
- the spec plugs SDPACoreAttention into both the plain and the resizable spec.
The TP=2 comparison (and migrated heads) is in tests/distributed/test_equivalence.py.

Run: ``python -m pytest tests/unit/test_attention.py -q``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from tiny_models import LLAMA, TINY_GPT

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.attention import SDPACoreAttention
from megahet.models.common import local_layer_spec, resizable_layer_spec
from megahet.models.gpt import build_gpt
from megahet.models.vit import build_vit
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

SEED = 2024
VOCAB, SEQ, BATCH = 64, 16, 2


def _cfg(**overrides) -> MegahetConfig:
    base = {
        **TINY_GPT,
        "model.seq_length": SEQ,
        "model.patch_size": 7,
    }
    return apply_overrides(MegahetConfig(), {**base, **overrides})


def _seed() -> None:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def _gpt(cfg: MegahetConfig, resizable: bool = False):
    _seed()
    build = resizable_layer_spec if resizable else local_layer_spec
    spec = build(attention=cfg.model.attention, normalization=cfg.model.normalization)
    return build_gpt(cfg, VOCAB, spec)


def _vit(cfg: MegahetConfig, resizable: bool = False):
    _seed()
    build = resizable_layer_spec if resizable else local_layer_spec
    return build_vit(cfg, build(AttnMaskType.no_mask, attention=cfg.model.attention))


def _run(model, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward: (logits or per-token loss, {name: grad})."""
    g = torch.Generator().manual_seed(7)
    model.zero_grad(set_to_none=True)
    if kind == "vit":
        images, labels = (
            torch.randn(BATCH, 1, 28, 28, generator=g),
            torch.randint(0, 10, (BATCH,), generator=g),
        )
        out = model(images)
        F.cross_entropy(out, labels).backward()
    else:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)  # (b, s, vocab) logits
        F.cross_entropy(out.flatten(0, 1), torch.roll(tokens, -1, 1).flatten()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.detach(), grads


def _assert_close(actual, expected, what: str) -> None:
    atol = 2e-6 * max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _compare(models: dict, kind: str, plan: ResizePlan | None = None) -> None:
    results = {}
    for name, model in models.items():
        if plan is not None:
            ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1).apply(plan)
        results[name] = _run(model, kind)
    (out, grads), (ref_out, ref_grads) = results["sdpa"], results["local"]
    _assert_close(out, ref_out, f"{kind} output")
    assert list(grads) == list(ref_grads)
    for name in grads:
        _assert_close(grads[name], ref_grads[name], f"{kind} gradient of {name}")


@pytest.mark.parametrize("kind", ["gpt", "vit", "llama"])
def test_sdpa_equals_local_attention(world1, kind: str) -> None:
    extra = LLAMA if kind == "llama" else {}
    build = _vit if kind == "vit" else _gpt
    models = {a: build(_cfg(**{"model.attention": a, **extra})) for a in ("sdpa", "local")}
    core = models["sdpa"].decoder.layers[0].self_attention.core_attention
    assert isinstance(core, SDPACoreAttention)
    assert type(models["local"].decoder.layers[0].self_attention.core_attention) is DotProductAttention
    for (n, p), (n2, p2) in zip(models["sdpa"].named_parameters(), models["local"].named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    _compare(models, "vit" if kind == "vit" else "gpt")


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_sdpa_core_attention_builds_alone_without_a_process_group_collection(world1, groups: int) -> None:
    """Built as megatron-core's DotProductAttention may be, with no pg_collection (the TP size then comes
    from parallel_state; the GPU suite builds it so, and an H200 run once failed there), it computes causal
    softmax attention: fp32 reference on the repeated key/value heads."""
    from megatron.core.transformer.enums import AttnMaskType

    from megahet.models.common import transformer_config

    cfg = _cfg(**{"model.num_query_groups": groups})
    core = SDPACoreAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self")
    heads, hn = cfg.model.num_attention_heads, cfg.model.hidden_size // cfg.model.num_attention_heads
    q = torch.randn(SEQ, BATCH, heads, hn)  # sbhd
    k, v = (torch.randn(SEQ, BATCH, groups, hn) for _ in range(2))
    r = heads // groups
    scores = torch.einsum("sbhd,tbhd->bhst", q, k.repeat_interleave(r, 2)) / hn**0.5
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    reference = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v.repeat_interleave(r, 2))
    torch.testing.assert_close(core(q, k, v, None), reference.reshape(SEQ, BATCH, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "vit"])
def test_sdpa_equals_local_with_heads_dropped(world1, kind: str) -> None:
    build = _vit if kind == "vit" else _gpt
    models = {a: build(_cfg(**{"model.attention": a}), resizable=True) for a in ("sdpa", "local")}
    plan = ResizePlan(
        {("attn", 1): {(0, 0): (0, 2)}, ("attn", 2): {(0, 0): (3,)}, ("mlp", 1): {(0, 0): (5,)}}
    )
    _compare(models, kind, plan)


def test_sdpa_dropout_follows_the_model_parallel_rng_tracker(world1) -> None:
    cfg = _cfg(**{"model.attention_dropout": 0.5})
    model = _gpt(cfg)
    core = model.decoder.layers[0].self_attention.core_attention
    q, k, v = (torch.randn(SEQ, BATCH, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def attend() -> torch.Tensor:
        return core(q, k, v, None)

    tensor_parallel.model_parallel_cuda_manual_seed(5)
    first = attend()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(99)  # the default generator does not decide the dropout mask
    again = attend()
    assert torch.equal(first, again)
    assert not torch.equal(first, attend())  # the tracker's state moved on
    core.eval()
    torch.testing.assert_close(attend(), F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True
    ).permute(2, 0, 1, 3).reshape(SEQ, BATCH, 32))  # fmt: skip
    core.train()


def test_sdpa_takes_an_explicit_mask_in_megatron_convention(world1) -> None:
    """megatron-core masks say True = masked; SDPA's say True = attend."""
    core = _gpt(_cfg()).decoder.layers[0].self_attention.core_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(SEQ, BATCH, 4, 8, generator=g) for _ in range(3))
    causal = core(q, k, v, None)
    masked = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True above the diagonal
    torch.testing.assert_close(core(q, k, v, masked), causal)


def test_the_spec_plugs_sdpa_into_plain_and_resizable_layers() -> None:
    for build in (local_layer_spec, resizable_layer_spec):
        attention = build().submodules.self_attention.submodules.core_attention
        assert attention is SDPACoreAttention
        local = build(attention="local").submodules.self_attention.submodules.core_attention
        assert local is DotProductAttention
    with pytest.raises(ValueError, match="sdpa or local"):
        local_layer_spec(attention="flash")
