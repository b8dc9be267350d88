"""Tests of megahet's resizable TP layers in real megatron-core models, in one process (TP=1, gloo):

- gamma = 0: a GPT / ViT built with `resizable_layer_spec` (no plan, an empty plan, a plan for other
  ranks, or a plan applied and then lifted) is bit-for-bit megatron-core's local-spec model from the
  same seed: same parameters, outputs and parameter gradients;
- gamma > 0: the resized forward and gradients equal those of the same model whose dropped units'
  weights (fc1 rows + biases and fc2 columns; qkv rows + biases and proj columns) are zero;
- the work really shrinks: the layers compute narrower activations and their FLOP counters fall by
  exactly floor(gamma * units) / units (MLP) or per kept head (attention);
- SwiGLU MLPs (a unit: its gate and up rows of fc1, its fc2 column) resize like GELU ones;
- unsupported configurations (sequence parallelism, gathered outputs) fail with a clear error.

The `world1` fixture starts a one-rank gloo group with megatron-core's groups through
megahet.parallel.initialize_parallel (which applies the CPU shims) and tears it down afterwards.

Run: ``python -m pytest tests/unit/test_resize_layers.py -q`` (about 15 s, mostly imports).
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from resize_reference import zero_units

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.attention import SDPACoreAttention
from megahet.models.common import (
    default_layer_spec,
    local_layer_spec,
    resizable_layer_spec,
    transformer_config,
)
from megahet.models.gpt import build_gpt
from megahet.models.vit import build_vit
from megahet.policy.resize_planner import plan_resize
from megahet.policy.selection import select_random
from megahet.tensor_parallel.blocks import find_blocks
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.layers import (
    ResizableColumnParallelLinear,
    ResizableRowParallelLinear,
    ResizableSelfAttention,
)
from megahet.tensor_parallel.plan import ResizePlan

SEED = 4321
LAYERS, HIDDEN, HEADS, FFN = 2, 32, 4, 64
HN = HIDDEN // HEADS  # head dim
VOCAB, SEQ, BATCH = 64, 8, 2
VIT_SEQ = (28 // 7) ** 2 + 1  # 16 patches of 7x7 + [CLS]

# A plan touching MLP and attention blocks of both layers (layer 2's MLP is left whole).
DROPS = {
    ("mlp", 1): (1, 5, 9, 17, 33, 40, 41, 63),
    ("attn", 1): (0, 3),
    ("attn", 2): (2,),
}


def _cfg(**overrides: object) -> MegahetConfig:
    base = {
        "model.num_layers": LAYERS,
        "model.hidden_size": HIDDEN,
        "model.num_attention_heads": HEADS,
        "model.ffn_hidden_size": FFN,
        "model.seq_length": SEQ,
        "model.make_vocab_size_divisible_by": 1,
        "model.patch_size": 7,
        "model.hidden_dropout": 0.0,
        "model.attention_dropout": 0.0,
    }
    return apply_overrides(MegahetConfig(), {**base, **overrides})


def _seed() -> None:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def megatron_spec(cfg: MegahetConfig):
    """megatron-core's own local layer spec, with the core attention the config names (SDPA is plugged
    into the plain baseline too, through the spec's `core_attention`)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=cfg.model.normalization))
    if cfg.model.attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def megatron_gpt(cfg: MegahetConfig) -> GPTModel:
    """megatron-core's GPTModel with its own local layer spec, shaped like megahet's build_gpt."""
    _seed()
    return GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=megatron_spec(cfg),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
    )


def resizable_gpt(cfg: MegahetConfig) -> GPTModel:
    _seed()
    return build_gpt(cfg, VOCAB, resizable_layer_spec(attention=cfg.model.attention))


def local_vit(cfg: MegahetConfig):
    _seed()
    return build_vit(cfg, local_layer_spec(AttnMaskType.no_mask, attention=cfg.model.attention))


def resizable_vit(cfg: MegahetConfig):
    _seed()
    return build_vit(cfg, resizable_layer_spec(AttnMaskType.no_mask, attention=cfg.model.attention))


def _gpt_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    }


def _vit_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return {
        "images": torch.randn(BATCH, 1, 28, 28, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g),
    }


def run(model, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward; returns (output, {name: grad}) and leaves the grads zeroed."""
    model.zero_grad(set_to_none=True)
    if kind == "gpt":
        b = _gpt_batch()
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # (b, s) per-token loss
        loss = out.mean()
    else:
        b = _vit_batch()
        out = model(b["images"])  # (b, classes)
        loss = F.cross_entropy(out, b["labels"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach().clone(), grads


BUILDERS = {"gpt": (megatron_gpt, resizable_gpt), "vit": (local_vit, resizable_vit)}
# Llama-shaped (multi-head attention): rotary positions, RMSNorm, SwiGLU, untied output layer. Biases kept,
# so that the bias rows of a unit are checked too.
SWIGLU = {
    "model.position_embedding_type": "rope", "model.normalization": "RMSNorm", "model.activation": "swiglu",
    "model.untie_embeddings_and_output_weights": True,
}  # fmt: skip
KINDS = {
    "gpt": ("gpt", {}),
    "vit": ("vit", {}),
    "swiglu": ("gpt", SWIGLU),
    "gqa": ("gpt", {**SWIGLU, "model.num_query_groups": 2}),
}


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b), what
    for name, value in a.items():
        assert torch.equal(value, b[name]), f"{what}: {name} differs by {(value - b[name]).abs().max():.3e}"


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    """fp32 closeness scaled by the tensor's magnitude (summation order differs, nothing else)."""
    atol = 1e-6 * max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _plan(drops: dict[tuple[str, int], tuple[int, ...]], rank: tuple[int, int] = (0, 0)) -> ResizePlan:
    return ResizePlan({block: {rank: units} for block, units in drops.items()})


# --- the layer spec --------------------------------------------------------------------------------


def test_resizable_spec_plugs_in_megahet_layers(world1) -> None:
    assert (
        default_layer_spec(_cfg()).submodules.mlp.submodules.linear_fc1 is not ResizableColumnParallelLinear
    )
    for active in ({"resize.gamma": "0:0.5"}, {"resize.enabled": True}):
        spec = default_layer_spec(_cfg(**active))
        assert spec.submodules.self_attention.module is ResizableSelfAttention
        assert spec.submodules.mlp.submodules.linear_fc2 is ResizableRowParallelLinear
    model = resizable_gpt(_cfg())
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention, ResizableSelfAttention)
    assert isinstance(layer.self_attention.linear_qkv, ResizableColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, ResizableRowParallelLinear)
    assert isinstance(layer.mlp.linear_fc1, ResizableColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, ResizableRowParallelLinear)
    blocks = find_blocks(model)
    assert {key: block.num_units for key, block in blocks.items()} == {
        ("attn", 1): HEADS,
        ("mlp", 1): FFN,
        ("attn", 2): HEADS,
        ("mlp", 2): FFN,
    }
    # The ViT's bidirectional attention keeps its mask type through the resizable spec.
    vit = resizable_vit(_cfg())
    assert vit.decoder.layers[0].self_attention.attn_mask_type == AttnMaskType.no_mask
    assert set(find_blocks(vit)) == set(blocks)


# --- gamma = 0: megatron-core's model exactly ------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("kind", ["gpt", "vit", "swiglu", "gqa"])
def test_gamma0_is_bitwise_the_local_spec_model(world1, kind: str, attention: str) -> None:
    kind, extra = KINDS[kind]
    cfg = _cfg(**{"model.attention": attention, **extra})
    build_reference, build_resizable = BUILDERS[kind]
    reference, model = build_reference(cfg), build_resizable(cfg)
    assert type(reference.decoder.layers[0].self_attention) is SelfAttention  # megatron-core's own
    assert isinstance(model.decoder.layers[0].self_attention, ResizableSelfAttention)
    _assert_identical(
        {n: p.detach() for n, p in model.named_parameters()},
        {n: p.detach() for n, p in reference.named_parameters()},
        "initial parameters",
    )
    ref_out, ref_grads = run(reference, kind)

    out, grads = run(model, kind)  # no plan at all
    assert torch.equal(out, ref_out)
    _assert_identical(grads, ref_grads, "gradients, no plan")

    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1)
    other_rank = ResizePlan({("mlp", 1): {(0, 1): (0, 1)}, ("attn", 2): {(0, 1): (1,)}})
    for name, plan in [("empty plan", ResizePlan()), ("another TP rank's plan", other_rank)]:
        executor.apply(plan)
        out, grads = run(model, kind)
        assert torch.equal(out, ref_out), name
        _assert_identical(grads, ref_grads, f"gradients, {name}")

    executor.apply(_plan(DROPS))
    resized_out, _ = run(model, kind)
    assert not torch.allclose(resized_out, ref_out)  # the plan did change the model...
    executor.apply(ResizePlan())
    out, grads = run(model, kind)  # ...and lifting it restores megatron-core's model exactly
    assert torch.equal(out, ref_out)
    _assert_identical(grads, ref_grads, "gradients, plan lifted")


# --- gamma > 0: equals zeroed units --------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("kind", ["gpt", "vit", "swiglu"])
def test_resized_model_equals_model_with_dropped_units_zeroed(world1, kind: str, attention: str) -> None:
    gated = kind == "swiglu"
    kind, extra = KINDS[kind]
    cfg = _cfg(**{"model.attention": attention, **extra})
    build = BUILDERS[kind][1]
    model, reference, whole = build(cfg), build(cfg), build(cfg)
    ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1).apply(_plan(DROPS))
    zero_units(reference, DROPS)

    out, grads = run(model, kind)
    ref_out, ref_grads = run(reference, kind)
    whole_out, _ = run(whole, kind)
    _assert_close(out, ref_out, f"{kind} output")
    assert (out - whole_out).abs().max() > 1e-3  # dropping units changed the output noticeably
    assert list(grads) == list(ref_grads)
    for name in grads:  # every parameter: embeddings, norms, kept and dropped units
        _assert_close(grads[name], ref_grads[name], f"{kind} gradient of {name}")

    # The dropped units' own gradients are exactly zero in the resized model (zero imputation).
    prefix = "decoder.layers.0."
    dropped = list(DROPS[("mlp", 1)])
    rows = dropped + [FFN + u for u in dropped] if gated else dropped  # SwiGLU: gate and up rows
    assert grads[prefix + "mlp.linear_fc1.weight"][rows].abs().max() == 0
    assert grads[prefix + "mlp.linear_fc1.bias"][rows].abs().max() == 0
    assert grads[prefix + "mlp.linear_fc2.weight"][:, dropped].abs().max() == 0
    kept = [u for u in range(FFN) if u not in dropped]
    kept_rows = kept + [FFN + u for u in kept] if gated else kept
    assert grads[prefix + "mlp.linear_fc1.weight"][kept_rows].abs().amax(dim=1).min() > 0
    qkv, proj = (
        grads[prefix + "self_attention.linear_qkv.weight"],
        grads[prefix + "self_attention.linear_proj.weight"],
    )
    for h in range(HEADS):
        rows, cols = qkv[3 * HN * h : 3 * HN * (h + 1)], proj[:, HN * h : HN * (h + 1)]
        if h in DROPS[("attn", 1)]:
            assert rows.abs().max() == 0 and cols.abs().max() == 0, h
        else:
            assert rows.abs().max() > 0 and cols.abs().max() > 0, h


# --- the work shrinks ----------------------------------------------------------------------------


def _expected_flops(kept_heads: dict[int, int], kept_units: dict[int, int], tokens: int, b: int, s: int):
    """Forward GEMM FLOPs per block (layer -> (attn, mlp)) at 2 FLOPs per multiply-add."""
    out = {}
    for layer in range(1, LAYERS + 1):
        h, u = kept_heads[layer], kept_units[layer]
        qkv = 2 * tokens * (3 * HN * h) * HIDDEN
        proj = 2 * tokens * HIDDEN * (HN * h)
        core = 2 * (2 * b * s * s * HN) * h  # QK^T and AV per head
        fc1 = 2 * tokens * u * HIDDEN
        fc2 = 2 * tokens * HIDDEN * u
        out[layer] = {"qkv": qkv, "proj": proj, "core": core, "fc1": fc1, "fc2": fc2}
    return out


@pytest.mark.parametrize("gamma", [0.5, 0.3])
def test_executed_flops_fall_by_gamma(world1, gamma: float) -> None:
    cfg = _cfg()
    counters, widths, models = {}, {}, {}
    for g in (0.0, gamma):
        model = resizable_gpt(cfg)
        executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1)
        plan = plan_resize(
            executor.block_units,
            {(0, 0): g},
            lambda block, rank, n: select_random(FFN if block[0] == "mlp" else HEADS, n, seed=block[1]),
        )
        executor.apply(plan)
        fc1 = model.decoder.layers[0].mlp.linear_fc1
        handle = fc1.register_forward_hook(
            lambda mod, args, out, g=g: widths.__setitem__(g, out[0].shape[-1])
        )
        with torch.no_grad():
            b = _gpt_batch()
            model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        handle.remove()
        counters[g], models[g] = executor, model

    n_mlp = FFN - int(gamma * FFN)  # floor for these positive values
    n_heads = HEADS - int(gamma * HEADS)
    assert widths == {0.0: FFN, gamma: n_mlp}  # fc1 really computes only the kept units
    tokens = BATCH * SEQ
    full = _expected_flops({1: HEADS, 2: HEADS}, {1: FFN, 2: FFN}, tokens, BATCH, SEQ)
    resized = _expected_flops({1: n_heads, 2: n_heads}, {1: n_mlp, 2: n_mlp}, tokens, BATCH, SEQ)
    for g, expected in [(0.0, full), (gamma, resized)]:
        executor = counters[g]
        for layer in range(1, LAYERS + 1):
            attn, mlp = executor.blocks[("attn", layer)], executor.blocks[("mlp", layer)]
            e = expected[layer]
            assert attn.column.executed_flops == e["qkv"], (g, layer)
            assert attn.row.executed_flops == e["proj"], (g, layer)
            assert attn.attention.executed_flops == e["core"], (g, layer)
            assert attn.executed_flops == e["qkv"] + e["proj"] + e["core"]
            assert (mlp.column.executed_flops, mlp.row.executed_flops) == (e["fc1"], e["fc2"]), (g, layer)
            assert mlp.executed_flops == e["fc1"] + e["fc2"]
        assert executor.executed_flops() == sum(sum(e.values()) for e in expected.values())

    # The ratios, exactly: MLP keeps (units - floor(gamma * units)) / units, attention its kept heads.
    base, small = counters[0.0], counters[gamma]
    for layer in range(1, LAYERS + 1):
        mlp_ratio = Fraction(
            small.blocks[("mlp", layer)].executed_flops, base.blocks[("mlp", layer)].executed_flops
        )
        attn_ratio = Fraction(
            small.blocks[("attn", layer)].executed_flops, base.blocks[("attn", layer)].executed_flops
        )
        assert mlp_ratio == Fraction(FFN - (FFN * Fraction(str(gamma))).__floor__(), FFN)
        assert attn_ratio == Fraction(HEADS - (HEADS * Fraction(str(gamma))).__floor__(), HEADS)
    if gamma == 0.5:
        assert Fraction(small.executed_flops(), base.executed_flops()) == Fraction(1, 2)

    # Counters accumulate over calls: a second forward doubles them.
    before = small.executed_flops()
    with torch.no_grad():
        b = _gpt_batch()
        models[gamma](b["tokens"], b["position_ids"], None, labels=b["labels"])
    assert small.executed_flops() == 2 * before


# --- unsupported configurations --------------------------------------------------------------------


def test_unsupported_configurations_fail_clearly(world1) -> None:
    model = resizable_gpt(_cfg())
    blocks = find_blocks(model)
    column, row = blocks[("mlp", 1)].column, blocks[("mlp", 1)].row
    column.sequence_parallel = True
    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        column.set_kept(torch.arange(4))
    column.sequence_parallel = False
    column.gather_output = True
    with pytest.raises(NotImplementedError, match="gather its output"):
        column.set_kept(torch.arange(4))
    column.gather_output = False
    row.input_is_parallel = False
    with pytest.raises(NotImplementedError, match="input_is_parallel"):
        row.set_kept(torch.arange(4))
    row.input_is_parallel = True


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gather_units_gradient_equals_index_selects(dim: int, dtype: torch.dtype) -> None:
    """The resized linears' gather: same values and gradient as index_select (index_copy_ instead of the
    index_add_ autograd uses), so the resized layers' numerics do not depend on which one runs."""
    from megahet.tensor_parallel.layers import gather_units

    torch.manual_seed(0)
    weight = torch.randn(12, 10, dtype=dtype, requires_grad=True)  # (units, in) or (out, units)
    index = torch.tensor([0, 3, 4, 9])
    upstream = torch.randn(*(4, 10) if dim == 0 else (12, 4), dtype=dtype)
    (gather_units(weight, dim, index) * upstream).sum().backward()
    ours, weight.grad = weight.grad, None
    (weight.index_select(dim, index) * upstream).sum().backward()
    assert torch.equal(ours, weight.grad)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda w: gather_units(w, dim, index), (weight,))
