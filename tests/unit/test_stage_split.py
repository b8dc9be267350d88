"""Uneven pipeline stages: the pure split planner (megahet/policy/stage_split.py), the checks of
parallel.stage_layers and hetero.pp_split, megatron-core's layout, and checkpoints that record a split.

Run: python -m pytest tests/unit/test_stage_split.py -q
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megahet.checkpointing.convert import consolidate, merge_shards, reshard, shard
from megahet.config import ConfigError, load_config
from megahet.config_checks import stage_split, validate
from megahet.policy.stage_split import (
    StageSplit,
    best_split,
    best_time,
    declared_stage_times,
    layer_ranges,
    megatron_layout,
    model_extra_layers,
    next_split,
    parse_stage_layers,
    split_times,
    stage_speeds,
)


def _all_splits(num_layers: int, pp: int):
    for cuts in itertools.combinations(range(1, num_layers), pp - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def test_best_split_is_optimal_against_every_split():
    rng = random.Random(0)
    for _ in range(300):
        pp = rng.randint(1, 4)
        num_layers = rng.randint(pp, 9)
        layer_s = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) * rng.uniform(0.9, 1.1) for _ in range(pp)]
        extra_s = [rng.choice([0.0, 0.0, 0.7, 2.5]) for _ in range(pp)]
        brute = min(max(split_times(s, layer_s, extra_s)) for s in _all_splits(num_layers, pp))
        split = best_split(layer_s, extra_s, num_layers)
        assert sum(split) == num_layers and min(split) >= 1 and len(split) == pp
        assert max(split_times(split, layer_s, extra_s)) == pytest.approx(brute)
        assert best_time(layer_s, extra_s, num_layers) == pytest.approx(brute)


def test_a_slow_stage_gets_fewer_layers_and_the_output_layer_counts():
    assert best_split([1, 1, 1, 1], [0] * 4, 16) == (4, 4, 4, 4)
    assert best_split([1, 1, 1, 2], [0] * 4, 16) == (5, 5, 4, 2)  # the 2x slow stage: time 4
    assert best_split([1, 1.5], [0, 0], 16) == (10, 6)
    assert best_split([1, 1], [0, 2.5], 16) == (9, 7)  # the last stage's output layer: 2.5 layers


def test_ties_keep_the_preferred_split():
    """Every split reaching the best time is as good: the current one is kept (no layer moves for nothing)."""
    assert best_split([1, 1], [0, 0], 5, prefer=(2, 3)) == (2, 3)
    assert best_split([1, 1], [0, 0], 5, prefer=(3, 2)) == (3, 2)
    assert best_split([1, 1, 1], [0, 0, 0], 6, prefer=(1, 2, 3)) == (2, 2, 2)  # not optimal: moved


def test_next_split_has_hysteresis():
    # (5, 5) -> (6, 4) cuts the slowest stage's time 6.5 -> 6 (7.7 %): moved under 5 % hysteresis only
    assert next_split((5, 5), [1.0, 1.3], [0, 0], hysteresis=0.1) == (5, 5)
    assert next_split((5, 5), [1.0, 1.3], [0, 0], hysteresis=0.05) == (6, 4)
    # (4, 4) -> (5, 3) cuts 8 -> 6 (25 %)
    assert next_split((4, 4), [1.0, 2.0], [0, 0], hysteresis=0.2) == (5, 3)
    assert next_split((4, 4), [1.0, 1.01], [0, 0], hysteresis=0.0) == (4, 4)  # no gain: kept


def test_declared_speeds_give_stage_times():
    speeds = stage_speeds({(0, 0, 0): 1.0, (0, 0, 1): 0.5, (0, 1, 0): 1.0, (0, 1, 1): 1.0}, pp=2)
    assert speeds == [0.5, 1.0]  # a TP group runs at its slowest rank
    assert stage_speeds(
        {(0, 0, 0): 1.0, (0, 0, 1): 0.5, (0, 1, 0): 1.0, (0, 1, 1): 1.0}, 2, tp_balanced=True
    ) == [
        0.75,
        1.0,
    ]
    two_replicas = {(0, 0, 0): 1.0, (0, 1, 0): 1.0, (1, 0, 0): 1.0, (1, 1, 0): 0.25}
    assert stage_speeds(two_replicas, pp=2) == [1.0, 0.25]  # one split for all: the slowest copy
    layer_s, extra_s = declared_stage_times([1.0, 0.5], [0.0, 2.0])
    assert (layer_s, extra_s) == ([1.0, 2.0], [0.0, 4.0])
    with pytest.raises(ValueError, match="no rank speeds for stage"):
        stage_speeds({(0, 0, 0): 1.0}, pp=2)


def test_model_extra_layers_counts_the_output_layer():
    # h=256, ffn=1024, s=128: a layer is 8h^2 + 4h ffn + 4sh = 1,703,936 FLOPs per token; the output
    # layer 2hV = 4,194,304 at V=8192
    extra = model_extra_layers(256, 1024, 128, 8192, pp=4)
    assert extra[:3] == [0.0, 0.0, 0.0] and extra[3] == pytest.approx(4194304 / 1703936)
    assert model_extra_layers(256, 1024, 65, 10, pp=2, head="cls") == [0.0, 0.0]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("3,5,1", "gives 3 stage\\(s\\), parallel.pp is 2"),
        ("0,8", "leaves a stage with no layers"),
        ("3,4", "sums to 7 layers, model.num_layers is 8"),
        ("3;5", "not comma-separated layer counts"),
    ],
)
def test_bad_splits_are_one_line_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_stage_layers(text, 8, 2)
    cfg = load_config(["--model.num_layers", "8", "--parallel.pp", "2", "--parallel.stage_layers", text])
    with pytest.raises(ConfigError, match=needle) as err:
        validate(cfg, 2)
    assert str(err.value).startswith("parallel.stage_layers: ") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--parallel.pp", "3"], "parallel.pp 3 does not divide model.num_layers 8: give the layers per stage"),
        (["--parallel.pp", "2", "--hetero.pp_split", "declared"], "hetero.pp_split=declared needs hetero.speeds"),
        (["--hetero.pp_split", "measured"], "parallel.pp is 1: set parallel.pp >= 2"),
        (["--parallel.pp", "2", "--hetero.pp_split", "measured", "--hetero.pp_patience", "0"], "pp_patience"),
        (["--parallel.pp", "9"], "cannot give each of parallel.pp 9 stages one"),
    ],
)  # fmt: skip
def test_bad_split_settings_are_one_line_errors(args, needle):
    world = 9 if "9" in args else 6 if "3" in args else 2
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(["--model.num_layers", "8", *args]), world)


def test_planned_splits_may_start_uneven():
    """With a planned split, 7 layers over 2 stages start as even as whole layers allow."""
    cfg = load_config(
        [
            "--model.num_layers",
            "7",
            "--parallel.pp",
            "2",
            "--hetero.pp_split",
            "declared",
            "--hetero.speeds",
            "1,1",
        ]
    )
    validate(cfg, 2)
    assert stage_split(cfg) == (4, 3)


def test_megatron_core_accepts_the_layout():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = PipelineParallelLayerLayout(megatron_layout((1, 3, 2, 2)), pipeline_model_parallel_size=4)
    layout.validate_layer_layout(num_layers=8, mtp_num_layers=None)
    assert [layout.get_layer_offset(pp_rank=p) for p in range(4)] == [0, 1, 4, 6]
    assert [layout.get_num_layers_to_build(pp_rank=p) for p in range(4)] == [1, 3, 2, 2]
    assert [list(r) for r in layer_ranges((1, 3, 2, 2))] == [[0], [1, 2, 3], [4, 5], [6, 7]]


def test_uneven_shard_round_trips_and_reshards(world1, tmp_path):
    """shard() with a split puts each global layer on its stage under its local index; merge_shards
    inverts it; reshard() writes the split into the checkpoint's layout and consolidates back exactly."""
    from megahet.models.gpt import build_gpt
    from tests.unit.test_convert import write_checkpoint

    cfg = load_config(
        ["--model.num_layers", "4", "--model.hidden_size", "32", "--model.num_attention_heads", "4"]
    )
    state = {k: v for k, v in build_gpt(cfg, 128).state_dict().items() if torch.is_tensor(v)}
    stages = shard(state, 1, 2, (1, 3))
    assert {k for k in stages[0][0] if k.startswith("decoder.layers.")} == {
        k.replace("decoder.layers.0.", "decoder.layers.0.")
        for k in state
        if k.startswith("decoder.layers.0.")
    }
    assert any(k.startswith("decoder.layers.2.") for k in stages[1][0]) and not any(
        k.startswith("decoder.layers.3.") for k in stages[1][0]
    )
    merged = merge_shards(stages)
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    with pytest.raises(ConfigError, match="not a split of 4 layers"):
        shard(state, 1, 2, (2, 3))

    write_checkpoint(tmp_path / "ck", state, 1, 2)
    folder, meta, _ = reshard(
        tmp_path / "ck", tmp_path / "uneven", 1, 2, model=cfg.model, stage_layers=(3, 1)
    )
    assert meta["layout"] == {"tp": 1, "pp": 2, "stage_layers": [3, 1]}
    back, _ = consolidate(folder)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(ConfigError, match="leaves a stage with no layers"):
        reshard(tmp_path / "ck", tmp_path / "bad", 1, 2, model=cfg.model, stage_layers=(4, 0))


def test_a_checkpoint_of_another_split_reshards_or_names_the_fix():
    """Full checkpoints record an uneven split: resuming at another split reshards them (elastic resume,
    optimizer state included); a weights-only one names the reshard command with --stage-layers."""
    from pathlib import Path

    from megahet.checkpointing.elastic import layout_note, needs_reshard, with_layout
    from megahet.checkpointing.finder import Resume, check_compatible, layout_of

    layers = ["--model.num_layers", "8", "--parallel.pp", "2"]
    uneven = load_config([*layers, "--parallel.stage_layers", "3,5"])
    even = load_config(layers)
    assert layout_of(uneven, 2) == {"tp": 1, "pp": 2, "dp": 2, "zero_stage": 1, "stage_layers": [3, 5]}
    assert layout_of(even, 2) == {"tp": 1, "pp": 2, "dp": 2, "zero_stage": 1}  # as older checkpoints say

    saved = Resume(
        Path("/ck/iter_0000020"), {"iteration": 20, "consumed_samples": 1, "layout": layout_of(uneven, 2)}
    )
    assert not needs_reshard(saved, uneven, 4)
    assert needs_reshard(saved, even, 4)
    reshard = needs_reshard(saved, with_layout(even, 1, 2), 4)
    note = layout_note(saved, even, even, 4, reshard)
    assert reshard and "saved at TP 1 x PP 2 (layers 3,5) x DP 2" in note

    weights = Resume(Path("/ck/iter_0000020"), {"iteration": 20, "consumed_samples": 1, "weights_only": True,
                                                "layout": {"tp": 1, "pp": 2}})  # fmt: skip
    with pytest.raises(ConfigError, match="--pp 2 --stage-layers 3,5") as err:
        check_compatible(weights, uneven, 2)
    assert "this run is TP 1 x PP 2 (layers 3,5)" in str(err.value)


def test_starting_split_from_declared_speeds_and_from_a_measured_checkpoint():
    from pathlib import Path

    from megahet.checkpointing.finder import Resume
    from megahet.config_checks import validate
    from megahet.run_plan import declared_by_coords
    from megahet.runtime.stage_plan import starting_split

    def split(cfg, world, vocab_size, resume=None):
        return starting_split(cfg, declared_by_coords(cfg, world), vocab_size, resume)

    base = ["--model.num_layers", "8", "--parallel.pp", "2", "--model.hidden_size", "64"]
    declared = load_config([*base, "--hetero.pp_split", "declared", "--hetero.speeds", "1,0.5,1,0.5"])
    # world 4 = PP 2 x DP 2; ranks 1 and 3 are DP replica 1 of stages 0 and 1: each stage's slowest copy
    # runs at 0.5 -> even; a slow stage 0 (ranks 0, 1) gets fewer layers
    assert split(declared, 4, vocab_size=None) == (4, 4)
    slow_first = load_config([*base, "--hetero.pp_split", "declared", "--hetero.speeds", "0.5,0.5,1,1"])
    assert split(slow_first, 4, vocab_size=None) == (3, 5)
    assert type(split(slow_first, 4, vocab_size=None)) is StageSplit
    assert split(slow_first, 4, vocab_size=4096) != (3, 5)  # the output layer counts
    with pytest.raises(ConfigError, match="drop one"):
        split(load_config([*base, "--hetero.pp_split", "declared", "--hetero.speeds", "1,1",
                           "--parallel.stage_layers", "4,4"]), 2, None)  # fmt: skip
    with pytest.raises(ConfigError, match="hetero.speeds: 3 speeds declared for a world of 2"):
        validate(load_config([*base, "--hetero.pp_split", "declared", "--hetero.speeds", "1,1,1"]), 2)

    measured = load_config([*base, "--hetero.pp_split", "measured"])
    saved = Resume(
        Path("/ck/iter_1"), {"layout": {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 1, "stage_layers": [2, 6]}}
    )
    assert split(measured, 2, None, saved) == (2, 6)  # goes on where it was
    assert split(measured, 2, None) == (4, 4)
    assert split(load_config(base), 2, None, saved) == (4, 4)  # not planned: as set


def test_layer_flops_count_grouped_query_attention_and_swiglu() -> None:
    from megahet.policy.flops import transformer_layer_flops

    h, f, s = 256, 1024, 128
    assert transformer_layer_flops(h, f, s) == 8 * h * h + 4 * h * f + 4 * s * h  # GPT-2's layer
    # 2 key/value heads for 8 query heads: K and V shrink to a quarter; SwiGLU has 3 matrices; causal halves
    assert transformer_layer_flops(h, f, s, heads=8, query_groups=2, gated=True, causal=True) == (
        4 * h * h + 4 * h * (h // 4) + 6 * h * f + 2 * s * h
    )
    lm = model_extra_layers(h, f, s, 8192, pp=2, heads=8, query_groups=2, gated=True)
    assert lm[-1] == 2 * h * 8192 / transformer_layer_flops(h, f, s, heads=8, query_groups=2, gated=True)


def test_layers_moved_gain_and_pay():
    from megahet.policy.stage_split import layers_moved, predicted_resplit_cost, resplit_gain_s, resplit_pays

    assert layers_moved((4, 4), (5, 3)) == 1
    assert layers_moved((4, 4), (2, 6)) == 2
    assert layers_moved((2, 2, 4), (3, 3, 2)) == 3  # layer 2 to stage 0, layers 4, 5 to stage 1
    assert layers_moved((3, 3), (3, 3)) == 0
    # 1F1B with 4 micro-batches on 2 stages: 5 slowest-stage times a step; 4,4 -> 5,3 at [1, 2] s per layer
    assert resplit_gain_s((4, 4), (5, 3), [1.0, 2.0], [0.0, 0.0], 4) == 5 * (8 - 6)
    assert (
        resplit_pays(1.0, 10, 9.0) and not resplit_pays(1.0, 10, 10.0) and not resplit_pays(-1.0, 10, -20.0)
    )
    assert predicted_resplit_cost(2.0, 0.5, 3) == 3.5
