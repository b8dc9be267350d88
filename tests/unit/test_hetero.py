"""Tests of heterogeneous data parallelism's inputs and data path, in one process: declared speeds
(`--hetero.speeds`, per rank or per node), their one-line errors before any rank starts, data streams
whose shares change between global batches (every sample once per batch, in the even run's order),
virtual-device profiles over the whole mesh, and the console fields of the shares.

Run: ``python -m pytest tests/unit/test_hetero.py -q`` (about a second; no process group).
"""

from __future__ import annotations

import itertools
import json

import pytest
from one_line import one_line
from test_sampling import Indexed

from megahet.config import ConfigError, load_config
from megahet.config_checks import validate
from megahet.data.sampling import micro_batches
from megahet.logging import format_console_line
from megahet.policy.declared_speeds import parse_declared_speeds
from megahet.policy.speed_profile import parse_profile
from megahet.runtime.devices import VirtualDevice

# --- declared speeds ---------------------------------------------------------------------------------


def test_inline_speeds_are_one_per_rank() -> None:
    assert parse_declared_speeds("1,1,0.5,0.5", world_size=4, ranks_per_node=2) == [1.0, 1.0, 0.5, 0.5]


def test_speed_files_by_rank_and_by_node(tmp_path) -> None:
    ranks = tmp_path / "ranks.yaml"
    ranks.write_text("ranks: {1: 0.5, 3: 0.25}\n")
    assert parse_declared_speeds(str(ranks), 4, 4) == [1.0, 0.5, 1.0, 0.25]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps({"ranks": [1, 2, 3, 4]}))
    assert parse_declared_speeds(str(listed), 4, 1) == [1.0, 2.0, 3.0, 4.0]
    nodes = tmp_path / "nodes.yml"
    nodes.write_text("nodes:\n  1: 0.45   # a V100 node beside an A100 node\n")
    assert parse_declared_speeds(str(nodes), 8, 4) == [1.0] * 4 + [0.45] * 4


@pytest.mark.parametrize(
    "spec, content, needle",
    [
        ("1,1,1", None, "3 speeds declared for a world of 4"),
        ("1,0,1,1", None, "positive and finite"),
        ("1,-2,1,1", None, "positive and finite"),
        ("1,x,1,1", None, "neither a comma-separated list"),
        ("missing.yaml", None, "not found"),
        ("bad.yaml", "ranks: [1, 2\n", "not valid YAML"),
        ("both.yaml", "ranks: [1]\nnodes: {0: 1}\n", "exactly one of `ranks:` or `nodes:`"),
        ("far.yaml", "nodes: {2: 0.5}\n", "names node 2, but there are nodes 0..1"),
        ("zero.yaml", "ranks: {0: 0}\n", "positive and finite"),
        ("word.yaml", "ranks: {0: fast}\n", "must be numbers"),
    ],
)
def test_bad_declarations_are_one_line_errors(tmp_path, spec: str, content: str | None, needle: str) -> None:
    if content is not None:
        (tmp_path / spec).write_text(content)
    path = str(tmp_path / spec) if spec.endswith(".yaml") else spec
    with pytest.raises(ValueError, match=needle) as err:
        parse_declared_speeds(path, world_size=4, ranks_per_node=2)
    assert "\n" not in str(err.value)


# --- configuration checks, before any rank starts ---------------------------------------------------


@pytest.mark.parametrize(
    "args, world, needle",
    [
        (["--hetero.dp_shares", "declared"], 2, "needs hetero.speeds"),
        (["--hetero.dp_shares", "declared", "--hetero.speeds", "1,0.5,1"], 2, "hetero.speeds: 3 speeds"),
        (["--hetero.dp_shares", "measured", "--hetero.speeds", "1,-1"], 2, "positive and finite"),
        (["--hetero.dp_shares", "measured", "--parallel.zero_stage", "2"], 2, "ZeRO-2 reduces gradients"),
        (["--hetero.dp_shares", "measured", "--parallel.tp", "2"], 2, "DP is 1"),
        (["--hetero.speeds", "1,0.5"], 2, "nothing uses it"),
        (["--hetero.dp_shares", "measured", "--hetero.window", "0"], 2, "must be positive"),
        (["--hetero.dp_shares", "measured", "--hetero.hysteresis", "1.5"], 2, "hysteresis must be in"),
        (["--hetero.dp_shares", "even_ish"], 2, "must be one of"),
        (["--device.profile", "static:1,1,1"], 2, "list one speed per TP rank .* or one per global rank"),
    ],
)
def test_bad_hetero_settings_are_one_line_errors(args: list[str], world: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        validate(load_config(args), world)
    one_line(err)


def test_node_declarations_follow_the_launchers_ranks_per_node(tmp_path, monkeypatch) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("nodes: {1: 0.5}\n")
    cfg = load_config(["--hetero.dp_shares", "declared", "--hetero.speeds", str(nodes)])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert validate(cfg, 4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="not whole nodes of 3"):
        validate(cfg, 4)


# --- data streams with shares -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle_seed", [None, 5])
@pytest.mark.parametrize("n", [96, 41])  # 41: global batches straddle epoch boundaries
def test_changing_shares_use_every_sample_once_per_batch_in_the_even_runs_order(shuffle_seed, n: int) -> None:
    """Sample accounting: 3 replicas, 9 micro-batches of 2 per global batch, shares changing between
    batches (even, skewed, back); each batch concatenated over replicas is DP=1's batch."""
    G, m, schedule = 18, 2, [(3, 3, 3), (5, 3, 1), (1, 1, 7), (7, 1, 1), (3, 3, 3)]
    kw = {"global_batch_size": G, "micro_batch_size": m, "dp_size": 3, "shuffle_seed": shuffle_seed}
    streams = [micro_batches(Indexed(n), dp_rank=r, **kw) for r in range(3)]
    one = micro_batches(
        Indexed(n), global_batch_size=G, micro_batch_size=m, dp_rank=0, dp_size=1, shuffle_seed=shuffle_seed
    )
    for batch, shares in enumerate(schedule):
        seen = []
        for r, stream in enumerate(streams):
            stream.set_shares(shares)
            batches = list(itertools.islice(stream, shares[r]))  # what the schedule pulls
            seen += [int(i) for b in batches for i in b["idx"]]
        reference = [int(i) for b in itertools.islice(one, G // m) for i in b["idx"]]
        assert seen == reference, shares
        one_epoch = batch * G // n == ((batch + 1) * G - 1) // n  # else two epochs' orders meet
        assert len(seen) == G and (len(set(seen)) == G or not one_epoch), shares


def test_bad_shares_are_refused_by_the_stream() -> None:
    stream = micro_batches(Indexed(32), global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2)
    assert stream.shares == (2, 2)
    for shares in [(3, 2), (4, 0), (1, 1, 2)]:
        with pytest.raises(ValueError, match="at least one of the 4 micro-batches"):
            stream.set_shares(shares)


# --- virtual devices over the whole mesh --------------------------------------------------------------


def test_a_profile_of_one_speed_per_global_rank_slows_a_whole_replica() -> None:
    profile = parse_profile("schedule:0=1,1,1,1;10=1,1,0.5,0.5")
    assert profile.width == 4
    # TP 2 x DP 2: global ranks 2 and 3 are replica 1; the device runs at its global rank's speed.
    assert profile.index(tp_rank=0, tp_size=2, rank=2, world_size=4) == (2, 4)
    device = VirtualDevice(profile, *profile.index(0, 2, 2, 4), rate_gflops=1)
    device.set_step(10)
    assert device.speed == 0.5
    # A per-TP-rank profile means the same TP rank in every replica and stage.
    assert parse_profile("static:1,0.5").index(tp_rank=1, tp_size=2, rank=3, world_size=4) == (1, 2)
    assert parse_profile("rotating:4,10").index(tp_rank=1, tp_size=2, rank=3, world_size=4) == (1, 2)


# --- telemetry ----------------------------------------------------------------------------------------


def test_console_line_prints_replica_speeds_and_shares() -> None:
    line = format_console_line(
        5, 10, {"loss": 2.0, "speed_dp0": 1.0, "speed_dp1": 0.26, "share_dp0": 13.0, "share_dp1": 3.0}
    )
    assert line == "step      5/10 | loss 2.0000 | dp speed 1.00 0.26 | dp share 13 3"
