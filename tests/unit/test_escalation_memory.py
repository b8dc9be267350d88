"""The escalation's memory check (issue 46): a rank's weights, gradients and ZeRO-1 optimizer state on every
TP x DP layout from the live model's parameters (TP-split or whole), its activations measured here and
scaled by TP, the layouts over the cap left out (never the run's own), and the controller on 4 ranks: it
moves a late TP 4 rank's job to TP 1 x DP 4 with no cap, to TP 2 x DP 2 when TP 1 would not fit (two late
ranks: strided TP groups, which put them in one replica), and refuses to start with one line when no other
layout fits.

Run: ``python -m pytest tests/unit/test_escalation_memory.py -q`` (a second).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.config_checks import validate
from megahet.parallel import ParallelLayout
from megahet.policy.escalation import LayoutMemory, left_out_by_memory
from megahet.runtime.escalation import EscalationController, layout_memory, memory_cap_bytes

MB = 2**20


def test_a_ranks_state_follows_tp_and_zero1_and_its_activations_scale_with_tp():
    memory = LayoutMemory(split_params=1000, replicated_params=100, precision="fp32", tp=2, activations=4000)
    # fp32: 4 + 4 bytes of weights and gradients a parameter, 12 of ZeRO-1 optimizer state split over DP
    assert memory.state_bytes(tp=2, dp=1) == 600 * 8 + 600 * 12
    assert memory.state_bytes(tp=1, dp=2) == 1100 * 8 + 1100 * 12 // 2
    assert memory.bytes(tp=1, dp=2) == memory.state_bytes(1, 2) + 8000  # twice the activations of TP 2
    assert memory.bytes(tp=2, dp=1) == memory.state_bytes(2, 1) + 4000
    bf16 = LayoutMemory(1000, 100, "bf16", tp=1)
    assert bf16.state_bytes(tp=1, dp=4) == 1100 * 4 + 1100 * 12 // 4


def test_the_layouts_over_the_cap_are_left_out_but_never_the_runs_own():
    memory = LayoutMemory(split_params=100 * MB, replicated_params=0, precision="fp32", tp=4)
    need = {tp: memory.bytes(tp, 4 // tp) for tp in (1, 2, 4)}
    assert need[1] > need[2] > need[4]
    left_out = left_out_by_memory(memory, (1, 2, 4), world=4, cap_bytes=need[2], home_tp=4)
    assert list(left_out) == [1]
    assert (
        left_out[1]
        == f"TP 1 x DP 4 needs {need[1] / 2**30:.3g} GiB a rank, over the {need[2] / 2**30:.3g} GiB allowed"
    )
    assert left_out_by_memory(memory, (1, 2, 4), 4, cap_bytes=0, home_tp=4).keys() == {1, 2}  # TP 4 ran
    assert left_out_by_memory(memory, (1, 2, 4), 4, cap_bytes=math.inf, home_tp=4) == {}


def test_the_live_models_parameters_are_counted_split_or_whole():
    model = torch.nn.Linear(8, 6)  # a TP 2 rank's column-parallel shard: its weight split, its bias whole
    model.weight.tensor_model_parallel = True
    memory = layout_memory(model, tp=2, precision="bf16")
    assert (memory.split_params, memory.replicated_params, memory.tp) == (2 * 48, 6, 2)


def test_the_cap_is_the_setting_or_none_on_cpu():
    assert memory_cap_bytes(MegahetConfig()) == math.inf
    assert memory_cap_bytes(apply_overrides(MegahetConfig(), {"escalate.memory_gib": "1.5"})) == 1.5 * 2**30
    with pytest.raises(
        ConfigError, match=r"^escalate.memory_gib must be >= 0 GiB \(0: the GPU's\), got -1.0$"
    ):
        validate(apply_overrides(MegahetConfig(), {"escalate.memory_gib": "-1"}), 1)


class _Context:
    """The Trainer as the controller sees it; every rank's row of one step is handed in by `_take`."""

    build_s, step_t0 = 0.05, 0.0

    def __init__(self):
        self.requested: list[tuple[int, tuple[int, ...]]] = []

    def request_layout(self, tp: int, shares: tuple[int, ...], strided: bool = False) -> None:
        self.requested.append((tp, shares, strided))


def _controller(
    cap_bytes: float,
    log: list[str],
    tp: int = 4,
    strided: bool = False,
    placement: bool = True,
    price_move=lambda choice: 0.05,
) -> tuple[EscalationController, _Context]:
    """Rank 0 of 4 at TP `tp` (4 layers, 8 micro-batches a step; the run's own TP is 4), escalation on at its
    defaults; a first move priced by `price_move` (a LayoutChoice -> seconds)."""
    cfg = apply_overrides(
        MegahetConfig(),
        {"escalate.mode": "on", "train.global_batch_size": "8", "train.micro_batch_size": "1",
         "train.train_iters": "1000", "model.num_layers": "4", "escalate.placement": str(placement).lower()},
    )  # fmt: skip
    layout = ParallelLayout(
        rank=0, world_size=4, tp_rank=0, tp_size=tp, pp_rank=0, pp_size=1, dp_rank=0, dp_size=4 // tp,
        strided=strided,
    )  # fmt: skip
    memory = LayoutMemory(split_params=100 * MB, replicated_params=MB, precision="fp32", tp=4)
    ctx = _Context()
    controller = EscalationController(
        cfg, layout, ctx, (1, 2, 4), home_tp=4, speeds=lambda: None, log=log.append, memory=memory,
        cap_bytes=cap_bytes, price_move=price_move,
    )  # fmt: skip
    return controller, ctx


def _run(controller: EscalationController, steps: int, late=(3,)) -> None:
    """The `late` ranks are 3 ms late to each of their 198 collectives a step (their peers wait for them):
    the rows of `steps` steps, folded in and decided on as the training loop does."""
    calm, slow = [0.4, 0.003, 198.0, 0.01, 1.2, 0.0], [1.0, 0.0, 198.0, 0.01, 1.2, 0.0]
    rows = [slow if r in late else calm for r in range(4)]
    for step in range(1, steps + 1):
        controller._take = lambda step=step: (rows, step, 1.2)
        controller.before_forward_backward(step + 1)


def test_a_late_rank_moves_the_job_to_the_fastest_layout_that_fits():
    log: list[str] = []
    controller, ctx = _controller(math.inf, log)
    _run(controller, 5)
    assert ctx.requested and ctx.requested[0][0] == 1, log  # TP 1 x DP 4: no TP collectives to be late to
    assert "no limit" in log[0]

    tp2 = LayoutMemory(100 * MB, MB, "fp32", tp=4).bytes(2, 2)
    log = []
    controller, ctx = _controller(tp2, log)
    _run(controller, 5)
    assert ctx.requested and ctx.requested[0][0] == 2, log  # TP 1 would not fit: TP 2 x DP 2
    assert ctx.requested[0][1][0] > ctx.requested[0][1][1]  # the late rank's replica gets fewer micro-batches
    left_out = [line for line in log if line.endswith("(escalate.memory_gib): left out")]
    assert len(left_out) == 1 and left_out[0].startswith("escalation: TP 1 x DP 4 needs"), log
    assert any("move" in line and "TP 2 x DP 2" in line for line in log), log

    # the move rebuilds the hooks; the new layout's controller takes the old one's state and does not print
    # what was left out a second time
    log = []
    moved, _ = _controller(tp2, log, tp=2)
    moved.carry(controller.state_dict())
    _run(moved, 5)
    assert moved.ladder.moved and not [line for line in log if line.endswith("left out")], log


def test_no_other_layout_that_fits_is_a_one_line_error_at_start():
    with pytest.raises(ConfigError) as error:
        _controller(cap_bytes=100 * MB, log=[])
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "escalate.mode=on: no other TP x DP layout fits (TP 2 x DP 2"
    )
    assert message.endswith("raise escalate.memory_gib or set escalate.mode=off")


def test_two_late_ranks_move_to_one_tp_group_and_are_measured_there():
    """Ranks 1 and 3 late, TP 1 x DP 4 over the cap: TP 2 x DP 2 with strided TP groups (1 and 3 together,
    replica 0 calm and given more micro-batches). On strided groups each rank's delay is read against its own
    group's peers: ranks 1 and 3 late, 0 and 2 not."""
    tp2 = LayoutMemory(100 * MB, MB, "fp32", tp=4).bytes(2, 2)
    log: list[str] = []
    controller, ctx = _controller(tp2, log)
    _run(controller, 5, late=(1, 3))
    assert ctx.requested, log
    tp, shares, strided = ctx.requested[0]
    assert (tp, strided) == (2, True) and shares[0] > shares[1], ctx.requested
    assert any("TP 2 x DP 2 (shares" in line and "TP groups 0,2 | 1,3" in line for line in log), log

    controller, ctx = _controller(tp2, [], placement=False)  # escalate.placement=false: consecutive groups
    _run(controller, 5, late=(1, 3))
    assert ctx.requested and ctx.requested[0][0] == 2 and not ctx.requested[0][2], ctx.requested

    controller, _ = _controller(math.inf, [], tp=2, strided=True)
    # rank 0 waited 3 ms a collective for its strided peer, rank 2 (consecutive groups would blame rank 1)
    assert controller._delays([0.003, 0.0, 0.0, 0.0]) == pytest.approx([0.0, 0.0, 0.003, 0.0])


def test_the_first_move_is_priced_by_the_pricer_then_at_the_last_moves_measured_cost():
    """Before a move the ladder weighs the pricer's price (megahet/runtime/move_price.py): a price above the
    horizon's gain keeps the job where it is, a cheap one moves it; once a move has been measured its cost
    stands in and the pricer is not asked again."""
    priced: list[int] = []

    def dear(choice) -> float:
        priced.append(choice.tp)
        return 1e4

    log: list[str] = []
    controller, ctx = _controller(math.inf, log, price_move=dear)
    _run(controller, 5)
    assert not ctx.requested and priced and set(priced) == {1}, (priced, log)
    assert any(
        "stay (it does not pay within 100 steps" in line and "move 10000.0 s" in line for line in log
    ), log

    controller, ctx = _controller(math.inf, [], price_move=lambda choice: 0.05)
    _run(controller, 5)
    assert ctx.requested and ctx.requested[0][0] == 1

    log = []
    controller, ctx = _controller(math.inf, log, price_move=dear)
    controller.relayout_done(types.SimpleNamespace(total_s=0.5))  # as after a measured move
    calls = len(priced)
    _run(controller, 5)
    assert len(priced) == calls and ctx.requested, log
    assert any("move 0.5 s" in line for line in log), log
