"""Grouped-query attention's work units under resizing (TP=1, gloo): a unit is one query head; the k/v
rows of its group are shared by the group's heads and computed while any of them is.

- no plan: bit-for-bit megatron-core's GQA attention (test_resize_layers.py covers the whole model);
- heads dropped: the output and every gradient equal those of the model whose dropped heads' q rows
  and proj columns are zero (spelled out here from megatron-core's [q_0 .. q_{r-1}, k, v] layout per
  group), except the dropped heads' own proj columns, which get no gradient; a group whose heads are
  all dropped is not computed at all (its k/v rows get no gradient) and its FLOPs are saved;
- zero imputation freezes a fully dropped group's k/v rows under AdamW with weight decay, while a
  partly dropped group's k/v rows keep training; average imputation gives them the kept groups' mean.

Run: ``python -m pytest tests/unit/test_grouped_query_units.py -q``
"""

from __future__ import annotations

import torch
from resize_gpt import HIDDEN, SEED, batches, gpt, step  # noqa: F401  (SEED seeds world1)
from resize_gpt import plan_of as _plan

from megahet.tensor_parallel.blocks import find_blocks
from megahet.tensor_parallel.executor import ResizeExecutor

GQA = {"model.num_query_groups": 2, "model.activation": "swiglu", "model.position_embedding_type": "rope"}
HEADS, GROUPS, HN = 4, 2, HIDDEN // 4
R = HEADS // GROUPS  # query heads per group
PERIOD = (R + 2) * HN  # qkv rows per group
# Layer 1: head 1 of group 0 dropped (group 0 still computed); layer 2: heads 2, 3 = all of group 1.
DROPS = {("attn", 1): (1,), ("attn", 2): (2, 3)}


def q_rows(head: int) -> slice:
    start = head // R * PERIOD + head % R * HN
    return slice(start, start + HN)


def kv_rows(group: int) -> slice:
    return slice(group * PERIOD + R * HN, (group + 1) * PERIOD)


def names(layer: int) -> tuple[str, str, str]:
    prefix = f"decoder.layers.{layer - 1}.self_attention."
    return prefix + "linear_qkv.weight", prefix + "linear_qkv.bias", prefix + "linear_proj.weight"


@torch.no_grad()
def zero_heads(model, drops) -> None:
    params = dict(model.named_parameters())
    for (_, layer), heads in drops.items():
        qkv, bias, proj = (params[n] for n in names(layer))
        for h in heads:
            qkv[q_rows(h)] = 0
            bias[q_rows(h)] = 0
            proj[:, h * HN : (h + 1) * HN] = 0


def run(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    b = batches(5, 1)[0]
    model.zero_grad(set_to_none=True)
    positions = torch.arange(b["tokens"].shape[1]).expand_as(b["tokens"])
    out = model(b["tokens"], positions, None, labels=b["labels"])  # (b, s) per-token loss
    out.mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(actual, expected, what: str) -> None:
    atol = 2e-6 * max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def test_units_are_query_heads_and_groups_share_their_kv_rows(world1) -> None:
    block = find_blocks(gpt(**GQA))[("attn", 1)]
    assert (block.num_units, block.query_groups) == (HEADS, GROUPS)
    q, _, _ = block.unit_params
    assert q.rows(torch.tensor([1, 2])).tolist() == list(range(HN, 2 * HN)) + list(range(PERIOD, PERIOD + HN))
    (kv, _) = block.shared_params
    assert kv.rows(torch.tensor([1])).tolist() == list(range(PERIOD + R * HN, 2 * PERIOD))
    weight = block.column.weight
    assert torch.equal(q.get(weight, torch.tensor([3])), weight[q_rows(3)].unsqueeze(0))
    assert torch.equal(kv.units(weight)[0], weight[kv_rows(0)])
    assert block.unit_group([0, 1, 2, 3]).tolist() == [0, 0, 1, 1]


def test_dropped_heads_equal_zeroed_heads(world1) -> None:
    model, reference, whole = gpt(**GQA), gpt(**GQA), gpt(**GQA)
    ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1).apply(_plan(DROPS))
    zero_heads(reference, DROPS)
    out, grads = run(model)
    ref_out, ref_grads = run(reference)
    whole_out, _ = run(whole)
    _close(out, ref_out, "per-token loss")
    assert (out - whole_out).abs().max() > 1e-4
    dropped_proj = {names(layer)[2]: heads for (_, layer), heads in DROPS.items()}
    for name, grad in grads.items():
        expected = ref_grads[name].clone()
        for h in dropped_proj.get(name, ()):  # zeroed q gives uniform attention: the reference's proj
            assert grad[:, h * HN : (h + 1) * HN].abs().max() == 0  # columns see it, the resized ones not
            expected[:, h * HN : (h + 1) * HN] = 0
        _close(grad, expected, f"gradient of {name}")
    qkv1, qkv2 = grads[names(1)[0]], grads[names(2)[0]]
    assert qkv1[q_rows(1)].abs().max() == 0 and qkv1[kv_rows(0)].abs().max() > 0  # group 0 still computed
    assert qkv2[kv_rows(1)].abs().max() == 0 and qkv2[kv_rows(0)].abs().max() > 0  # group 1 not computed


def test_a_dropped_group_saves_its_kv_flops(world1) -> None:
    model = gpt(**GQA)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1)
    executor.apply(_plan(DROPS))
    b = batches(5, 1)[0]
    with torch.no_grad():
        model(b["tokens"], torch.arange(b["tokens"].shape[1]).expand_as(b["tokens"]), None)
    tokens = b["tokens"].numel()
    qkv = {layer: executor.blocks[("attn", layer)].column.executed_flops for layer in (1, 2)}
    assert qkv[1] == 2 * tokens * (3 * HN + 2 * 2 * HN) * HIDDEN  # 3 heads, both groups' k/v
    assert qkv[2] == 2 * tokens * (2 * HN + 1 * 2 * HN) * HIDDEN  # 2 heads, group 0's k/v only


def test_zero_imputation_freezes_a_dropped_groups_kv_rows(world1) -> None:
    model = gpt(**GQA)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="zero")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    step(model, executor, optimizer, batches(30))
    executor.apply(_plan(DROPS))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(3):
        step(model, executor, optimizer, batches(31 + i))
    after = dict(model.named_parameters())
    qkv2, bias2 = names(2)[:2]
    assert torch.equal(after[qkv2][kv_rows(1)], before[qkv2][kv_rows(1)])  # group 1: all heads dropped
    assert torch.equal(after[bias2][kv_rows(1)], before[bias2][kv_rows(1)])
    assert torch.equal(after[qkv2][q_rows(2)], before[qkv2][q_rows(2)])
    assert not torch.equal(after[qkv2][kv_rows(0)], before[qkv2][kv_rows(0)])  # group 0 trains
    qkv1 = names(1)[0]
    assert not torch.equal(after[qkv1][kv_rows(0)], before[qkv1][kv_rows(0)])  # partly dropped: trains
    assert torch.equal(after[qkv1][q_rows(1)], before[qkv1][q_rows(1)])


def test_average_imputation_of_a_dropped_groups_kv_rows(world1) -> None:
    model = gpt(**GQA)
    executor = ResizeExecutor(
        model, dp_rank=0, tp_rank=0, dp_size=1, imputation="average", num_microbatches=1
    )
    executor.apply(_plan(DROPS))
    grads = step(model, executor, torch.optim.SGD(model.parameters(), lr=0.0), batches(40, 1))
    qkv2 = grads[names(2)[0]]
    torch.testing.assert_close(qkv2[kv_rows(1)], qkv2[kv_rows(0)])  # the one kept group's gradient
    torch.testing.assert_close(qkv2[q_rows(2)], (qkv2[q_rows(0)] + qkv2[q_rows(1)]) / 2)


def test_priority_statistics_follow_each_query_head(world1) -> None:
    """Priority selection scores each query head from its own q rows and proj columns (sampled elements),
    whether or not its group's shared k/v rows are computed."""
    from megahet.policy.selection import GradientStats, priority_scores, update_gradient_stats

    model = gpt(**GQA)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, track_gradients=True, score_samples=16)
    executor.apply(_plan(DROPS))
    step(model, executor, torch.optim.SGD(model.parameters(), lr=0.0), batches(50))
    grads = executor.unit_gradients[("attn", 2)]  # (heads, samples)
    assert grads.shape == (HEADS, 16)
    assert grads[2:].abs().max() == 0 and grads[:2].abs().amax(dim=1).min() > 0  # group 1's heads dropped
    stats = GradientStats.empty(HEADS, 16, grads.device)
    update_gradient_stats(stats, grads, executor.computed_mask(("attn", 2)), 0.9)
    assert stats.count.tolist() == [1, 1, 0, 0] and len(priority_scores(stats)) == HEADS


def test_same_imputation_of_a_dropped_groups_kv_rows(world1) -> None:
    """'same': a fully dropped group's k/v rows (and its heads' q rows) get the gradient of the last step
    that computed them."""
    model = gpt(**GQA)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation="same", num_microbatches=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    full = step(model, executor, optimizer, batches(60))
    executor.apply(_plan(DROPS))
    resized = step(model, executor, optimizer, batches(61))
    qkv2 = names(2)[0]
    for rows in (kv_rows(1), q_rows(2), q_rows(3)):
        assert torch.equal(resized[qkv2][rows], full[qkv2][rows]) and full[qkv2][rows].abs().max() > 0
    assert not torch.equal(resized[qkv2][kv_rows(0)], full[qkv2][kv_rows(0)])  # computed: a fresh gradient
