"""The balancer's telemetry: compute efficiency, the console's per-TP-rank fields, plan fractions,
and the trace -> PNG tool (tools/plot_balance.py), including its one-line errors."""

from __future__ import annotations

import json

import pytest

from megahet.logging import format_console_line
from megahet.runtime.balancer import compute_efficiency
from megahet.runtime.trace_writer import trace_path
from megahet.tensor_parallel.plan import ResizePlan
from tools import plot_balance


def test_compute_efficiency_is_ideal_over_slowest():
    assert compute_efficiency([1.0, 1.0], [1.0, 1.0]) == pytest.approx(1.0)
    # Rank 1 runs at a quarter speed with the even split: ideal 2 / (1 + 0.25) = 1.6 s vs 4 s.
    assert compute_efficiency([1.0, 1.0], [1.0, 4.0]) == pytest.approx(0.4)
    # Balanced (1.6 units at speed 1, 0.4 at 0.25): both take 1.6 s.
    assert compute_efficiency([1.6, 0.4], [1.6, 1.6]) == pytest.approx(1.0)
    assert compute_efficiency([1.0, 0.0], [1.0, 0.0]) != compute_efficiency([1.0, 0.0], [1.0, 0.0])  # nan


def test_console_line_groups_per_tp_rank_metrics():
    line = format_console_line(
        3,
        9,
        {
            "loss": 2.0,
            "speed_tp0": 1.0,
            "gamma_tp0": 0.0,
            "speed_tp1": 0.25,
            "gamma_tp1": 0.5,
            "balance_eff": 0.9,
        },
    )
    assert line == "step      3/9 | loss 2.0000 | speed 1.00 0.25 | gamma 0.00 0.50 | E 0.900"


def test_plan_unit_fractions_count_dropped_sent_and_hosted():
    units = {("attn", 1): 4, ("mlp", 1): 12}
    plan = ResizePlan(
        blocks={("mlp", 1): {(0, 0): (0, 1, 2, 3)}},
        migrated={("mlp", 1): {(0, 1): {0: (10, 11), 2: (9,)}}, ("attn", 1): {(1, 1): {0: (3,)}}},
    )
    assert plan.unit_fractions(units, 0, 3) == {
        "dropped": [0.25, 0.0, 0.0],
        "sent": [0.0, 3 / 16, 0.0],
        "hosted": [2 / 16, 0.0, 1 / 16],
    }
    assert plan.unit_fractions(units, 1, 3)["sent"] == [0.0, 1 / 16, 0.0]  # the other DP replica


def test_trace_path_per_writer(tmp_path):
    assert trace_path(str(tmp_path / "t.jsonl"), None) == tmp_path / "t.jsonl"
    assert trace_path(str(tmp_path / "t.jsonl"), "stage1") == tmp_path / "t_stage1.jsonl"
    assert trace_path(str(tmp_path / "t.jsonl"), "dp") == tmp_path / "t_dp.jsonl"


def _row(step: int, slow: bool) -> dict:
    busy = [0.1, 0.4 if slow else 0.1]
    return {
        "step": step,
        "step_s": max(busy) + 0.05,
        "efficiency": [compute_efficiency([1.0, 1.0], busy)],
        "busy_s": [busy],
        "work_gflop": [[1.0, 1.0]],
        "speed": [[1.0, 0.25 if slow else 1.0]] if step else [None],
        "dropped": [[0.0, 0.0]],
        "sent": [[0.0, 0.6 if slow else 0.0]],
        "hosted": [[0.6 if slow else 0.0, 0.0]],
    }


def test_plot_balance_draws_a_trace_and_reports_bad_inputs(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(_row(s, s >= 3)) + "\n" for s in range(6)))
    assert plot_balance.main([str(trace)]) == 0
    png = tmp_path / "trace.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert plot_balance.main([str(trace), "--dp", "1"]) == 2
    assert "no DP replica 1" in capsys.readouterr().err
    assert plot_balance.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "--balance.trace" in capsys.readouterr().err
    trace.write_text(json.dumps(_row(0, False)) + "\n{truncated")
    assert plot_balance.main([str(trace)]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err


def test_plot_balance_draws_a_data_parallel_trace(tmp_path):
    """The DP balancer's run_dp.jsonl (shares and replica speeds per step) draws as its own PNG."""
    trace = tmp_path / "run_dp.jsonl"
    rows = [
        {
            "step": s,
            "step_s": 0.5,
            "shares": [8, 8] if s < 3 else [11, 5],
            "replica_speed": None if s == 0 else [1.0, 0.5],
            "region_s": [0.4, 0.4],
        }
        for s in range(6)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_balance.main([str(trace)]) == 0
    png = tmp_path / "run_dp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
