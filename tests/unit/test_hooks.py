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
