"""Tests of the ZERO-resizing planner and its plan, pure functions: `units_to_drop`, `plan_resize` with
per-block overrides, `parse_rank_gammas`, `parse_block_gammas`, and the plan itself (`ResizePlan`:
lookups, `compute_counts`, dict / JSON round trips).

Run: ``python -m pytest tests/unit/test_resize_plan.py -q`` (a second; no megatron-core).
"""

from __future__ import annotations

import json
import math

import pytest
from one_line import one_line

from megahet.policy.resize_planner import (
    parse_block_gammas,
    parse_rank_gammas,
    plan_resize,
    units_to_drop,
)
from megahet.policy.selection import (
    select_random,
)
from megahet.tensor_parallel.plan import ResizePlan, block_name, parse_block_name

INF = math.inf


# --- units_to_drop / plan_resize ---------------------------------------------------------------


@pytest.mark.parametrize(
    "units, gamma, expected",
    [
        (64, 0.5, 32),
        (64, 0.0, 0),
        (64, 0.3, 19),  # floor(19.2)
        (4, 0.5, 2),
        (4, 0.3, 1),  # floor(1.2)
        (4, 0.74, 2),
        (4, 0.75, 3),
        (10, 0.3, 3),  # 0.3 * 10 = 3.0000000000000004 in floats
        (100, 0.29, 29),  # 0.29 * 100 = 28.999999999999996 in floats: still 29
        (10, 0.7, 7),
        (2, 0.99, 1),
        (1, 0.9, 0),  # keep at least one unit
    ],
)
def test_units_to_drop_is_floor_of_gamma_times_units(units: int, gamma: float, expected: int) -> None:
    assert units_to_drop(units, gamma) == expected


@pytest.mark.parametrize(
    "units, gamma, multiple, kept",
    [
        (3584, 0.135, 8, 3104),  # floor(483.8) dropped -> 3101 kept, rounded up to 388 x 8
        (3584, 0.135, 64, 3136),  # 49 x 64
        (3584, 0.125, 64, 3136),  # already a multiple: floor(gamma * units) unchanged
        (3584, 0.5, 128, 1792),
        (3584, 0.01, 64, 3584),  # 35 dropped would leave 3549: rounds up to every unit (no resize)
        (100, 0.5, 64, 64),  # units not a multiple: kept still rounded up to one
        (100, 0.9, 64, 64),  # keeps 64 rather than 10
        (8, 0.9, 1, 1),
    ],
)
def test_units_to_drop_keeps_a_multiple_of_units(units: int, gamma: float, multiple: int, kept: int) -> None:
    assert units - units_to_drop(units, gamma, multiple) == kept


def test_units_to_drop_rejects_a_multiple_below_one() -> None:
    with pytest.raises(ValueError) as err:
        units_to_drop(8, 0.5, 0)
    one_line(err, "unit multiple must be >= 1")


def test_plan_resize_aligns_mlp_blocks_only() -> None:
    """Attention units are whole heads (already GEMM-aligned): only MLP blocks round to the multiple."""
    block_units = {("attn", 1): 16, ("mlp", 1): 3584}
    plan = plan_resize(block_units, {(0, 0): 0.135}, lambda b, r, n: tuple(range(n)), mlp_multiple=64)
    assert len(plan.dropped(("attn", 1), 0, 0)) == 2  # floor(0.135 * 16), not rounded to 64
    assert len(plan.dropped(("mlp", 1), 0, 0)) == 3584 - 3136


@pytest.mark.parametrize("gamma", [1.0, 1.5, -0.1])
def test_units_to_drop_rejects_gamma_outside_0_1(gamma: float) -> None:
    with pytest.raises(ValueError) as err:
        units_to_drop(8, gamma)
    one_line(err, "gamma must be in [0, 1)")


def test_plan_resize_drops_floor_gamma_units_per_block_with_overrides() -> None:
    block_units = {("attn", 1): 4, ("mlp", 1): 64, ("attn", 2): 4, ("mlp", 2): 64}
    gammas = {(0, 0): 0.5, (1, 0): 0.3, (0, 1): 0.0}
    calls = []

    def choose(block, rank, n_drop):
        calls.append((block, rank, n_drop))
        return tuple(range(n_drop))[::-1]  # unsorted on purpose

    plan = plan_resize(block_units, gammas, choose, overrides={("mlp", 2): 0.125, ("attn", 2): 0.0})
    expected = {
        ("attn", 1): {(0, 0): 2, (1, 0): 1},  # floor(0.5 * 4), floor(0.3 * 4)
        ("mlp", 1): {(0, 0): 32, (1, 0): 19},  # floor(0.5 * 64), floor(0.3 * 64)
        ("mlp", 2): {(0, 0): 8, (1, 0): 8},  # the override applies to every resized rank
        ("attn", 2): {},  # override 0: nothing dropped there
    }
    for block, ranks in expected.items():
        assert {rank: len(units) for rank, units in plan.blocks[block].items()} == ranks, block
        for rank, n in ranks.items():
            assert plan.dropped(block, *rank) == tuple(range(n))[::-1]
        assert plan.dropped(block, 0, 1) == ()  # gamma 0: no entry
    # choose() is asked only for ranks and blocks that drop something, with the count to drop.
    assert sorted(calls) == sorted((b, r, n) for b, ranks in expected.items() for r, n in ranks.items())
    assert all(rank != (0, 1) for _, rank, _ in calls)


def test_plan_resize_without_resized_ranks_is_empty() -> None:
    plan = plan_resize({("mlp", 1): 8}, {(0, 0): 0.0}, lambda *a: pytest.fail("choose called"))
    assert plan.is_empty
    plan = plan_resize({("mlp", 1): 8}, {(0, 0): 0.1}, lambda *a: pytest.fail("choose called"))
    assert plan.is_empty  # floor(0.8) = 0


# --- parse_rank_gammas / parse_block_gammas ----------------------------------------------------


def test_parse_rank_gammas() -> None:
    assert parse_rank_gammas("0:0.5", dp_size=2, tp_size=2) == {(0, 0): 0.5, (1, 0): 0.5}
    assert parse_rank_gammas("1.0:0.25", dp_size=2, tp_size=2) == {(1, 0): 0.25}
    assert parse_rank_gammas(" 0:0.5 , 1.1:0.25,", dp_size=2, tp_size=2) == {
        (0, 0): 0.5,
        (1, 0): 0.5,
        (1, 1): 0.25,
    }
    assert parse_rank_gammas("0:0.5,0.0:0.1", dp_size=2, tp_size=1) == {(0, 0): 0.1, (1, 0): 0.5}
    assert parse_rank_gammas("1:0", dp_size=1, tp_size=2) == {(0, 1): 0.0}
    assert parse_rank_gammas(None, 2, 2) == {} and parse_rank_gammas("", 2, 2) == {}


@pytest.mark.parametrize(
    "text, needles",
    [
        ("2:0.5", ["'2:0.5'", "names no rank of DP 2 x TP 2"]),
        ("2.0:0.5", ["names no rank"]),
        ("-1:0.5", ["names no rank"]),
        ("0:1.0", ["gamma must be in [0, 1)"]),
        ("0:-0.25", ["gamma must be in [0, 1)"]),
        ("0:nan", ["gamma must be in [0, 1)"]),
        ("x:0.5", ["bad resize entry 'x:0.5'", "TP_RANK:GAMMA or DP_RANK.TP_RANK:GAMMA"]),
        ("0", ["bad resize entry '0'"]),
        ("0:", ["bad resize entry"]),
        ("0:half", ["bad resize entry"]),
        ("0.0.0:0.5", ["bad resize entry"]),
    ],
)
def test_parse_rank_gammas_errors(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_rank_gammas(text, dp_size=2, tp_size=2)
    one_line(err, *needles)


def test_parse_block_gammas() -> None:
    assert parse_block_gammas("mlp:3=0.25, attn:1=0") == {("mlp", 3): 0.25, ("attn", 1): 0.0}
    assert parse_block_gammas(None) == {} and parse_block_gammas("") == {}


@pytest.mark.parametrize(
    "text, needles",
    [
        ("mlp:3", ["bad block override 'mlp:3'"]),
        ("ffn:1=0.5", ["bad block override", "mlp:LAYER=GAMMA or attn:LAYER=GAMMA"]),
        ("mlp:x=0.5", ["bad block override"]),
        ("mlp:-1=0.5", ["bad block override"]),
        ("mlp:1=1.5", ["gamma must be in [0, 1)"]),
        ("mlp:1=abc", ["bad block override"]),
    ],
)
def test_parse_block_gammas_errors(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_block_gammas(text)
    one_line(err, *needles)


# --- ResizePlan --------------------------------------------------------------------------------


def test_plan_lookups_and_sorting() -> None:
    plan = ResizePlan.from_dict({"blocks": {"mlp:1": {"0,1": [7, 3]}, "attn:2": {"1,0": [1]}}})
    assert plan.dropped(("mlp", 1), dp_rank=0, tp_rank=1) == (3, 7)
    assert plan.dropped(("mlp", 1), dp_rank=1, tp_rank=1) == ()
    assert plan.dropped(("mlp", 2), dp_rank=0, tp_rank=1) == ()
    assert plan.dropped(("attn", 2), 1, 0) == (1,)
    assert not plan.is_empty
    assert ResizePlan().is_empty
    assert ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": []}}}).is_empty
    assert ResizePlan.from_dict({}).is_empty


def test_plan_round_trips_through_dict_and_json() -> None:
    plan = plan_resize(
        {("attn", 1): 4, ("mlp", 1): 16, ("mlp", 12): 16},
        {(0, 0): 0.5, (1, 1): 0.25, (1, 0): 0.0},
        lambda block, rank, n: select_random(16 if block[0] == "mlp" else 4, n, seed=(block[1], *rank)),
    )
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain JSON types
    assert set(data["blocks"]) == {"attn:1", "mlp:1", "mlp:12"}
    assert set(data["blocks"]["mlp:1"]) == {"0,0", "1,1"}  # gamma-0 rank absent
    assert ResizePlan.from_dict(data) == plan
    assert ResizePlan.from_json(plan.to_json()) == plan
    assert plan.to_json() == ResizePlan.from_json(plan.to_json()).to_json()  # canonical text
    # Entries that drop nothing are not written.
    sparse = ResizePlan({("mlp", 1): {(0, 0): (), (0, 1): (2,)}})
    assert sparse.to_dict() == {"blocks": {"mlp:1": {"0,1": [2]}}}


def test_compute_counts() -> None:
    plan = ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": [1, 2], "1,0": [1], "2,0": [2, 3], "0,1": [0]}}})
    # Unit u of TP rank 0: how many of the 3 DP replicas compute it.
    assert plan.compute_counts(("mlp", 1), tp_rank=0, dp_size=3, num_units=5) == [3, 1, 1, 2, 3]
    assert plan.compute_counts(("mlp", 1), tp_rank=1, dp_size=3, num_units=5) == [2, 3, 3, 3, 3]
    assert plan.compute_counts(("attn", 1), tp_rank=0, dp_size=3, num_units=2) == [3, 3]
    # Only the replicas within dp_size count.
    assert plan.compute_counts(("mlp", 1), tp_rank=0, dp_size=1, num_units=5) == [1, 0, 0, 1, 1]
    # Every replica dropping a unit: count 0 (imputed).
    both = ResizePlan.from_dict({"blocks": {"attn:3": {"0,0": [1], "1,0": [1, 2]}}})
    assert both.compute_counts(("attn", 3), 0, 2, 4) == [2, 0, 1, 2]
    # Weighted by each replica's micro-batches (uneven data-parallel shares): the micro-batches computing it.
    assert plan.compute_counts(("mlp", 1), 0, 3, 5, weights=(5, 2, 1)) == [8, 1, 2, 7, 8]


def test_block_names() -> None:
    assert block_name(("mlp", 3)) == "mlp:3"
    assert parse_block_name("attn:12") == ("attn", 12)
    for bad in ("mlp", "mlp:", "ffn:1", "mlp:one", "attn:-1", ":1"):
        with pytest.raises(ValueError) as err:
            parse_block_name(bad)
        one_line(err, "bad block name", "'mlp:<layer>' or 'attn:<layer>'")


@pytest.mark.parametrize("units", [[3, 3], [-1, 2]])
def test_plan_from_dict_rejects_duplicate_or_negative_units(units) -> None:
    with pytest.raises(ValueError, match="distinct non-negative"):
        ResizePlan.from_dict({"blocks": {"mlp:1": {"0,0": units}}})
