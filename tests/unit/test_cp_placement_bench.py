"""benchmarks/cp_placement.py's parts: the long-context mix's micro-batches respect their budget, and the
study compares every planner on the same batches (static is its own baseline; placement by speed beats
the even split when a rank is slow).

Run: ``python -m pytest tests/unit/test_cp_placement_bench.py -q`` (a second).
"""

from __future__ import annotations

import argparse

from benchmarks.cp_placement import PLANNERS, long_tail_batches, measured_cost, study

ARGS = argparse.Namespace(batches=8, cap=2048, longest=4096, block=256, kv=0.05, seed=3)


def test_micro_batches_fill_the_ranks_caps_by_speed_and_keep_the_tail() -> None:
    for speeds, budget in (((1.0, 1.0), 4096), ((0.5, 1.0), 3072)):
        batches = long_tail_batches(ARGS, speeds)
        assert len(batches) == ARGS.batches
        assert all(sum(b) <= budget for b in batches)
        assert all(2 <= n <= min(ARGS.longest, budget) for b in batches for n in b)


def test_every_planner_on_the_same_batches_and_speed_placement_beats_the_even_split() -> None:
    rows = study(ARGS, 2, (0.5, 1.0), measured_cost())
    assert [r["planner"] for r in rows] == list(PLANNERS)
    by = {r["planner"]: r for r in rows}
    assert by["static"]["speedup_vs_static"] == 1.0 and by["static"]["kv_vs_static"] == 1.0
    assert by["dynamic"]["speedup_vs_static"] > 1.2 and by["dynamic"]["E"] > by["static"]["E"]
    assert by["dynamic"]["max_tokens_vs_cap"] <= 1.05
