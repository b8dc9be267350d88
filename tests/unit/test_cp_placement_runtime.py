"""The CP placement's runtime (megahet/runtime/cp_placement.py, issue 45): it counts what each plan gives its
rank, turns the CP ranks' gathered compute times into speeds (median over the window, fastest 1), plans the
next micro-batches with them, and leaves evaluation's micro-batches out of the step's work.

Run: ``python -m pytest tests/unit/test_cp_placement_runtime.py -q`` (a second).
"""

from __future__ import annotations

import pytest
import torch

from megahet.policy.cp_placement import slice_cost
from megahet.policy.packing import DocCost
from megahet.runtime.cp_placement import CPPlacement

COST = DocCost(a=1e-8, b=1e-6, c=0.0)
LENGTHS = [4096, 700, 300, 2500, 120, 64, 1800]


def runtime(measured: bool = True, window: int = 1, speeds=(1.0, 1.0), stages: int = 1) -> CPPlacement:
    return CPPlacement(
        cost_of=lambda: COST, speeds=speeds, measured=measured, cp_rank=1, group=None, block=256, kv_cost=0.1,
        window=window, stages=stages,
    )  # fmt: skip


def gathered(placement: CPPlacement, rows: list[tuple[float, ...]]) -> None:
    """What the all-gather of (compute seconds, predicted seconds, CP rank, stage) would hand over; rows
    without a CP rank are CP ranks 0, 1, ... in order (TP 1), rows without a stage stage 0 (PP 1)."""
    rows = [row if len(row) >= 3 else (*row, cp) for cp, row in enumerate(rows)]
    rows = [row if len(row) == 4 else (*row, 0) for row in rows]
    tensors = [torch.tensor(row, dtype=torch.float64) for row in rows]
    placement._pending = (None, tensors, 0, 1.0)


def test_it_counts_the_predicted_seconds_and_received_tokens_of_its_own_slices() -> None:
    placement = runtime()
    plan = placement.placer(LENGTHS)
    mine = sum(slice_cost(COST, s.start, s.stop) for s in plan.slices_of(1))
    assert placement.predicted_s == pytest.approx(mine) and mine > 0
    assert placement.kv_tokens == plan.kv_tokens()[1]
    with placement.evaluation():  # evaluation's micro-batches are not the step's work
        placement.placer(LENGTHS)
    assert placement.predicted_s == pytest.approx(mine)


def test_measured_speeds_follow_the_ranks_compute_and_shift_the_work() -> None:
    placement = runtime()
    before = placement.placer(LENGTHS).tokens()
    gathered(placement, [(1.0, 1.0), (2.0, 1.0)])  # rank 1 took twice as long for the same predicted work
    placement.before_forward_backward(1)
    assert placement.speeds == (1.0, 0.5)
    after = placement.placer(LENGTHS).tokens()
    assert after[1] < before[1] and after[0] > before[0]
    assert placement.report()["speed_cp1"] == 0.5


def test_one_outlier_does_not_move_a_window_of_three() -> None:
    placement = runtime(window=3)
    for rows in ([(1.0, 1.0), (1.0, 1.0)], [(1.0, 1.0), (1.0, 1.0)], [(1.0, 1.0), (5.0, 1.0)]):
        gathered(placement, rows)
        placement.before_forward_backward(1)
    assert placement.speeds == (1.0, 1.0)


def test_declared_speeds_stay_and_measure_nothing() -> None:
    placement = runtime(measured=False, speeds=(1.0, 0.5))
    placement.ctx = type("Ctx", (), {"times": type("T", (), {"compute_s": 1.0})()})()
    placement.after_step(None)  # no gather: nothing pending
    placement.before_forward_backward(1)
    assert placement.speeds == (1.0, 0.5) and placement._pending is None


def test_a_cp_rank_runs_at_its_slowest_tp_ranks_pace() -> None:
    """TP 2 x CP 2: the gathered rows of both TP ranks of each CP rank; the CP rank's time is the slower one,
    the same speeds on every rank of the group."""
    placement = runtime()
    gathered(placement, [(1.0, 1.0, 0), (1.2, 1.0, 0), (1.0, 1.0, 1), (2.4, 1.0, 1)])
    placement.before_forward_backward(1)
    assert placement.speeds == pytest.approx((1.0, 0.5))


def test_the_console_line_prints_the_cp_speeds_and_received_tokens() -> None:
    from megahet.logging import format_console_line

    placement = runtime(speeds=(1.0, 0.47))
    placement.last_kv_tokens = 3072
    line = format_console_line(5, 10, {"loss": 2.0, **placement.report()})
    assert line == "step      5/10 | loss 2.0000 | cp speed 1.00 0.47 | cp kv 3072"


def test_a_checkpoint_carries_the_measured_speeds_and_the_window() -> None:
    """Saved after a step whose measurement is still in flight: it is folded in first (as the next step
    would), and the resumed placement plans with the same speeds and goes on from the same samples."""
    placement = runtime(window=3)
    gathered(placement, [(1.0, 1.0), (2.0, 1.0)])
    placement.before_forward_backward(1)
    gathered(placement, [(1.0, 1.0), (4.0, 1.0)])  # in flight at the save
    state = placement.state_dict()
    assert state["speeds"] == [1.0, 0.375] and state["samples"] == [[1.0, 1.0], [0.5, 0.25]]

    resumed = runtime(window=3)
    resumed.load_state_dict(state)
    assert resumed.speeds == (1.0, 0.375)
    assert resumed.placer(LENGTHS).tokens() == placement.placer(LENGTHS).tokens()
    gathered(resumed, [(1.0, 1.0), (4.0, 1.0)])  # the third sample: the median of 0.5, 0.25, 0.25
    resumed.before_forward_backward(2)
    assert resumed.speeds == (1.0, 0.25)
    with pytest.raises(ValueError, match="saved speeds are for 2 CP ranks, this run has 4"):
        runtime(speeds=(1.0,) * 4).load_state_dict(state)


def test_with_pipeline_stages_a_cp_rank_runs_at_its_slowest_stage() -> None:
    """PP 2 x CP 2: each stage's rates compare its own CP ranks (stage 1 does a third of stage 0's work per
    predicted second here, alike on both CP ranks: no CP rank is slower for it); CP rank 1 is half speed on
    stage 0 and 0.8 on stage 1: one plan on both stages, at 0.5."""
    placement = runtime(stages=2)
    gathered(placement, [(1.0, 1.0, 0, 0), (2.0, 1.0, 1, 0), (3.0, 1.0, 0, 1), (3.75, 1.0, 1, 1)])
    placement.before_forward_backward(1)
    assert placement.speeds == pytest.approx((1.0, 0.5))
    gathered(placement, [(1.0, 1.0, 0, 0), (1.0, 1.0, 1, 0), (3.0, 1.0, 0, 1), (3.75, 1.0, 1, 1)])
    placement.before_forward_backward(2)
    assert placement.speeds == pytest.approx((1.0, 0.8))
