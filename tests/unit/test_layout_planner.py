"""The layout planner's pure parts (issue 30): cluster descriptions, the cost model against megahet's own
measured figures, and the search.

- A cluster file expands `count` nodes in launch order; every bad description is a one-line error.
- The cost model's parameters equal a built GPT's (GPT-2 and Llama shapes), its activation bytes are what
  a built layer keeps for its backward (GPT-2 shape; a lower bound for Llama on CPU), its FLOPs equal the
  resizable layers' executed-FLOP counters, and its optimizer bytes per parameter equal a real DeepSpeed engine's
  Adam state (fp32 and bf16).
- The search returns only plans that run (TP inside a node, TP x PP x DP = world, splits summing to
  the layers, shares to the micro-batches), fit in memory and pass the caller's checks; its Pareto set
  equals brute force; faster GPUs get more layers (PP) and more micro-batches (DP).

Run: ``python -m pytest tests/unit/test_layout_planner.py -q`` (a few seconds).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from one_line import one_line

from megahet.compat.deepspeed_zero import FP32_PARTITIONS
from megahet.config import MegahetConfig, apply_overrides
from megahet.layout_plan import plan_table
from megahet.policy.cluster import Cluster, Node, parse_cluster, read_cluster
from megahet.policy.gpu_kinds import GPU_KINDS
from megahet.policy.layout_cost import STATE_BYTES, ModelShape, one_f_one_b_seconds, rank_memory_bytes
from megahet.policy.layout_search import TrainSetting, evaluate, node_orders, pareto, search

SMALL = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.num_attention_heads": 4,
    "model.seq_length": 32,
}
LLAMA = {
    "model.activation": "swiglu", "model.normalization": "RMSNorm", "model.position_embedding_type": "rope",
    "model.num_query_groups": 2, "model.add_bias_linear": False, "model.ffn_hidden_size": 160,
    "model.untie_embeddings_and_output_weights": True,
}  # fmt: skip


def _cfg(**overrides) -> MegahetConfig:
    return apply_overrides(MegahetConfig(), {**SMALL, **overrides})


# --- cluster descriptions -------------------------------------------------------------------------


def test_a_cluster_file_lists_its_nodes_in_launch_order(tmp_path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n"
        "  - {kind: A100-80GB, gpus: 8, count: 2}\n"
        "  - {kind: V100-32GB, gpus: 8, tflops: 14.2}\n"
        "  - {name: box, gpus: 8, memory_gib: 24, tflops: 35.6, intra_gbps: 16, network_gbps: 3}\n"
        "network_gbps: 25\n"
    )
    cluster = read_cluster(str(path), precision="fp32")
    assert [n.name for n in cluster.nodes] == ["A100-80GB-0", "A100-80GB-1", "V100-32GB", "box"]
    assert cluster.world_size == 32 and cluster.node_of(17) == 2
    a100 = GPU_KINDS["A100-80GB"]
    assert cluster.nodes[0] == Node("A100-80GB-0", 8, 80, a100.fp32_tflops, a100.nvlink_gbps, 25.0)
    assert cluster.nodes[2].tflops == 14.2 and cluster.nodes[3].network_gbps == 3.0
    assert cluster.rank_tflops()[15:17] == [a100.fp32_tflops, 14.2]


@pytest.mark.parametrize(
    "data, needles",
    [
        ([1, 2], ["a `nodes:` list"]),
        ({"nodes": []}, ["non-empty list"]),
        ({"nodes": [{"kind": "B300", "gpus": 8}]}, ["unknown GPU kind 'B300'", "A100-80GB"]),
        ({"nodes": [{"kind": "A100-80GB"}]}, ["nodes[0]: gpus must be a whole number"]),
        ({"nodes": [{"kind": "A100-80GB", "gpus": 8, "count": 0}]}, ["count must be a whole number"]),
        ({"nodes": [{"kind": "A100-80GB", "gpus": 8, "colour": 1}]}, ["unknown key(s) ['colour']"]),
        ({"nodes": [{"gpus": 2, "tflops": 1}]}, ["without a kind, give memory_gib, intra_gbps"]),
        ({"nodes": [{"kind": "V100-32GB", "gpus": 8}]}, ["V100-32GB has no bf16", "train.precision fp32"]),
        ({"nodes": [{"kind": "A10", "gpus": 8, "tflops": -3}]}, ["tflops must be a positive number"]),
        (
            {"nodes": [{"kind": "A10", "gpus": 8}, {"kind": "A10", "gpus": 4}]},
            ["[4, 8] GPUs", "--nproc-per-node"],
        ),
        ({"nodes": [{"kind": "A10", "gpus": 8}], "network": 1}, ["unknown key(s) ['network']"]),
    ],
)
def test_bad_cluster_descriptions_are_one_line_errors(data, needles) -> None:
    with pytest.raises(ValueError) as err:
        parse_cluster(data, "c.yaml", precision="bf16")
    one_line(err, "c.yaml", *needles)


def test_missing_or_broken_cluster_files_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError) as err:
        read_cluster(str(tmp_path / "none.yaml"), "bf16")
    one_line(err, "not found", "--cluster")
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    with pytest.raises(ValueError) as err:
        read_cluster(str(tmp_path / "bad.yaml"), "bf16")
    one_line(err, "not valid YAML")


# --- the cost model against megahet's measured figures -------------------------------------------


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_parameters_are_a_built_gpts(world1, extra) -> None:
    from megahet.models.gpt import build_gpt

    cfg = _cfg(**extra)
    model = build_gpt(cfg, 1000)
    assert ModelShape.of(cfg.model, 1000, tp=1).rank_params(1, 2, first=True, last=True) == sum(
        p.numel() for p in model.parameters()
    )


def _saved_bytes(cfg: MegahetConfig, batch: int) -> int:
    """Bytes autograd keeps for the backward of one forward (storages counted once, parameters excluded)."""
    from megahet.models.gpt import build_gpt

    model = build_gpt(cfg, 1000)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    tokens = torch.randint(0, 1000, (batch, cfg.model.seq_length))
    positions = torch.arange(cfg.model.seq_length).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None, labels=tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_activation_memory_is_what_a_built_layer_keeps(world1, extra) -> None:
    """A layer's saved tensors (4 layers' minus 2 layers', per layer) against the count. CPU attention is
    the math kernel: it keeps the s x s probabilities, which flash attention does not, so they are taken
    off. GPT-2 shape: the rest is the count within 15 % (measured 0.88: CPU shares some of the inputs the
    count lists apart). Llama shape: the count is a lower bound, and the rest is under half of it (measured
    1.48x: on CPU RoPE and SwiGLU keep copies, and the math kernel repeats the grouped K and V per head)."""
    batch = 3
    off = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}
    two, four = (_saved_bytes(_cfg(**extra, **off, **{"model.num_layers": n}), batch) for n in (2, 4))
    cfg = _cfg(**extra)
    probabilities = 4 * batch * cfg.model.num_attention_heads * cfg.model.seq_length**2
    measured = (four - two) / 2 - probabilities
    counted = ModelShape.of(cfg.model, 1000, tp=1).layer_activation_bytes(batch, tp=1, precision="fp32")
    if extra:  # from both sides (issue 49): the copies the count leaves out are under half of it
        assert counted <= measured <= 1.5 * counted, measured / counted
    else:
        assert measured == pytest.approx(counted, rel=0.15)


@pytest.mark.parametrize("extra", [{}, LLAMA], ids=["gpt2", "llama"])
def test_flops_are_the_resizable_layers_counters(world1, extra) -> None:
    """The counters count the full s x s attention; a causal kernel does half of it."""
    from megahet.models.common import resizable_layer_spec
    from megahet.models.gpt import build_gpt
    from megahet.tensor_parallel.blocks import find_blocks

    cfg = _cfg(**extra)
    model = build_gpt(cfg, 1000, resizable_layer_spec())
    tokens = torch.randint(0, 1000, (3, 32))
    with torch.no_grad():
        model(tokens, torch.arange(32).expand(3, 32), None)
    counted = sum(block.executed_flops for block in find_blocks(model).values())
    shape = ModelShape.of(cfg.model, 1000, tp=1)
    assert 2 * shape.layer_flops(96, causal=False) == counted
    assert shape.layer_flops(96, causal=False) - shape.layer_flops(96) == 2 * 32 * 64 * 96


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_bytes_per_parameter_are_deepspeeds(world1, precision) -> None:
    """Adam's moments and ZeRO's fp32 partition (a copy, in fp32 runs too) in a real ZeRO-1 engine after one
    step, at DP 1."""
    from megahet.engine import build_engine

    cfg = _cfg(**{"train.precision": precision, "train.global_batch_size": 4, "train.micro_batch_size": 4})
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = build_engine(cfg, model, 1, {})
    x = torch.randn(4, 8, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    params = sum(p.numel() for p in model.parameters())
    optimizer = engine.optimizer
    moments = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim()
    )
    masters = getattr(optimizer, FP32_PARTITIONS)
    assert all(m.data_ptr() != p.data_ptr() for m in masters for p in model.parameters())  # copies
    assert moments + sum(m.numel() * m.element_size() for m in masters) == STATE_BYTES[precision][2] * params


def test_memory_splits_the_optimizer_over_dp_and_the_gradients_with_zero2() -> None:
    shape = ModelShape.of(_cfg().model, 1000, tp=1)
    params = shape.rank_params(1, 2, True, True)
    common = {
        "tp": 1,
        "layers": 2,
        "first": True,
        "last": True,
        "pp": 1,
        "in_flight": 0,
        "micro_batch": 1,
        "precision": "bf16",
    }
    assert rank_memory_bytes(shape, dp=1, zero_stage=1, **common) == 16 * params
    assert rank_memory_bytes(shape, dp=4, zero_stage=1, **common) == (2 + 2 + 12 / 4) * params
    assert rank_memory_bytes(shape, dp=4, zero_stage=2, **common) == (2 + (2 + 12) / 4) * params


def test_one_f_one_b_crosses_every_stage_once_then_follows_the_slowest() -> None:
    assert one_f_one_b_seconds([1.0, 3.0, 2.0], microbatches=4) == 6.0 + 3 * 3.0


# --- the search ------------------------------------------------------------------------------------


def _cluster(rates_by_node, gpus=2, memory_gib=4.0) -> Cluster:
    return Cluster(tuple(Node(f"n{i}", gpus, memory_gib, r, 10.0, 1.0) for i, r in enumerate(rates_by_node)))


def _shape_for(tp: int) -> ModelShape:
    return ModelShape.of(_cfg(**{"model.num_layers": 8, "model.seq_length": 64}).model, 1000, tp)


SETTING = TrainSetting(global_batch=16, micro_batches=(1, 2, 4), precision="fp32")


def test_every_plan_runs_fits_and_passes_the_callers_checks() -> None:
    cluster = _cluster([1.0, 1.0, 0.5, 0.5])
    refused = {(2, 2)}  # the caller's checks refuse TP 2 x PP 2 (e.g. heads not divisible)
    plans = search(cluster, _shape_for, SETTING, fits=lambda plan: (plan.tp, plan.pp) not in refused)
    assert plans and plans == sorted(plans, key=lambda p: (p.step_s, p.peak_gib))
    for p in plans:
        assert (p.tp, p.pp) not in refused and cluster.gpus_per_node % p.tp == 0
        assert p.tp * p.pp * p.dp == cluster.world_size and sum(p.split) == 8 and min(p.split) >= 1
        assert sum(p.shares) == 16 // p.micro_batch and len(p.shares) == p.dp
        assert p.memory_fraction <= 1 and not (p.zero_stage == 2 and p.pp > 1)
    layouts = {(p.tp, p.pp) for p in plans}
    assert layouts == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 4)}


def test_plans_that_do_not_fit_in_memory_are_left_out() -> None:
    roomy = search(_cluster([1.0, 1.0], memory_gib=4.0), _shape_for, SETTING)
    tight_gib = 1.05 * min(p.peak_gib for p in roomy) / (1 - SETTING.memory_reserve)
    tight = search(_cluster([1.0, 1.0], memory_gib=tight_gib), _shape_for, SETTING)
    assert 0 < len(tight) < len(roomy)
    assert all(p.peak_gib <= tight_gib * (1 - SETTING.memory_reserve) for p in tight)
    assert search(_cluster([1.0, 1.0], memory_gib=1e-4), _shape_for, SETTING) == []


def test_the_memory_columns_are_one_gpus_the_fullest() -> None:
    """Issue 49: on a mixed cluster the peak GiB (the largest bytes, on a large GPU) and the fraction (of a
    small GPU) came from different GPUs. Now both are the fullest GPU's, and the plan names it."""
    cluster = Cluster((Node("big", 2, 40.0, 1.0, 10.0, 1.0), Node("small", 2, 1.0, 0.5, 10.0, 1.0)))
    plans = search(cluster, _shape_for, SETTING)
    assert plans
    memory = {node.name: node.memory_gib for node in cluster.nodes}
    for p in plans:
        name, _, rank = p.fullest.split()
        capacity = memory[name] * (1 - SETTING.memory_reserve)
        assert p.peak_gib / capacity == pytest.approx(p.memory_fraction), p
        assert 0 <= int(rank) < cluster.world_size
    # the small GPUs are the fullest in every plan here (a fortieth of the memory, half the work at most)
    assert all(p.fullest.startswith("small") for p in plans)
    table = plan_table(plans, top=3)
    assert "fullest GPU" in table.splitlines()[0] and "small rank" in table.splitlines()[1]


def test_the_pareto_set_is_brute_forces() -> None:
    plans = search(_cluster([1.0, 0.5, 0.5, 0.25]), _shape_for, SETTING)

    def dominated(p) -> bool:
        return any(
            q.step_s <= p.step_s and q.memory_fraction <= p.memory_fraction
            and (q.step_s, q.memory_fraction) != (p.step_s, p.memory_fraction)
            for q in plans
        )  # fmt: skip

    brute = {(p.step_s, p.memory_fraction) for p in plans if not dominated(p)}
    front = pareto(plans)
    assert {(p.step_s, p.memory_fraction) for p in front} == brute
    assert all(
        a.step_s <= b.step_s and a.memory_fraction > b.memory_fraction for a, b in itertools.pairwise(front)
    )


def test_faster_gpus_take_more_micro_batches_and_more_layers() -> None:
    cluster = _cluster([1.0, 0.5])
    common = {"micro_batch": 1, "zero_stage": 1, "node_order": (0, 1)}
    dp = evaluate(cluster, _shape_for(1), SETTING, tp=1, pp=1, **common)
    assert sum(dp.shares) == 16 and dp.shares[0] == dp.shares[1] > dp.shares[2] == dp.shares[3]
    assert dp.overrides()["hetero.dp_shares"] == "declared"
    speeds = [float(s) for s in dp.overrides()["hetero.speeds"].split(",")]
    assert speeds[0] == 1.0 and speeds[2] == pytest.approx(0.5, rel=0.05)
    pp = evaluate(cluster, _shape_for(2), SETTING, tp=2, pp=2, **common)
    assert (
        pp.split[0] > pp.split[1]
        and pp.overrides()["parallel.stage_layers"] == f"{pp.split[0]},{pp.split[1]}"
    )
    homogeneous = evaluate(_cluster([1.0, 1.0]), _shape_for(1), SETTING, tp=1, pp=1, **common)
    assert homogeneous.shares.even and "hetero.speeds" not in homogeneous.overrides()


def test_launch_orders_are_tried_once_per_distinct_placement() -> None:
    """Two fast and two slow nodes given slow, fast, slow, fast: the orders tried are the placements of
    rates the docstring names, each once (derived from the rates, not the code's index arithmetic): as
    given, fastest first, slowest first, and the kinds interleaved starting with the fastest."""
    rates = [0.5, 1.0, 0.5, 1.0]
    orders = node_orders(_cluster(rates))
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    placed = [tuple(rates[i] for i in order) for order in orders]
    assert placed == [(0.5, 1.0, 0.5, 1.0), (1.0, 1.0, 0.5, 0.5), (0.5, 0.5, 1.0, 1.0), (1.0, 0.5, 1.0, 0.5)]
    # within a kind, nodes keep their given order (a stable sort): the fast ones are 1 then 3
    assert orders[1] == (1, 3, 0, 2)
    assert node_orders(_cluster([1.0, 1.0])) == [(0, 1)]  # one placement of the rates: tried once
    assert len(node_orders(_cluster([1.0, 0.5]))) == 2  # as given (fastest first), slowest first
