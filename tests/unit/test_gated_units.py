"""SwiGLU work units under the ResizeExecutor (TP=1, gloo): a unit is its gate row u and up row F + u of
fc1 (and their bias entries) plus fc2 column u, so every gradient policy and the optimizer freeze must
treat the two fc1 rows as one unit.

- zero: a dropped unit's gate, up and fc2 gradients are exactly 0, kept units' are not;
- average: a dropped unit's gate / up / fc2 gradient is the mean of the kept units' gate / up / fc2;
- same: a dropped unit's gradient is the one of the last step that computed it;
- AdamW with weight decay under zero imputation leaves a dropped unit's gate and up rows untouched;
- a unit's work (`Block.unit_work`, what migration rounds by) is the FLOPs its block executes per unit
  and token, for SwiGLU MLPs and grouped-query heads as for the plain ones.
(Layer-level parity with megatron-core's SwiGLU MLP is in test_resize_layers.py.)

Run: ``python -m pytest tests/unit/test_gated_units.py -q``
"""

from __future__ import annotations

import pytest
import torch
from resize_gpt import FFN, HN, MICRO, SEED, SEQ, batches, gpt, step  # noqa: F401  (SEED seeds world1)
from resize_gpt import plan_of as _plan

from megahet.tensor_parallel.blocks import find_blocks
from megahet.tensor_parallel.executor import ResizeExecutor

SWIGLU = {"model.activation": "swiglu", "model.normalization": "RMSNorm"}
BLOCK = ("mlp", 1)
DROPPED = (2, 3, 10, 63)
FC1, BIAS, FC2 = (
    f"decoder.layers.0.mlp.{n}" for n in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight")
)


def parts(tensors: dict[str, torch.Tensor], u: int) -> dict[str, torch.Tensor]:
    """Unit u's slices, spelled out from megatron-core's [gates; ups] fc1 layout."""
    return {
        "gate": tensors[FC1][u], "up": tensors[FC1][FFN + u], "gate_bias": tensors[BIAS][u],
        "up_bias": tensors[BIAS][FFN + u], "fc2": tensors[FC2][:, u],
    }  # fmt: skip


def test_a_swiglu_unit_is_a_gate_row_an_up_row_and_a_column(world1) -> None:
    block = find_blocks(gpt(**SWIGLU))[BLOCK]
    assert block.num_units == FFN and block.column.weight.shape[0] == 2 * FFN
    fc1 = block.unit_params[0]
    assert fc1.rows(torch.tensor([1, 5])).tolist() == [1, 5, FFN + 1, FFN + 5]
    assert sorted(fc1.offsets([1]).tolist()) == list(range(32, 64)) + list(
        range((FFN + 1) * 32, (FFN + 2) * 32)
    )
    assert torch.equal(fc1.units(block.column.weight)[5], block.column.weight[[5, FFN + 5]].unsqueeze(1))


def _grads(imputation: str, micro: int = 2) -> tuple[dict, dict]:
    model = gpt(**SWIGLU)
    executor = ResizeExecutor(
        model, dp_rank=0, tp_rank=0, dp_size=1, imputation=imputation, num_microbatches=micro
    )
    executor.apply(_plan({BLOCK: DROPPED}))
    grads = step(model, executor, torch.optim.SGD(model.parameters(), lr=0.0), batches(3, micro))
    return grads, executor


def test_zero_and_average_imputation_of_swiglu_units(world1) -> None:
    zero, _ = _grads("zero")
    average, _ = _grads("average")
    kept = [u for u in range(FFN) if u not in DROPPED]
    for u in DROPPED:
        assert all(torch.count_nonzero(t) == 0 for t in parts(zero, u).values()), u
    for u in kept:
        assert all(torch.count_nonzero(t) > 0 for t in parts(zero, u).values()), u
        for name, t in parts(average, u).items():
            assert torch.equal(t, parts(zero, u)[name]), (name, u)  # kept units: their own gradient
    for name in parts(zero, 0):
        mean = torch.stack([parts(zero, u)[name] for u in kept]).mean(dim=0)
        for u in DROPPED:
            torch.testing.assert_close(parts(average, u)[name], mean, rtol=1e-5, atol=1e-6 * mean.abs().max())


def test_same_imputation_of_swiglu_units(world1) -> None:
    model = gpt(**SWIGLU)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="same", num_microbatches=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    full = step(model, executor, optimizer, batches(11))
    executor.apply(_plan({BLOCK: DROPPED}))
    resized = step(model, executor, optimizer, batches(12))
    for u in DROPPED:
        for name, t in parts(resized, u).items():
            assert torch.equal(t, parts(full, u)[name]) and t.abs().max() > 0, (name, u)
    u = next(u for u in range(FFN) if u not in DROPPED)
    assert not torch.equal(parts(resized, u)["up"], parts(full, u)["up"])


def test_adamw_leaves_dropped_swiglu_units_untouched(world1) -> None:
    model = gpt(**SWIGLU)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    step(model, executor, optimizer, batches(20))  # every unit trained once: moments are non-zero
    executor.apply(_plan({BLOCK: DROPPED}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    for i in range(3):
        step(model, executor, optimizer, batches(21 + i))
    after = {n: p.detach() for n, p in model.named_parameters()}
    now = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
    for u in DROPPED:
        for name, t in parts(after, u).items():
            assert torch.equal(t, parts(before, u)[name]), (name, u)
            assert torch.equal(parts(now, u)[name], parts(moments, u)[name]), (name, u)
    kept = next(u for u in range(FFN) if u not in DROPPED)
    assert all(not torch.equal(t, parts(before, kept)[n]) for n, t in parts(after, kept).items())


@pytest.mark.parametrize("overrides", [{}, {**SWIGLU, "model.num_query_groups": 2}], ids=["gpt", "llama"])
def test_a_units_work_is_what_its_block_executes_per_unit_and_token(world1, overrides) -> None:
    """After one forward, each block's executed FLOPs over (units x tokens) is its `unit_work()`: GEMM
    rows and columns, the shared key/value rows' share and the attention scores included."""
    model = gpt(**overrides)
    blocks = find_blocks(model)
    b = batches(0, 1)[0]
    model(b["tokens"], torch.arange(SEQ).expand(MICRO, SEQ), None, labels=b["labels"])
    for key, block in blocks.items():
        per_unit_token = block.executed_flops / (block.num_units * MICRO * SEQ)
        assert block.unit_work(SEQ) == pytest.approx(per_unit_token, rel=1e-9), key
    assert blocks[("attn", 1)].unit_work(SEQ) - blocks[("attn", 1)].unit_work(0) == 4 * HN * SEQ
