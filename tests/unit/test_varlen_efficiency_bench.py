"""The variable-length benchmark's arithmetic (benchmarks/varlen_efficiency.py), without launching runs:
each strategy's arguments, E against the ideal and the replica spread of a step, the summary's medians,
the speed-ups and the goal lines.

Run: ``python -m pytest tests/unit/test_varlen_efficiency_bench.py -q``
"""

from __future__ import annotations

import pytest

from benchmarks import varlen_efficiency as bench


def test_strategies_run_the_same_token_budget():
    fixed = bench.strategy_args("fixed", 2048, 16384, measured=False)
    assert fixed == ["--train.global_batch_size", "8"]  # 8 chunks of 2048 = 16384 tokens
    cost = bench.strategy_args("cost", 2048, 16384, measured=True)
    assert "16384" in cost and "measured" in cost and "cost" in cost
    assert "measured" not in bench.strategy_args("tokens", 2048, 16384, measured=True)  # blind to speed


def test_efficiency_of_packed_and_fixed_steps():
    # Replica 1 is half as fast and got half the work: both finish together, E = 1.
    even = {"meas_s_dp0": 2.0, "meas_s_dp1": 2.0, "pred_s_dp0": 2.0, "pred_s_dp1": 1.0}
    assert bench.efficiency(even) == pytest.approx((1.0, 1.0))
    # The same replicas with equal work: replica 1 takes twice as long; the ideal is 3 work / 1.5 speed.
    blind = {"meas_s_dp0": 1.5, "meas_s_dp1": 3.0, "pred_s_dp0": 1.5, "pred_s_dp1": 1.5}
    spread, e = bench.efficiency(blind)
    assert spread == pytest.approx(3.0 / 2.25) and e == pytest.approx(2.0 / 3.0)
    fixed = {"compute_min_s": 1.0, "compute_max_s": 2.0}  # equal work: harmonic mean over the slowest
    assert bench.efficiency(fixed)[1] == pytest.approx((2 / 1.5) / 2.0)


def test_summary_speedups_and_goals():
    def record(step_s, mape):
        return {
            "step_time_s": step_s, "tokens_per_s": 1000 / step_s, "meas_s_dp0": 1.0, "meas_s_dp1": 1.0,
            "pred_s_dp0": 1.0, "pred_s_dp1": 1.0, "mb_max_mean": 1.05, "padding": 0.1, "cost_mape": mape,
        }  # fmt: skip

    rows = [
        bench.summarize("alike", "tokens", [record(9.0, 0.5)] + [record(2.0, 0.1)] * 3, skip=1),
        bench.summarize("alike", "cost", [record(9.0, 0.5)] + [record(1.6, 0.04)] * 3, skip=1),
    ]
    assert rows[1]["step_s"] == 1.6 and rows[1]["cost_mape"] == 0.04  # the start-up step is skipped
    bench.add_speedups(rows)
    assert rows[1]["speedup_vs_tokens"] == pytest.approx(1.25) and rows[0]["speedup_vs_tokens"] == 1.0
    merged = bench.merge_repeats([rows[1], {**rows[1], "step_s": 2.0}, {**rows[1], "step_s": 1.0}])
    assert merged["step_s"] == 1.6 and merged["step_s_runs"] == [1.6, 2.0, 1.0]
    goals = bench.goals(rows, "code", 2048)
    assert len(goals) == 1 and "1.25x over (c)" in goals[0] and "E 1.000" in goals[0]
