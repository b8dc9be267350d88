"""Reshard plans (megahet/policy/reshard_plan.py, run by megahet/runtime/state_move.py): minimal and exact.

Every element of every key of a tiny model carries its own id. The old and new layouts' states are
built independently: the TP x PP shards by the rank-0 reshard's own `shard` (megahet/checkpointing/
convert.py), the ZeRO fragments by flattening each parameter group, padding it and cutting it in DP
equal parts. Running the plan on the old state must give the new state exactly; no rank may receive
an element it held, nor one twice; and the elements moved must be the minimum, the elements whose
owner changes (counted from the ids).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from megahet.checkpointing.convert import ShardLayout, shard
from megahet.checkpointing.state_slices import apply_plan, keep
from megahet.policy.reshard_plan import (
    KEYS,
    OPTIMIZER_KEYS,
    WEIGHT,
    Layout,
    decays,
    intersect,
    model_params,
    rank_holdings,
    reshard_plan,
    stage_params,
    subtract,
    zero_fragments,
)

V, H, FFN, LAYERS = 16, 8, 32, 4


def shapes(untied: bool) -> list[tuple[str, tuple[int, ...]]]:
    out = [("embedding.word_embeddings.weight", (V, H)), ("embedding.position_embeddings.weight", (6, H))]
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attention.linear_qkv.weight", (3 * H, H)),
            (p + "self_attention.linear_qkv.bias", (3 * H,)),
            (p + "self_attention.linear_proj.weight", (H, H)),
            (p + "self_attention.linear_proj.bias", (H,)),
            (p + "mlp.linear_fc1.weight", (FFN, H)),
            (p + "mlp.linear_fc1.bias", (FFN,)),
            (p + "mlp.linear_fc2.weight", (H, FFN)),
            (p + "mlp.linear_fc2.bias", (H,)),
        ]
    out.append(("decoder.final_layernorm.weight", (H,)))
    if untied:
        out.append(("output_layer.weight", (V, H)))
    return out


def ids(params) -> dict[str, dict[str, torch.Tensor]]:
    """key -> name -> the full tensor of unique element ids."""
    out, start = {}, 0
    for key in KEYS:
        out[key] = {}
        for p in params:
            out[key][p.name] = torch.arange(start, start + p.numel, dtype=torch.int64).view(p.shape)
            start += p.numel
    return out


def reference(params, layout: Layout, gated: bool) -> dict[int, dict[tuple[str, str], torch.Tensor]]:
    """Every rank's flat state, built without the plan's frame: convert.shard for TP x PP, explicit
    flatten-pad-cut for ZeRO."""
    full = ids(params)
    shard_layout = ShardLayout(gated=gated, tied=layout.tied)
    sharded = {k: shard(full[k], layout.tp, layout.pp, layout.split, shard_layout) for k in KEYS}
    out = {}
    for stage in range(layout.pp):
        named = stage_params(params, layout, stage)
        for t in range(layout.tp):
            local = {k: sharded[k][stage][t] for k in KEYS}
            for d in range(layout.dp):
                state = {(p.name, WEIGHT): local[WEIGHT][n].reshape(-1) for n, p in named}
                for g in (True, False):
                    members = [(n, p) for n, p in named if decays(n, len(p.shape)) == g]
                    for key in OPTIMIZER_KEYS:
                        flat = torch.cat([local[key][n].reshape(-1) for n, _ in members] or [torch.zeros(0)])
                        flat = flat.long()
                        padded = math.ceil(flat.numel() / (2 * layout.dp)) * 2 * layout.dp
                        part = padded // layout.dp
                        offset = 0
                        for n, p in members:
                            numel = local[key][n].numel()
                            lo, hi = max(offset, d * part), min(offset + numel, (d + 1) * part)
                            state[(p.name, key)] = flat[lo:hi] if hi > lo else flat[:0]
                            offset += numel
                out[layout.rank(d, stage, t)] = state
    return out


CHANGES = [
    ("re-split one layer", Layout(2, 2, 2, (2, 2)), Layout(2, 2, 2, (3, 1))),
    ("re-split two layers", Layout(1, 2, 1, (3, 1)), Layout(1, 2, 1, (1, 3))),
    ("DP 2 -> 1", Layout(2, 1, 2, (4,)), Layout(2, 1, 1, (4,))),
    ("DP 1 -> 3", Layout(1, 1, 1, (4,)), Layout(1, 1, 3, (4,))),
    ("TP 2 -> 1", Layout(2, 2, 1, (2, 2)), Layout(1, 2, 1, (2, 2))),
    ("TP 1 -> 4", Layout(1, 1, 2, (4,)), Layout(4, 1, 1, (4,))),
    ("TP 4 -> 2", Layout(4, 1, 1, (4,)), Layout(2, 1, 2, (4,))),
    ("TP 2 x PP 2 -> TP 1 x DP 4", Layout(2, 2, 1, (2, 2)), Layout(1, 1, 4, (4,))),
    ("PP 1 -> 2 (the tied copy appears)", Layout(2, 1, 2, (4,)), Layout(2, 2, 1, (1, 3))),
    ("PP 2 -> 1 (the tied copy goes)", Layout(1, 2, 2, (2, 2)), Layout(1, 1, 4, (4,))),
    ("elastic 4 -> 2: TP 2 x PP 2 -> TP 2 x PP 1", Layout(2, 2, 1, (2, 2)), Layout(2, 1, 1, (4,))),
    (
        "TP 4 -> 2, strided (ranks 1 and 3 in one group)",
        Layout(4, 1, 1, (4,)),
        Layout(2, 1, 2, (4,), strided=True),
    ),
    ("TP 2 x DP 2 strided -> consecutive", Layout(2, 1, 2, (4,), strided=True), Layout(2, 1, 2, (4,))),
]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize(("what", "old", "new"), CHANGES, ids=[c[0] for c in CHANGES])
def test_the_plan_gives_the_new_layout_exactly_and_moves_only_what_changes_owner(
    what, old, new, gated, untied
):
    old, new = (dataclasses.replace(lay, tied=not untied) for lay in (old, new))
    params = model_params(shapes(untied), gated=gated)
    before, expected = reference(params, old, gated), reference(params, new, gated)
    plan = reshard_plan(params, old, new)
    got = apply_plan(plan, params, before, dict.fromkeys(KEYS, torch.int64))
    assert got.keys() == expected.keys()
    for r, state in expected.items():
        assert got[r].keys() == state.keys(), r
        for k, want in state.items():
            assert torch.equal(got[r][k], want), (what, r, k)
    # minimal: a rank receives only ids it did not hold, each once; the total is the ids whose owner changes
    minimum = 0
    for r, state in expected.items():
        for (name, key), want in state.items():
            held = set(before.get(r, {}).get((name, key), torch.zeros(0, dtype=torch.long)).tolist())
            minimum += len(set(want.tolist()) - held)
    received: dict[tuple[int, str, str], list[tuple[int, int]]] = {}
    for t in plan.transfers:
        received.setdefault((t.dst, t.name, t.key), []).append((t.start, t.stop))
    assert plan.moved() == minimum, what
    for runs in received.values():  # nothing moves twice
        assert sum(b - a for a, b in runs) == len({i for a, b in runs for i in range(a, b)})


def test_the_same_layout_moves_nothing_and_a_one_layer_resplit_at_dp1_moves_that_layer():
    params = model_params(shapes(untied=False))
    same = reshard_plan(params, Layout(2, 2, 2, (2, 2)), Layout(2, 2, 2, (2, 2)))
    assert same.transfers == () and same.moved() == 0
    plan = reshard_plan(params, Layout(2, 2, 1, (2, 2)), Layout(2, 2, 1, (3, 1)))
    # both TP ranks' shards of layer 2: the split tensors once, the replicated ones (norms, biases) twice
    layer2 = sum(p.numel if p.dim is not None else 2 * p.numel for p in params if p.layer == 2)
    assert plan.moved() == len(KEYS) * layer2
    assert {t.name for t in plan.transfers} == {p.name for p in params if p.layer == 2}
    assert {(t.src, t.dst) for t in plan.transfers} == {(2, 0), (3, 1)}  # stage 1's TP ranks -> stage 0's


def test_zero_fragments_cut_each_padded_group_in_equal_parts():
    # a group of 5 + 4 elements over DP 2: padded to 12, parts of 6: [0, 6) and [6, 12)
    assert zero_fragments([[5, 4]], 2) == [[(0, 5), (0, 1)], [(0, 0), (1, 4)]]
    frags = zero_fragments([[7, 3, 11], [2]], 3)
    for g, sizes in enumerate([[7, 3, 11], [2]]):
        for i, n in enumerate(sizes):
            idx = i if g == 0 else 3 + i
            covered = sorted(x for d in range(3) for x in range(*frags[d][idx]))
            assert covered == list(range(n))


def test_run_arithmetic():
    a = np.array([[0, 10], [20, 30]])
    b = np.array([[5, 25]])
    assert intersect(a, b).tolist() == [[5, 10], [20, 25]]
    assert subtract(a, b).tolist() == [[0, 5], [25, 30]]
    assert subtract(b, a).tolist() == [[10, 20]]


def test_a_plan_between_different_models_names_the_problem():
    params = model_params(shapes(untied=False))
    with pytest.raises(ValueError, match="split"):
        reshard_plan(params, Layout(1, 2, 1, (2, 2)), Layout(1, 2, 1, (2, 3)))


@pytest.mark.parametrize(("what", "old", "new"), CHANGES, ids=[c[0] for c in CHANGES])
def test_keeping_by_view_gives_what_copying_gives(what, old, new):
    """`keep(share=True)` (the re-split: no pass over the kept state) takes a view of the old flat tensor
    where the rank keeps the whole of a new holding in one stretch, and copies elsewhere: the kept
    elements are those of the copy, and elements to be received stay untouched."""
    params = model_params(shapes(untied=False))
    states = reference(params, old, gated=False)
    plan = reshard_plan(params, old, new)
    views = 0
    for r in range(new.world):
        before = rank_holdings(params, old, r, plan.blocks) if r < old.world else {}
        after = rank_holdings(params, new, r, plan.blocks)
        copied, shared = (
            {k: torch.full((h.hi - h.lo,), -1, dtype=torch.int64) for k, h in after.items()} for _ in "ab"
        )
        keep(states.get(r, {}), before, after, copied)
        keep(states.get(r, {}), before, after, shared, share=True)
        for k in after:
            assert torch.equal(shared[k], copied[k]), (what, r, k)
            old_storage = states[r][k].untyped_storage().data_ptr() if k in states.get(r, {}) else None
            views += shared[k].untyped_storage().data_ptr() == old_storage
    if what.startswith("re-split"):  # most of a stage stays where it is
        assert views > len(params), (what, views)
