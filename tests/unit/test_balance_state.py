"""The balancer's checkpointed state: a BalanceController saved at any step and restored into a new one
(through torch.save / torch.load, as a checkpoint does) makes the same decisions as the uninterrupted
controller from the same measurements: targets, plan changes, the gammas and moves handed to the
ResizeController, the efficiency window; and its trace continues the saved run's, without the rows a
killed run wrote after the checkpoint. One that starts fresh instead (what resuming did before) does
not, which shows the comparison can fail.

The controller runs without a process group: each step's gathered rows are handed to it as the
asynchronous all-gather would leave them, from a scripted profile (TP rank 1 at a quarter of the speed
for steps 6-17, at 0.6 from step 24).

Run: ``python -m pytest tests/unit/test_balance_state.py -q`` (about 3 s).
"""

from __future__ import annotations

import io
import json
import time
import types

import pytest
import torch

from megahet.config import MegahetConfig, apply_overrides
from megahet.parallel import ParallelLayout
from megahet.policy.planner import WorkTarget
from megahet.runtime.balancer import BalanceController
from megahet.runtime.resizer import ResizeController
from megahet.runtime.timing import StepTimes
from megahet.tensor_parallel.plan import ResizePlan

STEPS, TP = 30, 2
LAYOUT = ParallelLayout(
    rank=0, world_size=TP, tp_rank=0, tp_size=TP, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1
)


def _speed(step: int) -> float:
    return 0.25 if 6 <= step < 18 else 0.6 if step >= 24 else 1.0


class _FakeResize:
    """What the balancer reads from and hands to the ResizeController."""

    def __init__(self):
        self.gammas, self.moves, self.replans = {}, {}, 0
        self.units = {("mlp", 1): 8, ("attn", 1): 4}
        self.executor = types.SimpleNamespace(executed_flops=lambda: 0, plan=ResizePlan())

    set_targets = ResizeController.set_targets  # the real bridge from targets to gammas and moves

    def request_replan(self) -> None:
        self.replans += 1


class _Gathered:
    def wait(self) -> None:
        pass


def _controller(mode: str, trace=None, whole_step: bool = True) -> BalanceController:
    overrides = {"balance.mode": mode, "balance.window": 3, "balance.interval": 2, "balance.trace": trace}
    overrides["balance.whole_step"] = whole_step
    cfg = apply_overrides(MegahetConfig(), overrides)
    ctx = types.SimpleNamespace(times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), shares=(4,))
    return BalanceController(cfg, LAYOUT, _FakeResize(), ctx)


def _step(controller: BalanceController, step: int) -> dict:
    """One step: plan from what was gathered, then this step's rows (the plan's work at the profile's
    speeds, so work / time is the speed, and a fixed work that is slow on a slow rank too); returns what the controller decided."""
    controller.before_forward_backward(step)
    work = controller.targets[0].work(TP)
    speeds = [1.0, _speed(step)]
    rows = [
        torch.tensor(
            [0, tp, 1e9 * work[tp], work[tp] / speeds[tp], work[tp] / speeds[tp], 0.01, 0.1 / speeds[tp]]
            + [0.05 / speeds[tp]],  # the optimizer step's part of the fixed work
            dtype=torch.float64,
        )
        for tp in range(TP)
    ]
    controller._pending = (_Gathered(), rows, step, 0.5)
    return {
        "targets": list(controller.targets),
        "changes": controller.changes,
        "gammas": dict(controller.resize.gammas),
        "moves": dict(controller.resize.moves),
        "replans": controller.resize.replans,
    }


def _checkpoint(controller: BalanceController) -> dict:
    buffer = io.BytesIO()
    torch.save(controller.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("mode", ["resize", "migrate", "semi"])
@pytest.mark.parametrize("saved_at", [4, 7, 11, 20, 25])
def test_a_resumed_balancer_decides_as_the_uninterrupted_one(mode: str, saved_at: int) -> None:
    whole = _controller(mode)
    expected = [_step(whole, step) for step in range(STEPS)]
    assert expected[-1]["changes"] >= 3  # the profile makes it plan, return to even and plan again

    killed = _controller(mode)
    for step in range(saved_at + 1):
        _step(killed, step)
    state = _checkpoint(killed)
    resumed, fresh = _controller(mode), _controller(mode)
    resumed.load_state_dict(state)
    assert resumed.resize.gammas == expected[saved_at]["gammas"]  # handed over without a step
    got = [_step(resumed, step) for step in range(saved_at + 1, STEPS)]
    for step, decision in zip(range(saved_at + 1, STEPS), got):
        want = expected[step]
        assert decision["targets"] == want["targets"], step
        assert decision["changes"] == want["changes"], step
        assert (decision["gammas"], decision["moves"]) == (want["gammas"], want["moves"]), step
    assert resumed.report()["balance_eff"] == pytest.approx(whole.report()["balance_eff"])
    if expected[saved_at]["changes"]:  # once it has planned, starting over is visibly different
        fresh_run = [_step(fresh, step) for step in range(saved_at + 1, STEPS)]
        assert [(d["targets"], d["changes"]) for d in fresh_run] != [
            (d["targets"], d["changes"]) for d in got
        ]


def test_the_trace_continues_the_saved_runs(tmp_path) -> None:
    whole_trace, trace = tmp_path / "whole.jsonl", tmp_path / "trace.jsonl"
    whole = _controller("semi", str(whole_trace))
    for step in range(STEPS):
        _step(whole, step)
    whole.close()

    killed = _controller("semi", str(trace))
    for step in range(15):  # checkpoint after step 10, killed after step 14
        _step(killed, step)
        if step == 10:
            state = _checkpoint(killed)
    killed._collect()
    killed.trace.close()
    resumed = _controller("semi", str(trace))
    resumed.load_state_dict(state)
    assert len(trace.read_text().splitlines()) == 15  # nothing is touched before the first new row
    for step in range(11, STEPS):
        _step(resumed, step)
    resumed.close()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows == [json.loads(line) for line in whole_trace.read_text().splitlines()]
    assert trace.with_suffix(".png").is_file()


@pytest.mark.parametrize("mode", ["resize", "migrate", "semi"])
def test_declared_speeds_plan_the_tp_group_before_any_measurement(mode: str) -> None:
    """hetero.speeds feeds the TP plan from step 0 (`start_from`): the plan the measured speeds would
    give, handed to the ResizeController at once; the measured speeds take over later."""
    declared = _controller(mode)
    declared.start_from([[2.0, 0.5]])  # relative: normalized to the fastest
    measured = _controller(mode, whole_step=False)  # declared speeds know no fixed work
    for step in range(8, 12):  # TP rank 1 at 0.25 (steps 6-17): measured, then planned at the interval
        _step(measured, step)
    measured.before_forward_backward(12)
    assert declared.targets == measured.targets != [type(declared.targets[0])()]
    assert (declared.resize.gammas, declared.resize.moves) == (measured.resize.gammas, measured.resize.moves)
    assert declared.resize.replans == 1


def _rows(work: list[float], layers_s: list[float], fixed_s: list[float]) -> list[torch.Tensor]:
    return [
        torch.tensor(
            [0, tp, 1e9 * work[tp], layers_s[tp], layers_s[tp], 0.0, fixed_s[tp], fixed_s[tp]],
            dtype=torch.float64,
        )
        for tp in range(TP)
    ]


@pytest.mark.parametrize("mode", ["resize", "migrate", "semi"])
def test_a_rank_with_more_fixed_work_gets_less_movable_work(mode: str) -> None:
    """Issue 31: equal speeds in the layers, but TP rank 1's fixed work (its optimizer step) takes 0.5 s
    more; the whole-step balancer moves units off it until the whole steps end together; with
    balance.whole_step=false nothing moves, and equal fixed work moves nothing either."""
    decided = {}
    for whole_step, fixed_s in ((True, [0.1, 0.6]), (False, [0.1, 0.6]), (True, [0.3, 0.3])):
        controller = _controller(mode, whole_step=whole_step)
        for step in range(6):
            controller.before_forward_backward(step)
            work = controller.targets[0].work(TP)
            controller._pending = (_Gathered(), _rows(work, work, fixed_s), step, 1.0)
        controller.before_forward_backward(6)
        decided[(whole_step, fixed_s[1])] = controller.targets[0]
    assert decided[(False, 0.6)].is_even and decided[(True, 0.3)].is_even
    moved = decided[(True, 0.6)]
    work = moved.work(TP)
    assert work[1] < 1.0 - 0.2  # 1 s of layers each, 0.5 s more fixed work on rank 1
    if mode == "migrate":
        assert work == pytest.approx([1.25, 0.75])  # whole steps 1.25 + 0.1 = 0.75 + 0.6


def test_the_first_step_of_a_process_is_a_warm_up_not_a_sample() -> None:
    """A window of one sample, planning every step: rank 1's slow first step (lazy initialization on a
    busy host) would move work on its own; it is not a sample, so alike ranks stay even. After a
    resume the first step is a warm-up again."""
    cfg = apply_overrides(
        MegahetConfig(), {"balance.mode": "migrate", "balance.window": 1, "balance.interval": 1}
    )
    ctx = types.SimpleNamespace(times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), shares=(4,))
    controller = BalanceController(cfg, LAYOUT, _FakeResize(), ctx)
    for step in range(6):
        controller.before_forward_backward(step)
        layers = [1.0, 4.0 if step == 0 else 1.0]
        controller._pending = (_Gathered(), _rows([1.0, 1.0], layers, [0.0, 0.0]), step, 1.0)
        assert controller.targets[0].is_even, step
    resumed = BalanceController(cfg, LAYOUT, _FakeResize(), ctx)
    resumed.load_state_dict(_checkpoint(controller))
    resumed.before_forward_backward(6)
    resumed._pending = (_Gathered(), _rows([1.0, 1.0], [1.0, 4.0], [0.0, 0.0]), 6, 1.0)
    resumed.before_forward_backward(7)
    assert resumed.targets[0].is_even


def test_a_static_balancer_measures_every_step_and_never_plans(tmp_path, monkeypatch) -> None:
    """balance.mode static with a trace (measuring only, issue 48): every step is measured and traced, the
    slow rank shows in its speed, and the planner never runs (its targets stay the even split)."""
    import megahet.runtime.balancer as balancer_module

    def refuse(*args, **kwargs):
        raise AssertionError("a static balancer ran the planner")

    monkeypatch.setattr(balancer_module, "balance", refuse)
    trace = tmp_path / "static.jsonl"
    controller = _controller("static", trace=str(trace))
    for step in range(12):
        decided = _step(controller, step)
        assert decided["targets"] == [WorkTarget()] and decided["replans"] == 0, step
    controller.close(final=False)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))  # close() folds the last step in
    assert rows[-1]["speed"][0][1] == pytest.approx(0.25, rel=0.05)  # TP rank 1 at a quarter (steps 6-17)


def test_with_context_parallelism_a_tp_rank_is_measured_at_its_slowest_cp_rank(tmp_path) -> None:
    """TP 2 x CP 2: the gathered rows hold each (replica, TP rank) twice, once per CP rank. TP rank 1 is slow
    on CP rank 1 only; every CP rank plans on the slower row, so both run the same plan (they exchange the
    same heads' keys and values). Only CP rank 0 writes the trace (both wrote one file before)."""
    cfg = apply_overrides(
        MegahetConfig(), {"balance.mode": "migrate", "balance.window": 1, "balance.interval": 1}
    )
    ctx = types.SimpleNamespace(times=StepTimes(0.0, 0.0, 0.0), step_t0=time.perf_counter(), shares=(4,))
    plans = []
    for cp_rank in (0, 1):
        layout = ParallelLayout(
            rank=cp_rank * TP, world_size=2 * TP, tp_rank=0, tp_size=TP, pp_rank=0, pp_size=1, dp_rank=0,
            dp_size=1, cp_rank=cp_rank, cp_size=2,
        )  # fmt: skip
        traced = apply_overrides(cfg, {"balance.trace": str(tmp_path / "trace.jsonl")})
        assert (BalanceController(traced, layout, _FakeResize(), ctx).trace is None) == (cp_rank == 1)
        controller = BalanceController(cfg, layout, _FakeResize(), ctx)
        for step in range(3):
            controller.before_forward_backward(step)
            rows = _rows([1.0, 1.0], [1.0, 1.0], [0.0, 0.0]) + _rows([1.0, 1.0], [1.0, 4.0], [0.0, 0.0])
            controller._pending = (_Gathered(), rows if cp_rank == 0 else rows[::-1], step, 1.0)
        controller.before_forward_backward(3)
        assert controller.group_speeds(0) == pytest.approx([1.0, 0.25])
        plans.append(controller.targets)
    assert plans[0] == plans[1] and not plans[0][0].is_even
