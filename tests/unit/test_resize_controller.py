"""Tests of megahet's ResizeController in one process (TP=1, DP=1, gloo): a checkpoint round trip resumes
exactly the same plans (per priority score), a rank the balancer resizes for the first time is
planned, and the priority statistics are kept only where units can be dropped.

Run: ``python -m pytest tests/unit/test_resize_controller.py -q`` (about 30 s).
"""

from __future__ import annotations

import copy

import pytest
import torch
from resize_gpt import (
    HN,
    SEED,  # noqa: F401  (the world1 fixture seeds this module's world with it)
    SEQ,
    backward,
    batches,
    gpt,
)

from megahet.config import load_config
from megahet.parallel import current_layout
from megahet.policy.planner import WorkTarget
from megahet.runtime.resizer import ResizeController
from megahet.tensor_parallel.plan import ResizePlan


def run_controller(controller, model, optimizer, steps, before_step=lambda t: None) -> list[dict]:
    """Train `model` with `controller` as the Trainer would; returns each step's plan."""
    engine = type("Engine", (), {"optimizer": optimizer})()
    plans = []
    for t in steps:
        before_step(t)
        controller.before_forward_backward(t)
        optimizer.zero_grad(set_to_none=True)
        backward(model, batches(t))
        controller.before_step(engine)
        optimizer.step()
        controller.after_step(engine)
        plans.append(controller.executor.plan.to_dict())
    return plans


@pytest.mark.parametrize("score", ["variance", "taylor"])
def test_controller_state_round_trip_resumes_the_same_plans(world1, score) -> None:
    """Model + optimizer + ResizeController restored from their state dicts at step 5 continue with
    exactly the plans (priority selection, 'same' imputation) and weights the uninterrupted run has."""

    args = (
        "--resize.gamma 0:0.5 --resize.reselect_interval 2 --resize.imputation same --resize.max_drop_steps 4 "
        f"--resize.priority_score {score}"
    )
    cfg = load_config(args.split())
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctrl = ResizeController(cfg, model, current_layout(), num_microbatches=2)
    assert ctrl.executor.track_weights is (score == "taylor")  # weights sampled only where they are used

    def run(controller, first, last):
        return run_controller(controller, model, optimizer, range(first, last))

    run(ctrl, 0, 5)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), ctrl.state_dict()))
    expected_plans = run(ctrl, 5, 11)
    expected_weights = copy.deepcopy(model.state_dict())

    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    restored = ResizeController(cfg, model, current_layout(), num_microbatches=2)  # fresh hooks, fresh state
    ctrl.executor.apply(ResizePlan())  # the old controller's hooks stay registered: make them inert
    ctrl.executor._step_grad.clear()
    restored.load_state_dict(saved[2])
    assert run(restored, 5, 11) == expected_plans
    assert len({str(p) for p in expected_plans}) > 1  # the plan really changed over the continuation
    for name, value in model.state_dict().items():
        if torch.is_tensor(value):  # megatron-core also keeps non-tensor "_extra_state" entries
            assert torch.equal(value, expected_weights[name]), name


def test_controller_resizes_a_rank_the_balancer_names_for_the_first_time(world1, monkeypatch) -> None:
    """The balancer sets gammas at run time for ranks the config never resized; priority selection
    (drop ages per rank) must plan them too, and the ages start counting from there. (One process: its TP
    group of one keeps statistics as a group of two would.)"""

    monkeypatch.setattr(ResizeController, "tracks_priority", staticmethod(lambda cfg, tp_size: True))
    cfg = load_config(["--resize.selection", "priority", "--balance.mode", "resize"])
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctrl = ResizeController(cfg, model, current_layout(), num_microbatches=2)

    def balancer(t):
        if t == 1:
            ctrl.set_targets([WorkTarget(gamma={0: 0.5})])  # what BalanceController does

    run_controller(ctrl, model, optimizer, range(3), balancer)
    for block, n in ctrl.units.items():
        dropped = ctrl.executor.plan.dropped(block, 0, 0)
        assert len(dropped) == n // 2
        assert sorted(ctrl.drop_age[(block, (0, 0))].nonzero()[0]) == sorted(dropped)


@pytest.mark.parametrize(
    ("args", "tracked"),
    [
        (["--balance.mode", "semi"], True),
        (["--balance.mode", "resize"], True),
        (["--resize.gamma", "1:0.5"], True),
        (["--balance.mode", "migrate"], False),  # migration never selects units
        (["--resize.migrate", "1:0.5"], False),
        (["--balance.mode", "semi", "--resize.selection", "random"], False),
    ],
)
def test_priority_statistics_are_kept_only_where_units_can_be_dropped(args, tracked) -> None:
    """Per-unit gradient statistics cost a copy of the gradients every step: only resizing needs them, and
    a balancer resizes only a TP group of two or more (static gammas are the user's, at any size)."""

    cfg = load_config(["--parallel.tp", "2", *args])
    assert ResizeController.tracks_priority(cfg, 2) is tracked
    assert ResizeController.tracks_priority(cfg, 1) is (tracked and "--resize.gamma" in args)


def test_controller_keeps_a_multiple_of_unit_multiple_mlp_units(world1) -> None:
    """resize.unit_multiple reaches the plan: a resized MLP keeps a multiple of it, attention whole heads."""
    cfg = load_config(
        ["--resize.gamma", "0:0.3", "--resize.selection", "random", "--resize.unit_multiple", "8"]
    )
    model = gpt()
    ctrl = ResizeController(cfg, model, current_layout(), num_microbatches=2)
    run_controller(ctrl, model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(1))
    for block, n in ctrl.units.items():
        kept = n - len(ctrl.executor.plan.dropped(block, 0, 0))
        if block[0] == "mlp":
            assert kept % 8 == 0 and kept < n and kept != n - int(0.3 * n), (block, n, kept)
        else:
            assert kept == n - int(0.3 * n), (block, n, kept)


def test_priority_statistics_sample_one_step_in_score_interval(world1) -> None:
    """resize.score_interval k: the gradients are sampled and the statistics updated on steps 0, k, 2k, ...
    only (no copy of the gradients on the others: issue 48), each sample decaying the EMA by decay^k."""

    def counts_after_7_steps(interval: int) -> int:
        cfg = load_config(f"--resize.gamma 0:0.5 --resize.score_interval {interval}".split())
        model = gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ctrl = ResizeController(cfg, model, current_layout(), num_microbatches=2)
        sampled = []
        run_controller(ctrl, model, optimizer, range(7), lambda t: sampled.append(ctrl.executor.sampling))
        assert sampled[1:] == [t % interval == 0 for t in range(6)]  # set at each step, seen at the next
        ctrl.executor.apply(ResizePlan())  # leave the model's hooks inert for the next controller
        ctrl.executor._step_grad.clear()
        return max(int(s.count.max()) for s in ctrl.stats.values())  # a unit computed on every sample

    assert counts_after_7_steps(1) == 7
    assert counts_after_7_steps(3) == 3  # steps 0, 3, 6


def test_a_reselection_runs_only_when_there_are_units_to_drop(world1, monkeypatch) -> None:
    """Issue 48: the plan is re-drawn every resize.reselect_interval steps only when some rank drops units;
    with nothing to drop it would come out the same, so a healthy group re-plans only when asked (the
    configured plan at the first step, then each balancer change), and the reselections come back with a
    rank to resize."""
    cfg = load_config(["--resize.reselect_interval", "2", "--resize.selection", "random"])
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctrl = ResizeController(cfg, model, current_layout(), num_microbatches=2)
    applied = []
    apply = ctrl.executor.apply
    monkeypatch.setattr(ctrl.executor, "apply", lambda plan: (applied.append(ctrl.step), apply(plan))[1])

    def targets(t: int) -> None:
        if t == 3:
            ctrl.set_targets([WorkTarget(gamma={0: 0.5})])  # the balancer resizes the rank
        if t == 7:
            ctrl.set_targets([WorkTarget()])  # and returns to the even split

    run_controller(ctrl, model, optimizer, range(10), targets)
    assert applied == [0, 3, 4, 6, 7]  # first step; the change; reselections 4, 6; the return to even
    ctrl.executor.apply(ResizePlan())  # leave the model's hooks inert for the next controller


def test_migration_is_planned_by_unit_work_of_the_attention_sequence(world1, monkeypatch) -> None:
    """Issue 47: the controller hands `plan_migration` every block's unit work at the task's sequence
    length, so that a layer's MLP absorbs its whole heads' rounding (the policy: test_balance_planner.py)."""
    from megahet.runtime import resizer

    seen = []
    monkeypatch.setattr(resizer, "plan_migration", lambda *args: seen.append(args) or {})
    ctrl = ResizeController(load_config([]), gpt(), current_layout(), num_microbatches=2, seq_length=SEQ)
    ctrl.moves = {(0, 0): {1: 0.5}}  # as a TP=2 balancer's target would set it
    ctrl.before_forward_backward(0)
    unit_work = seen[-1][3]
    assert unit_work == ctrl.executor.unit_work(SEQ)
    assert unit_work[("attn", 1)] == ctrl.executor.unit_work(0)[("attn", 1)] + 4 * HN * SEQ  # the scores


def test_unit_scores_average_over_the_data_and_context_parallel_copies(monkeypatch):
    """Each rank scores units from its own gradients (its own tokens): the CP ranks of a position, like the DP
    replicas, must agree on which heads to drop (they exchange those heads' keys and values), so the scores
    are averaged over DP x CP before the TP ranks share them."""
    from megahet.parallel import ParallelLayout
    from megahet.runtime import resizer

    controller = object.__new__(ResizeController)
    controller.layout = ParallelLayout(
        rank=0, world_size=4, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, cp_size=2
    )
    controller.units = {("attn", 0): 2}
    controller.scores = {}
    mine, peer = torch.tensor([1.0, 4.0], dtype=torch.float64), torch.tensor([3.0, 0.0], dtype=torch.float64)
    monkeypatch.setattr(controller, "_local_scores", lambda block: mine.numpy().copy())
    groups = []
    monkeypatch.setattr(resizer.ps, "get_data_parallel_group", lambda **kw: groups.append(kw) or "dp x cp")
    monkeypatch.setattr(resizer.ps, "get_tensor_model_parallel_group", lambda: "tp")

    def all_reduce(tensor, group):  # the CP peer scored the units 3 and 0
        assert group == "dp x cp"
        tensor += peer

    def all_gather(out, tensor, group):
        for o in out:
            o.copy_(tensor)

    monkeypatch.setattr(resizer.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(resizer.dist, "all_gather", all_gather)
    controller._gather_scores()
    assert groups == [{"with_context_parallel": True}]
    assert controller.scores[(("attn", 0), 1)].tolist() == [2.0, 2.0]  # the mean of both CP ranks' scores
