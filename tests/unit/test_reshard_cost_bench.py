"""The reshard-cost benchmark's parts (benchmarks/reshard_cost.py): the peak-memory sampler sees an
allocation inside its block, the table takes the slowest rank's time and the worst rank's peak against
its own shard, and the plot is drawn with its extrapolation to 7 B and 70 B parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.reshard_cost import PeakRSS
from benchmarks.reshard_report import _plot, _rows

MIB = 2**20


def test_peak_rss_sees_a_short_lived_allocation():
    """The kernel's high-water mark sees an allocation freed at once, however busy the machine (a 2 ms
    sampler alone missed one on a busy machine)."""
    with PeakRSS() as rss:
        block = np.ones(64 * MIB // 8)  # 64 MiB, touched
        del block
    assert rss.kernel_peak, "this kernel refused to reset VmHWM (/proc/self/clear_refs)"
    assert rss.peak - rss.before > 48 * MIB


def _result(scale: float) -> dict:
    def resplit_rank(rank: int) -> dict:
        return {
            "rank": rank,
            "shard": 100 * MIB * scale,
            "old": {"save_s": 1.0 * scale, "reshard_s": 2.0 * scale, "build_s": 0.5, "total_s": 3.5 * scale + rank,
                    "peak_rss": (1000 + 400 * (rank == 0)) * MIB * scale, "rss_before": 900 * MIB * scale,
                    "disk_bytes": 800 * MIB * scale},
            "new": {"plan_s": 0.05, "transfer_s": 0.2 * scale, "build_s": 0.5, "total_s": 0.7 * scale, "peak_rss": 950 * MIB * scale,
                    "rss_before": 900 * MIB * scale, "bytes_moved": 30 * MIB * scale, "bytes_minimum": 30 * MIB * scale,
                    "raw_send_s": 0.1 * scale, "shard_copy_s": 0.1},
        }  # fmt: skip

    def elastic_rank(rank: int) -> dict:
        return {
            "rank": rank,
            "shard": 200 * MIB * scale,
            "old": {"reshard_s": 2.0 * scale, "build_s": 1.0, "total_s": 3.0 * scale, "peak_rss": 2000 * MIB * scale,
                    "rss_before": 500 * MIB * scale},
            "new": {"read_s": 0.3 * scale, "build_s": 1.0, "total_s": 1.3 * scale, "peak_rss": 900 * MIB * scale,
                    "rss_before": 500 * MIB * scale, "read_peak_rss": 760 * MIB * scale,
                    "read_rss_before": 500 * MIB * scale, "read_peak_anon": 700 * MIB * scale,
                    "read_anon_before": 500 * MIB * scale},
        }  # fmt: skip

    return {
        "resplit": {"params": 1e7 * scale, "ranks": [resplit_rank(r) for r in range(4)]},
        "elastic": {"ranks": [elastic_rank(r) for r in range(2)]},
    }


def test_rows_take_the_slowest_rank_and_the_worst_peak_against_the_own_shard():
    rows = _rows("10M", _result(1.0))
    old, new, elastic_old, elastic_new = rows
    assert old["time_s"] == 3.5 + 3 and new["time_s"] == 0.7  # the slowest rank's
    assert old["peak_extra_MiB"] == 500 and old["peak_over_shard"] == 5.0  # rank 0 merges the model
    assert new["peak_over_shard"] == 0.5 and new["bytes_MiB"] == new["minimum_MiB"] == 30
    assert old["bytes_MiB"] == 1600  # the disk: written and read
    assert "x2.0" in new["parts"]  # transfer 0.2 s against a plain send of 0.1 s
    assert "build 0.50 (5.0 copies of the own shard)" in new["parts"]
    assert elastic_old["peak_over_shard"] == 7.5 and elastic_new["peak_over_shard"] == 2.0
    assert "into the built engine: +1.30x own shard, allocated +1.00x" in elastic_new["parts"]


def test_plot_draws_and_extrapolates(tmp_path: Path):
    rows = _rows("10M", _result(1.0)) + _rows("100M", _result(10.0))
    _plot(rows, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 10_000


def test_rows_without_rank0_path_are_the_plan_rows_only():
    """At 400M rank 0's path does not fit the host (--old-sizes): its rows are left out, not made up."""
    result = _result(1.0)
    for r in result["resplit"]["ranks"] + result["elastic"]["ranks"]:
        r["old"] = None
    rows = _rows("400M", result, layers=16)
    assert [(r["change"], r["path"]) for r in rows] == [
        ("re-split 1 layer", "plan (rank to rank)"),
        ("elastic 4 -> 2 ranks", "plan (own slices)"),
    ]
    assert all(r["layers"] == 16 for r in rows) and rows[0]["time_s"] == 0.7


def test_repeated_resplits_give_medians_of_interleaved_pairs_and_the_worst_peak():
    """--repeats: each re-split's transfer against the plain send measured right before it; the row gives
    the median ratio, its spread, and the worst peak of any repeat."""
    result = _result(1.0)
    for r in result["resplit"]["ranks"]:
        first = r["new"]
        r["new"] = {**first, "repeats": [
            {**first, "transfer_s": 0.2, "raw_send_s": 0.1},
            {**first, "transfer_s": 0.9, "raw_send_s": 0.1, "peak_rss": 1000 * MIB},
            {**first, "transfer_s": 0.3, "raw_send_s": 0.2},
        ]}  # fmt: skip
    new = _rows("10M", result)[1]
    assert new["repeats"] == 3 and new["transfer_over_send"] == 2.0  # median of 2.0, 9.0, 1.5
    assert "x2.0, x1.5-9.0 over 3" in new["parts"]
    assert new["peak_over_shard"] == 1.0  # the second repeat's 100 MiB over 100 MiB


def test_two_rank_resplits_give_re_split_rows_and_a_parts_plot(tmp_path: Path):
    """--resplit-ranks 2 (what fits 400M): no elastic case; the rows say the world, carry the plan's parts,
    and the plot draws the transfer, the plain send and the rebuild against the model size in its place."""
    results = []
    for scale in (1.0, 10.0, 40.0):
        result = _result(scale)
        result["resplit"]["world"], result["elastic"] = 2, None
        results.append(_rows(f"{int(scale * 10)}M", result))
    assert all(len(rows) == 2 and {r["change"] for r in rows} == {"re-split 1 layer"} for rows in results)
    plan = results[-1][1]
    assert plan["ranks"] == 2 and plan["path"].startswith("plan")
    assert plan["transfer_s"] > 0 and plan["send_s"] > 0 and plan["build_s"] > 0
    _plot([r for rows in results for r in rows], tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 10_000
