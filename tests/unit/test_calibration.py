"""The layout planner's calibration (issue 30): a profiling run's trace -> the cost model's measured
constants -> every plan's prediction.

- `fit_calibration` recovers the efficiency, the compute outside the layers, the latency and the
  per-step time that made a synthetic profile (TP 2 and TP 1).
- A calibrated DP plan's prediction is the profile's own arithmetic: micro-batches x (layers + extra)
  plus the step and the reduction; the latency is charged to every TP all-reduce and pipeline send.
- Bad profiles are one-line errors; benchmarks/plan_accuracy.py's device profile follows the plan's
  node order.

The synthetic profile and the expected predictions are written here from textbook formulas (a layer's
24 h^2 + 2 s h forward FLOPs per token, a ring all-reduce's 2 (n - 1) / n of the bytes, the GPT's
parameters counted by hand), never with the cost model's own functions (issue 49: with them, a cost
model 10x off in its all-reduce left these tests passing). `test_the_tests_catch_a_wrong_cost_model`
makes that mistake on purpose.

Run: ``python -m pytest tests/unit/test_calibration.py -q`` (a second).
"""

from __future__ import annotations

import json

import pytest
from one_line import one_line

from benchmarks.plan_accuracy import VirtualCluster, chosen
from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.layout_plan import read_calibration
from megahet.policy.calibration import Calibration, Profile, fit_calibration, node_tflops
from megahet.policy.cluster import parse_cluster
from megahet.policy.layout_cost import ELEMENT_BYTES, STATE_BYTES, ModelShape
from megahet.policy.layout_search import TrainSetting, evaluate

L, H, S, V = 4, 64, 32, 1024  # layers, hidden (4 heads, ffn 4 h), sequence, vocabulary
SHAPE = ModelShape(layers=L, hidden=H, heads=4, query_groups=4, ffn=4 * H, seq=S, vocab=V)
TFLOPS, GBPS = 0.01, 2.0
TRUE = {"efficiency": 0.8, "extra_per_sample": 0.004, "latency": 0.0015, "step": 0.12}
FORWARD_FLOPS_PER_TOKEN = 24 * H * H + 2 * S * H
"""Narayanan et al.: 24 h^2 per token for the projections and a 4h MLP, and 4 s h for the scores and
values, of which a causal kernel computes half."""


def _ring(nbytes: float, ranks: int) -> float:
    """A ring all-reduce: every rank sends and receives 2 (n - 1) / n of the bytes over its link."""
    return 2 * (ranks - 1) / ranks * nbytes / (GBPS * 1e9) if ranks > 1 else 0.0


def _rank_params(tp: int) -> int:
    """Every parameter of the 4-layer GPT on one of `tp` ranks (one stage, tied embedding): per layer QKV
    3 h^2 + 3 h and fc1 4 h^2 + 4 h split with their biases, the projection h^2 and fc2 4 h^2 split
    without theirs (2 h, replicated, with the two LayerNorms' 4 h); the word embedding V h split, the
    learned positions S h and the final LayerNorm 2 h."""
    split, replicated = 12 * H * H + 7 * H, 6 * H
    return L * (split // tp + replicated) + V * H // tp + S * H + 2 * H


def _layer_s(micro_batch: int, tp: int, efficiency: float = TRUE["efficiency"]) -> float:
    """One layer's forward and backward (3x the forward FLOPs) on one micro-batch, on one of `tp` ranks."""
    return 3 * FORWARD_FLOPS_PER_TOKEN * S * micro_batch / tp / (efficiency * TFLOPS * 1e12)


def _trace(
    tp: int,
    dp: int,
    micro_batch: int,
    microbatches: int,
    steps: int = 6,
    efficiency: float = TRUE["efficiency"],
    extra: float = TRUE["extra_per_sample"],
) -> list[dict]:
    """Trace rows a run with the TRUE constants would write (every rank alike)."""
    passes = L * microbatches
    layers_s = passes * _layer_s(micro_batch, tp, efficiency)
    compute = layers_s + microbatches * extra * micro_batch / tp
    activation = 4 * S * micro_batch * H  # fp32 bytes
    wait = 4 * passes * (TRUE["latency"] + _ring(activation, tp)) if tp > 1 else 0.0
    gradients = 4 * _rank_params(tp)  # fp32
    sync = (TRUE["latency"] if tp > 1 else 0.0) + _ring(gradients, dp)
    sync = sync if dp > 1 else 0.0  # one replica reduces nothing
    step = compute + wait + sync + TRUE["step"]
    cell = lambda v: [[v] * tp for _ in range(dp)]
    return [
        {"step": s, "step_s": step * (3 if s == 1 else 1), "microbatches": [microbatches] * dp,
         "busy_s": cell(layers_s), "compute_s": cell(compute), "wait_s": cell(wait)}
        for s in range(1, steps + 1)
    ]  # fmt: skip


def _fit(tp: int, dp: int = 2, micro_batch: int = 2, microbatches: int = 4) -> Calibration:
    rows = _trace(tp, dp, micro_batch, microbatches)
    profile = Profile.from_trace_rows(rows, SHAPE.layers, micro_batch * microbatches * dp, skip=2)
    assert (profile.tp, profile.dp, profile.micro_batch, profile.microbatches) == (
        tp,
        dp,
        micro_batch,
        microbatches,
    )
    return fit_calibration(profile, SHAPE, reference_tflops=TFLOPS, precision="fp32", link_gbps=GBPS)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_fit_recovers_what_made_the_profile(tp: int) -> None:
    cal = _fit(tp)
    assert cal.layer_efficiency == pytest.approx(TRUE["efficiency"])
    assert cal.extra_s_per_sample == pytest.approx(TRUE["extra_per_sample"])
    assert cal.step_s == pytest.approx(TRUE["step"])
    assert cal.latency_s == pytest.approx(TRUE["latency"] if tp > 1 else 0.0)
    assert cal.extra_seconds(micro_batch=2, tflops=TFLOPS / 2) == pytest.approx(
        2 * 2 * TRUE["extra_per_sample"]
    )
    frozen = Calibration(**{**cal.__dict__, "extra_follows_rate": False})
    assert frozen.extra_seconds(micro_batch=2, tflops=TFLOPS / 2, tp=2) == pytest.approx(
        TRUE["extra_per_sample"]
    )


def _cluster(gpus: int, tflops: tuple[float, ...] = (TFLOPS, TFLOPS)):
    """Nodes of `gpus` devices each, of the given rates, linked at GBPS inside and between them."""
    nodes = [
        {
            "name": f"n{i}",
            "gpus": gpus,
            "memory_gib": 8,
            "tflops": t,
            "intra_gbps": GBPS,
            "network_gbps": GBPS,
        }
        for i, t in enumerate(tflops)
    ]
    return parse_cluster({"nodes": nodes}, "test", "fp32")


@pytest.mark.parametrize("gpus", [1, 2])
def test_node_rates_are_what_each_node_ran_at(gpus: int) -> None:
    """Node speeds read from a profiling run across the cluster, not declared (issue 49, item 2): two
    nodes of `gpus` ranks (TP `gpus`, one replica per node), node 1's ranks 2.5x as long in the layers (a
    tenant sharing their cores). Each node's rate is the layers' FLOPs over its own time; a run whose
    ranks do not fill whole nodes is refused."""
    rows = _trace(tp=gpus, dp=2, micro_batch=2, microbatches=3)
    for row in rows:
        row["busy_s"][1] = [t * 2.5 for t in row["busy_s"][1]]
    profile = Profile.from_trace_rows(rows, L, global_batch=2 * 2 * 3, skip=2)
    rate = TRUE["efficiency"] * TFLOPS  # TFLOP/s: what _layer_s charges
    assert node_tflops(profile, SHAPE, gpus) == pytest.approx([rate, rate / 2.5], rel=1e-9)
    with pytest.raises(ValueError, match="whole nodes"):
        node_tflops(profile, SHAPE, 3)


def test_a_calibrated_plan_predicts_the_profiles_own_arithmetic() -> None:
    cal = _fit(tp=2)
    cluster = _cluster(gpus=2)
    setting = TrainSetting(global_batch=16, micro_batches=(2,), precision="fp32", calibration=cal)
    plan = evaluate(cluster, SHAPE, setting, tp=1, pp=1, micro_batch=2, zero_stage=1, node_order=(0, 1))
    per_micro = L * _layer_s(2, 1) + 2 * TRUE["extra_per_sample"]
    sync = TRUE["latency"] + _ring(4 * _rank_params(1), 4)
    assert plan.step_s == pytest.approx(2 * per_micro + sync + TRUE["step"])
    tp2 = evaluate(cluster, SHAPE, setting, tp=2, pp=1, micro_batch=2, zero_stage=1, node_order=(0, 1))
    uncharged = TrainSetting(global_batch=16, micro_batches=(2,), precision="fp32",
                             calibration=Calibration(**{**cal.__dict__, "latency_s": 0.0}))  # fmt: skip
    free = evaluate(cluster, SHAPE, uncharged, tp=2, pp=1, micro_batch=2, zero_stage=1, node_order=(0, 1))
    # 4 micro-batches per replica x 4 layers x 4 all-reduces, and one DP reduction
    assert tp2.step_s - free.step_s == pytest.approx((4 * 4 * 4 + 1) * TRUE["latency"])


def test_a_slow_node_takes_longer_for_the_work_outside_the_layers() -> None:
    """A node at half the reference rate runs the extra compute and its optimizer step in twice the time
    (a real slow device, or a tenant sharing it); virtual devices (extra_follows_rate False) slow only the
    layers. A DP plan over a fast and a slow node waits for the slow replica's optimizer step."""
    cal = _fit(tp=1)
    cluster = _cluster(gpus=1, tflops=(TFLOPS, TFLOPS / 2))
    setting = lambda c: TrainSetting(global_batch=16, micro_batches=(2,), precision="fp32", calibration=c)
    frozen = Calibration(**{**cal.__dict__, "extra_follows_rate": False})
    plans = [
        evaluate(cluster, SHAPE, setting(c), tp=1, pp=1, micro_batch=2, zero_stage=1, node_order=(0, 1))
        for c in (cal, frozen)
    ]
    assert cal.step_seconds(TFLOPS / 2) == pytest.approx(2 * TRUE["step"])
    assert frozen.step_seconds(TFLOPS / 2) == pytest.approx(TRUE["step"])
    # the shares differ (the extra compute follows the rate, or not), the step's own work by the factor 2
    assert plans[0].step_s > plans[1].step_s + TRUE["step"] * 0.99


def test_several_profiles_give_the_efficiency_per_micro_batch_size() -> None:
    """Profiles at micro-batch sizes 1 and 4 (larger GEMMs run faster: efficiency 0.5 and 0.8, extra
    compute 6 and 3 ms per sample): each size gets its own, a size between them the log-tokens mix (2 is
    halfway from 1 to 4), sizes outside the ends' values; a plan at size 4 is charged size 4's layers.
    Profiles of different layouts, or of one size twice, are refused."""

    def profile(mb: int, efficiency: float, extra: float, tp: int = 1) -> Profile:
        rows = _trace(tp, 2, mb, 16 // (2 * mb), efficiency=efficiency, extra=extra)
        return Profile.from_trace_rows(rows, L, global_batch=16, skip=2)

    small, large = profile(1, 0.5, 0.006), profile(4, 0.8, 0.003)
    kwargs = {"reference_tflops": TFLOPS, "precision": "fp32", "link_gbps": GBPS}
    cal = fit_calibration([small, large], SHAPE, **kwargs)
    assert [cal.efficiency(mb * S) for mb in (1, 2, 4, 8)] == pytest.approx([0.5, 0.65, 0.8, 0.8])
    assert cal.extra_seconds(2, TFLOPS, tokens=2 * S) == pytest.approx(2 * 0.0045)
    assert cal.step_s == pytest.approx(TRUE["step"])
    cluster = _cluster(gpus=1)
    setting = TrainSetting(global_batch=16, micro_batches=(4,), precision="fp32", calibration=cal)
    plan = evaluate(cluster, SHAPE, setting, tp=1, pp=1, micro_batch=4, zero_stage=1, node_order=(0, 1))
    per_micro = L * _layer_s(4, 1, 0.8) + 4 * 0.003
    sync = _ring(4 * _rank_params(1), 2)
    assert plan.step_s == pytest.approx(2 * per_micro + sync + TRUE["step"])
    with pytest.raises(ValueError, match="different layouts"):
        fit_calibration([small, profile(4, 0.8, 0.003, tp=2)], SHAPE, **kwargs)
    with pytest.raises(ValueError, match="same micro-batch size"):
        fit_calibration([small, small], SHAPE, **kwargs)


def test_the_independent_formulas_are_the_cost_models_inputs() -> None:
    """The hand-written counts are the shape's (so the fits below compare like with like)."""
    assert SHAPE.layer_flops(S) == FORWARD_FLOPS_PER_TOKEN * S
    assert [SHAPE.rank_params(tp, L, first=True, last=True) for tp in (1, 2)] == [
        _rank_params(1),
        _rank_params(2),
    ]
    assert STATE_BYTES["fp32"][1] == 4 and ELEMENT_BYTES["fp32"] == 4  # the gradients' and activations' bytes


@pytest.mark.parametrize(
    "target, wrong",
    [
        ("all_reduce_seconds", lambda f: lambda *a: 10 * f(*a)),
        ("transformer_layer_flops", lambda f: lambda *a, **k: 2 * f(*a, **k)),
    ],
)
def test_the_tests_catch_a_wrong_cost_model(monkeypatch, target: str, wrong) -> None:
    """The mutations of issue 49's review: the cost model's all-reduce 10x off, its layer FLOPs 2x off.
    Its own fit then no longer recovers the constants that made the profile, or its plan no longer
    predicts the profile's arithmetic."""
    from megahet.policy import calibration, layout_cost

    module = layout_cost if target == "transformer_layer_flops" else calibration
    monkeypatch.setattr(module, target, wrong(getattr(module, target)))
    if module is calibration:
        monkeypatch.setattr(layout_cost, target, wrong(getattr(layout_cost, target)))
    with pytest.raises(AssertionError):
        test_the_fit_recovers_what_made_the_profile(2)
        test_a_calibrated_plan_predicts_the_profiles_own_arithmetic()


def _cfg(tmp_path, profile: str | None, node: int = 0) -> tuple[MegahetConfig, object]:
    cfg = apply_overrides(
        MegahetConfig(), {"model.num_layers": 4, "plan.profile": profile, "plan.profile_node": node}
    )
    cluster = parse_cluster({"nodes": [{"kind": "A100-80GB", "gpus": 2}]}, "test", "fp32")
    return cfg, cluster


def test_a_profile_file_calibrates_the_plan_and_bad_ones_are_one_line_errors(tmp_path) -> None:
    cfg, cluster = _cfg(tmp_path, None)
    assert read_calibration(cfg, cluster, 1024) is None
    good = tmp_path / "profile.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in _trace(2, 1, 4, 2)))
    cfg, cluster = _cfg(tmp_path, str(good))
    cfg.train.global_batch_size = 8
    cal = read_calibration(cfg, cluster, 1024)
    assert cal is not None and cal.reference_tflops == cluster.nodes[0].tflops and cal.latency_s > 0
    assert cal.step_s == pytest.approx(TRUE["step"])  # one replica: no reduction taken off
    larger = tmp_path / "profile_mb8.jsonl"  # the same layout at micro-batch 8: the rate per size
    larger.write_text("\n".join(json.dumps(r) for r in _trace(2, 1, 8, 1, efficiency=0.9)))
    cfg, cluster = _cfg(tmp_path, f"{good}, {larger}")
    cfg.train.global_batch_size = 8
    sized = read_calibration(cfg, cluster, 1024)
    seq = cfg.model.seq_length  # the config's model (its efficiency, in its FLOPs: compared as a ratio)
    assert [p.tokens for p in sized.sizes] == [4 * seq, 8 * seq]
    assert sized.efficiency(8 * seq) / sized.efficiency(4 * seq) == pytest.approx(0.9 / TRUE["efficiency"])
    other = tmp_path / "profile_tp1.jsonl"
    other.write_text("\n".join(json.dumps(r) for r in _trace(1, 2, 4, 1)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 5, "busy_s": [[1.0]]}\n')
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(json.dumps(r) for r in _trace(2, 1, 4, 2, steps=2)))
    uneven = tmp_path / "uneven.jsonl"
    uneven.write_text("\n".join(json.dumps({**r, "microbatches": [3, 1]}) for r in _trace(2, 2, 2, 2)))
    for path, node, needles in [
        (tmp_path / "missing.jsonl", 0, ("plan.profile", "not found", "--balance.trace")),
        (good, 3, ("plan.profile_node 3", "0..0")),
        (bad, 0, ("plan.profile", "micro-batch counts")),
        (short, 0, ("plan.profile", "profile more steps")),
        (uneven, 0, ("plan.profile", "uneven")),
        (f"{good},{other}", 0, ("plan.profile", "different layouts")),
    ]:
        cfg, cluster = _cfg(tmp_path, str(path), node)
        with pytest.raises(ConfigError) as err:
            read_calibration(cfg, cluster, 1024)
        one_line(err, *needles)


def test_the_benchmark_runs_each_plan_on_its_node_order() -> None:
    vc = VirtualCluster("t", gpus=2, speeds=(1.0, 0.5, 0.25))
    assert vc.device_profile((0, 1, 2)) == "static:1,1,0.5,0.5,0.25,0.25"
    assert vc.device_profile((2, 0, 1)) == "static:0.25,0.25,1,1,0.5,0.5"
    assert [n.tflops for n in vc.cluster().nodes] == pytest.approx([0.005, 0.0025, 0.00125])
    assert chosen(list(range(10)), top=3, low=2) == [0, 1, 2, 5, 9]
    assert chosen(list(range(3)), top=3, low=2) == [0, 1, 2]
