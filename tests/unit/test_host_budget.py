"""Per-step host work budgets (issue 48): a change that adds host work to every training step fails here.

benchmarks/host_overhead.py counts, on the host-bound tiny Llama at TP=1 and TP=2 (real ranks under
torchrun), each system's ATen ops, Python calls into megahet, host syncs and CUDA events per step
(benchmarks/host_counts.py). These counts do not depend on the machine's speed or load, so they are held
to fixed budgets: measuring within 1.1x of the unbalanced step's ATen ops (issue 48's
goal; host syncs: none more: its gathered measurements are host memory on every machine), and every
system's megahet calls within
its budget below (the counts measured when they were set,
plus about 10 %). Lower a budget when a change cuts host work; raise one only with the reason in the
commit.

    pytest tests/unit/test_host_budget.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import torchrun

MEGAHET_CALLS = {
    1: {"megahet": 250, "measuring": 500, "semi": 525, "semi_every_step": 525},  # 225, 455, 476, 476
    2: {"megahet": 965, "measuring": 1350, "semi": 1440, "semi_every_step": 1440},  # 878, 1227, 1308, 1308
}
"""Python calls into megahet per step, per TP size and system (budgets)."""


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def counts(request, tmp_path_factory) -> tuple[int, dict[str, dict]]:
    tp, out = request.param, tmp_path_factory.mktemp("host_counts") / "counts.json"
    args = [
        "--tp",
        str(tp),
        "--rounds",
        "0",
        "--healthy-gap",
        "0.9",
        "--instances",
        "1",  # counts do not depend on where memory landed
        "--out",
        str(out),
        "--systems",
        "measuring,semi,semi_every_step",  # not the compiled ones: compiling takes a minute
    ]  # healthy: never resizes
    torchrun("benchmarks/host_overhead.py", tp, args, out.with_suffix(".log"))
    return tp, {row["system"]: row for row in json.loads(out.read_text())}


def test_measuring_adds_at_most_a_tenth_of_the_ops_and_no_host_sync(counts):
    """Measuring reads its gathered measurements once per step, one step late, from host memory (CPU
    tensors gathered by gloo on every machine: megahet/runtime/hooks.py), whatever the number of ranks;
    nothing of it waits for the device."""
    _, rows = counts
    plain, measuring = rows["megahet"], rows["measuring"]
    assert measuring["aten_ops"] <= 1.1 * plain["aten_ops"], (measuring, plain)
    assert measuring["host_syncs"] <= plain["host_syncs"], (measuring, plain)
    assert measuring["cuda_events"] == plain["cuda_events"] == 0  # CPU: the clock is perf_counter


def test_semi_on_a_healthy_group_adds_at_most_a_twentieth_of_the_ops(counts):
    """SEMI with nothing to balance: measuring, a decision per step, and the priority statistics sampled one
    step in resize.score_interval (every step, they added 13 % of the step's ATen ops)."""
    _, rows = counts
    assert rows["semi"]["aten_ops"] <= 1.05 * rows["megahet"]["aten_ops"], (rows["semi"], rows["megahet"])


@pytest.mark.parametrize("system", ["megahet", "measuring", "semi", "semi_every_step"])
def test_megahet_python_calls_per_step_stay_within_budget(counts, system):
    tp, rows = counts
    assert rows[system]["megahet_calls"] <= MEGAHET_CALLS[tp][system], rows[system]


def test_the_counts_see_the_work(counts):
    """The counters count: plain megatron-core dispatches ATen ops and makes no call into megahet's
    per-step code beyond its model builder's layers (the counts cannot pass by counting nothing)."""
    _, rows = counts
    assert rows["mcore"]["aten_ops"] > 500 and rows["megahet"]["megahet_calls"] > 100
    assert rows["megahet"]["aten_ops"] > rows["mcore"]["aten_ops"] * 0.8
    for row in rows.values():  # the per-operator counts add up to the total
        assert sum(row["ops"].values()) == pytest.approx(row["aten_ops"]), row["system"]


def test_the_op_table_ranks_where_two_systems_differ(tmp_path):
    """benchmarks/host_overhead.py's <name>_ops.md: per operator, the extra dispatches per step, largest
    first (issue 48: where megahet's plain step spends host work beyond megatron-core's)."""
    from benchmarks.host_counts import op_differences
    from benchmarks.host_overhead import write_op_table

    ops = {
        "mcore": {"aten.add_": 100.0, "aten.mm": 40.0},
        "megahet": {"aten.mm": 40.0, "aten.copy_": 29.0, "aten.add_": 51.0},
    }
    ops["measuring"] = ops["semi"] = {**ops["megahet"], "aten.stack": 2.0}
    assert op_differences(ops["megahet"], ops["mcore"]) == [("aten.copy_", 29.0), ("aten.add_", -49.0)]
    write_op_table(tmp_path / "ops.md", [{"system": k, "tp": 1, "ops": v} for k, v in ops.items()])
    table = (tmp_path / "ops.md").read_text()
    assert "| aten.copy_ | +29.0 | 29.0 | 0.0 |" in table and "| aten.stack | +2.0 | 2.0 | 0.0 |" in table
