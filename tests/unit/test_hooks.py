"""The step-hook interface (megahet/runtime/hooks.py): every hook the Trainer runs declares it, so the Trainer calls
each method of each hook without probing, and only hooks that say so are checkpointed.

Run: ``python -m pytest tests/unit/test_hooks.py -q`` (seconds).
"""

from __future__ import annotations

import pytest

from megahet.runtime.balancer import BalanceController
from megahet.runtime.devices import DeviceStepHook
from megahet.runtime.hooks import StepHook
from megahet.runtime.resizer import ResizeController


@pytest.mark.parametrize(
    "hook, checkpointed", [(ResizeController, True), (BalanceController, True), (DeviceStepHook, False)]
)
def test_megahets_hooks_declare_the_interface(hook: type, checkpointed: bool) -> None:
    assert issubclass(hook, StepHook) and hook.checkpointed is checkpointed
    if checkpointed:  # what a checkpoint calls must be the hook's own, not the base's refusal
        assert (
            hook.state_dict is not StepHook.state_dict
            and hook.load_state_dict is not StepHook.load_state_dict
        )


def test_a_bare_hook_does_nothing_and_refuses_to_checkpoint() -> None:
    hook = StepHook()
    hook.before_forward_backward(0), hook.before_step(None), hook.after_step(None), hook.close()
    assert hook.metrics() == {} and hook.report() == {}
    with hook.evaluation():
        pass
    with pytest.raises(NotImplementedError, match="StepHook is not checkpointed"):
        hook.state_dict()


def test_a_measuring_hook_gathers_a_group_of_one_without_a_collective(world1, monkeypatch) -> None:
    """A TP x DP group of one rank (TP 1, DP 1) has nobody to gather from: no collective is issued (gloo's
    costs ~0.1 ms of host time per step even then), and the step's row is read back as floats."""
    import torch
    import torch.distributed as dist

    from megahet.runtime.hooks import MeasuringHook

    def refuse(*args, **kwargs):
        raise AssertionError("a group of one issued a collective")

    monkeypatch.setattr(dist, "all_gather", refuse)
    hook = MeasuringHook()
    hook.step = 3
    hook._gather(torch.tensor([1.0, 2.5], dtype=torch.float64))
    rows, step, seconds = hook._take()
    assert rows == [[1.0, 2.5]] and step == 3 and seconds >= 0
    assert hook._take() is None  # taken once


def test_a_measuring_hook_reads_a_gathered_group_on_the_host(monkeypatch) -> None:
    """Rows gathered from several ranks come back as one list of floats per rank, read from host memory
    (the rows are CPU tensors: gloo carries them on every machine), after the collective's wait."""
    import torch
    import torch.distributed as dist

    from megahet.runtime.hooks import MeasuringHook

    waited = []

    class Work:
        def wait(self):
            waited.append(True)

    def all_gather(rows, mine, group=None, async_op=False):
        for r, row in enumerate(rows):
            row.copy_(mine + r)
        return Work()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    hook = MeasuringHook()
    hook._gather(torch.tensor([1.0, 2.0], dtype=torch.float64))
    rows, _, _ = hook._take()
    assert waited == [True] and rows == [[1.0, 2.0], [2.0, 3.0]]
    assert all(type(x) is float for row in rows for x in row)
