"""Unit tests of lightweight migration's pure parts (no process group):

- `plan_migration`: each owner's highest floor(fraction * units) units (at least one unit kept),
  split evenly and in order over its helpers;
- `parse_migrations`: 'TP:FRACTION' (helpers default to every other TP rank), 'DP.TP:FRACTION',
  '@H1+H2' helpers; errors for a helper equal to the owner, out of range, or malformed entries;
- `ResizePlan` with `migrated`: dict/JSON round trip, `migrations()`, `migrated_away()`, and the
  validation errors (a unit both dropped and migrated, migrated to its own owner, listed twice);
- `--resize.migrate` with `--parallel.zero_stage 2` is a one-line ConfigError.

Run: ``python -m pytest tests/unit/test_migration.py -q`` (under a second).
"""

from __future__ import annotations

import pytest

from megahet.config import ConfigError, load_config
from megahet.config_checks import validate
from megahet.policy.resize_planner import parse_migrations, plan_migration
from megahet.tensor_parallel.plan import ResizePlan

UNITS = {("attn", 1): 2, ("mlp", 1): 64, ("attn", 2): 2, ("mlp", 2): 64}


# --- plan_migration -------------------------------------------------------------------------------------


def test_plan_migration_moves_the_highest_floor_fraction_units_split_in_order() -> None:
    moves = {(0, 0): (0.5, (1, 2, 3)), (1, 2): (0.85, (0,))}
    migrated = plan_migration(UNITS, moves)
    assert set(migrated) == set(UNITS)
    # MLP: floor(0.5 * 64) = 32 units 32..63 over 3 helpers: 11, 11, 10 (the remainder goes first).
    assert migrated[("mlp", 1)][(0, 0)] == {
        1: tuple(range(32, 43)),
        2: tuple(range(43, 54)),
        3: tuple(range(54, 64)),
    }
    # floor(0.85 * 64) = 54 units: 10..63, one helper.
    assert migrated[("mlp", 2)][(1, 2)] == {0: tuple(range(10, 64))}
    # Attention, 2 heads: floor(0.5 * 2) = 1 head (the highest) to the first helper only; 0.85 -> 1
    # (floor 1.7), and at least one head stays with its owner.
    assert migrated[("attn", 1)][(0, 0)] == {1: (1,)}
    assert migrated[("attn", 2)][(1, 2)] == {0: (1,)}
    # A plan built from it is valid and leaves other ranks untouched.
    plan = ResizePlan({}, migrated)
    assert plan.migrated_away(("mlp", 1), 0, 0) == tuple(range(32, 64))
    assert plan.migrated_away(("mlp", 1), 1, 0) == ()
    assert ResizePlan.from_dict(plan.to_dict()) == plan


def test_plan_migration_floors_and_keeps_a_unit() -> None:
    units = {("mlp", 1): 10, ("attn", 1): 1}
    migrated = plan_migration(units, {(0, 1): (0.99, (0, 2))})
    assert migrated[("mlp", 1)][(0, 1)] == {0: (1, 2, 3, 4, 5), 2: (6, 7, 8, 9)}  # 9 of 10
    assert migrated[("attn", 1)] == {}  # a single head never moves
    assert plan_migration(units, {(0, 1): (0.05, (0,))}) == {("attn", 1): {}, ("mlp", 1): {}}  # floor 0.5
    assert plan_migration(units, {(0, 1): (0.25, (0, 2, 3))})[("mlp", 1)][(0, 1)] == {0: (8,), 2: (9,)}
    assert plan_migration(units, {}) == {("attn", 1): {}, ("mlp", 1): {}}


# --- parse_migrations ----------------------------------------------------------------------------------


def test_parse_migrations_helpers_default_to_every_other_tp_rank() -> None:
    assert parse_migrations("1:0.5", dp_size=2, tp_size=4) == {
        (0, 1): (0.5, (0, 2, 3)),
        (1, 1): (0.5, (0, 2, 3)),
    }
    assert parse_migrations("1.3:0.25", dp_size=2, tp_size=4) == {(1, 3): (0.25, (0, 1, 2))}
    assert parse_migrations(None, 2, 4) == {} == parse_migrations("", 2, 4)


def test_parse_migrations_explicit_helpers() -> None:
    assert parse_migrations("0:0.5@1+2, 3:0.85@0", dp_size=1, tp_size=4) == {
        (0, 0): (0.5, (1, 2)),
        (0, 3): (0.85, (0,)),
    }
    assert parse_migrations("0.2:0.5@3", dp_size=1, tp_size=4) == {(0, 2): (0.5, (3,))}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("1:0.5@1", "helpers must be other TP ranks"),  # helper == owner
        ("1:0.5@0+1", "helpers must be other TP ranks"),
        ("0:0.5@4", "helpers must be other TP ranks"),  # out of range
        ("0:0.5@-1", "helpers must be other TP ranks"),
        # owner / DP replica out of range, fraction >= 1: parse_rank_gammas' reason is replaced by
        # the migrate entry's usage line
        ("4:0.5", "migrate entry '4:0.5' names no rank"),
        ("2.0:0.5", "migrate entry '2.0:0.5' names no rank"),
        ("0:1.0", "migrate entry '0:1.0': the fraction must be in [0, 1)"),
        ("0:0.5@x", "bad migrate entry"),
        ("zero:0.5", "bad migrate entry"),
    ],
)
def test_parse_migrations_errors(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_migrations(text, dp_size=2, tp_size=4)
    assert needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_parse_migrations_single_tp_rank_has_no_helper() -> None:
    with pytest.raises(ValueError, match="helpers must be other TP ranks"):
        parse_migrations("0:0.5", dp_size=2, tp_size=1)


# --- ResizePlan with migrations ------------------------------------------------------------------------

PLAN = {
    "blocks": {"mlp:1": {"0,2": [0, 4]}},
    "migrated": {
        "mlp:1": {"0,0": {"3": [9, 5, 1], "1": [60]}, "0,1": {"0": [0, 2]}, "1,0": {"2": [63]}},
        "attn:2": {"1,3": {"2": [1]}},
    },
}


def test_resize_plan_round_trip_with_migrated() -> None:
    plan = ResizePlan.from_dict(PLAN)
    assert plan.migrated[("mlp", 1)][(0, 0)] == {3: (1, 5, 9), 1: (60,)}  # units sorted
    assert ResizePlan.from_dict(plan.to_dict()) == plan
    assert ResizePlan.from_json(plan.to_json()) == plan
    assert plan.to_dict()["migrated"]["mlp:1"]["0,0"] == {"1": [60], "3": [1, 5, 9]}
    assert not plan.is_empty
    migration_only = ResizePlan.from_dict({"migrated": PLAN["migrated"]})
    assert not migration_only.is_empty and migration_only.to_dict()["blocks"] == {}
    # No migration: no "migrated" key, and empty helper lists vanish.
    assert "migrated" not in ResizePlan.from_dict({"blocks": PLAN["blocks"]}).to_dict()
    empty = ResizePlan.from_dict({"migrated": {"mlp:1": {"0,0": {"1": []}}}})
    assert empty.is_empty and "migrated" not in empty.to_dict()
    assert empty.migrations(("mlp", 1), 0) == {}


def test_migrations_and_migrated_away() -> None:
    plan = ResizePlan.from_dict(PLAN)
    # {(owner tp, helper tp): units} of one DP replica's TP group, ordered by owner then helper.
    moves = plan.migrations(("mlp", 1), dp_rank=0)
    assert moves == {(0, 1): (60,), (0, 3): (1, 5, 9), (1, 0): (0, 2)}
    assert list(moves) == [(0, 1), (0, 3), (1, 0)]
    assert plan.migrations(("mlp", 1), dp_rank=1) == {(0, 2): (63,)}
    assert plan.migrations(("attn", 2), dp_rank=0) == {}
    assert plan.migrations(("attn", 2), dp_rank=1) == {(3, 2): (1,)}
    assert plan.migrations(("mlp", 2), dp_rank=0) == {}
    assert plan.migrated_away(("mlp", 1), 0, 0) == (1, 5, 9, 60)
    assert plan.migrated_away(("mlp", 1), 0, 1) == (0, 2)
    assert plan.migrated_away(("mlp", 1), 0, 3) == ()  # a helper owns nothing migrated
    assert plan.migrated_away(("mlp", 1), 1, 0) == (63,)
    # Migrated units stay computed by the owner's DP replicas as far as averaging is concerned: only
    # drops change the compute counts.
    assert plan.compute_counts(("mlp", 1), tp_rank=0, dp_size=2, num_units=64) == [2] * 64
    counts = plan.compute_counts(("mlp", 1), tp_rank=2, dp_size=2, num_units=64)
    assert counts[0] == counts[4] == 1 and sum(counts) == 126


@pytest.mark.parametrize(
    "data, needle",
    [
        (  # a unit both dropped and migrated
            {"blocks": {"mlp:1": {"0,0": [3]}}, "migrated": {"mlp:1": {"0,0": {"1": [3, 4]}}}},
            "also dropped",
        ),
        ({"migrated": {"mlp:1": {"0,2": {"2": [3]}}}}, "own owner"),  # to its own owner
        ({"migrated": {"mlp:1": {"0,0": {"1": [3, 3]}}}}, "twice"),  # listed twice for one helper
        ({"migrated": {"mlp:1": {"0,0": {"1": [3], "2": [3]}}}}, "twice"),  # to two helpers
        ({"migrated": {"mlp:1": {"0,0": {"1": [-1]}}}}, "negative"),
        ({"migrated": {"dense:1": {"0,0": {"1": [1]}}}}, "bad block name"),
    ],
)
def test_resize_plan_validation_errors(data: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        ResizePlan.from_dict(data)
    assert needle in str(err.value), str(err.value)


def test_migrate_with_zero2_is_a_one_line_config_error() -> None:
    argv = ["--parallel.tp", "2", "--resize.migrate", "0:0.5"]
    assert validate(load_config(argv), world_size=4) == 2  # ZeRO-1: fine
    with pytest.raises(ConfigError) as err:
        validate(load_config([*argv, "--parallel.zero_stage", "2"]), world_size=4)
    message = str(err.value)
    assert "\n" not in message
    assert "resize.migrate" in message and "zero_stage=1" in message
    # A bad migrate entry is a one-line ConfigError as well.
    with pytest.raises(ConfigError) as err:
        validate(load_config(["--parallel.tp", "2", "--resize.migrate", "0:0.5@0"]), world_size=4)
    assert str(err.value).startswith("resize: ") and "\n" not in str(err.value)


def test_migration_chunks_round_to_the_unit_multiple() -> None:
    """With resize.unit_multiple m, MLP chunks are multiples of m (the owner's and helpers' widths stay
    multiples of m); heads are not rounded; without a multiple of m units per rank nothing is."""
    from megahet.policy.resize_planner import plan_migration, round_to_multiple

    units = {("mlp", 1): 256, ("attn", 1): 8}
    plan = plan_migration(units, {(0, 0): (0.3, (1, 2))}, mlp_multiple=64)
    mlp = plan[("mlp", 1)][(0, 0)]
    assert {h: len(u) for h, u in mlp.items()} == {1: 64, 2: 64}  # floor(0.3 * 256) = 76 -> 38 + 38
    assert {h: len(u) for h, u in plan[("attn", 1)][(0, 0)].items()} == {1: 1, 2: 1}
    assert round_to_multiple({1: 250}, 256, 64) == {1: 192}  # the owner keeps 64
    assert round_to_multiple({1: 31, 2: 33}, 256, 64) == {1: 0, 2: 64}
    assert round_to_multiple({1: 31}, 250, 64) == {1: 31}
    targets = plan_migration(units, {(0, 0): {1: 0.4}}, mlp_multiple=8)[("mlp", 1)][(0, 0)]
    assert len(targets[1]) % 8 == 0 and (256 - len(targets[1])) % 8 == 0
