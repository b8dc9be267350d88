"""The step-hook interface: what the Trainer calls around every optimizer step.

Role: runtime (interface). `ResizeController` (megahet/runtime/resizer.py: executes the resize / migration plan),
`BalanceController` (megahet/runtime/balancer.py: measures, estimates speeds, plans), `DataParallelBalancer`
(megahet/runtime/dp_balancer.py: replica speeds, data-parallel shares) and `DeviceStepHook`
(megahet/runtime/devices.py: a virtual device's step) implement it. A hook overrides what it needs; the rest
are no-ops, and the Trainer calls every method of every hook.

One step: before_forward_backward(step) -> the schedule's forward + backward -> before_step(engine) ->
engine.step() -> after_step(engine). At each log interval `metrics()` are reduced over all ranks (min /
max) and `report()`, this rank's own view (e.g. its TP group's plan), is logged as is. `evaluation()` is
entered around every evaluation, `close()` runs at the end of training. A hook with `checkpointed =
True` has `state_dict()` saved with every checkpoint and handed back through `load_state_dict()` on
resume when its settings (`cfg`, a dataclass, but for the names in `settings_free`) are the saved ones.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megahet.runtime.timing import StepTimes


class StepContext(Protocol):
    """What a step hook reads of the running step, and the requests it may make of the Trainer, in
    place of the Trainer itself (the Trainer implements it: megahet/trainer.py). Hooks receive it at
    construction (megahet/runtime/hook_builder.py)."""

    times: StepTimes
    """The last step's measured times (megahet/runtime/timing.py), set after its optimizer step."""
    step_t0: float
    """perf_counter() when the current step began."""
    num_microbatches: int
    """This replica's micro-batches in the current step."""
    shares: tuple[int, ...]
    """Micro-batches of every global batch per data-parallel replica."""
    step_plan: Any
    """Packed documents: the current global batch's plan (megahet/data/packed.py StepPlan), else None."""
    build_s: float
    """Seconds this Trainer's stage model and engine took to build (a re-split's fixed part, until one is
    measured)."""

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Ask for these data-parallel shares from the next step on."""

    def set_replica_speeds(self, speeds: tuple[float, ...]) -> None:
        """Packed documents: plan the next global batches for replicas of these speeds (fastest = 1)."""

    def replica_work(self) -> float:
        """What this replica's step held, in the units its speed is measured in."""

    def request_split(self, split: tuple[int, ...]) -> None:
        """Ask for other layers per pipeline stage: training stops after the step and re-splits."""

    def request_layout(self, tp: int, shares: tuple[int, ...], strided: bool = False) -> None:
        """Ask for TP `tp` x DP starting from these DP shares, its TP groups strided over the ranks or not (an
        escalation): training stops after the step and moves in place."""


class StepHook:
    checkpointed: bool = False
    """Whether the checkpoint carries this hook's state (state_dict / load_state_dict)."""
    cfg: Any = None
    """The settings dataclass the hook's state belongs to (compared on resume), or None."""
    settings_free: tuple[str, ...] = ()
    """Settings in `cfg` that do not shape the state (a changed one keeps the saved state)."""
    split_free: bool = False
    """Whether the state does not depend on the layers per pipeline stage: a re-split then carries it to
    the rebuilt Trainer's hook of the same type (megahet/runtime/resplit.py)."""

    layout_free: bool = False
    """Whether the state does not depend on the TP x DP layout: an escalation's move carries it to the
    rebuilt Trainer's hook of the same type (megahet/runtime/relayout.py)."""

    def before_forward_backward(self, step: int) -> None:
        """Before the schedule runs step `step` (0-based): apply a new plan here."""

    def before_step(self, engine) -> None:
        """After the backward, before the optimizer step (gradients final, not yet reduced over DP)."""

    def after_step(self, engine) -> None:
        """After the optimizer step and the step's time measurement."""

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Micro-batches per DP replica of every global batch (data-parallel shares), from the next step on."""

    def metrics(self) -> dict[str, float]:
        """Numbers to log as min / max over all ranks."""
        return {}

    def report(self) -> dict[str, float]:
        """Numbers this rank logs as they are (no reduction)."""
        return {}

    def evaluation(self) -> contextlib.AbstractContextManager:
        """Entered around an evaluation pass."""
        return contextlib.nullcontext()

    def close(self, final: bool = True) -> None:
        """At the end of training; `final=False`: a re-split rebuilt the Trainer, whose hooks go on
        (close files, draw nothing)."""

    def state_dict(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} is not checkpointed")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} is not checkpointed")

    def carry(self, state: dict) -> None:
        """Take the `state_dict()` of the replaced Trainer's hook of this type (a re-split rebuilt the
        stages, or a move the layout; only `split_free`, respectively `layout_free`, hooks are carried)."""
        self.load_state_dict(state)

    def resplit_done(self, cost) -> None:
        """A re-split rebuilt the stages and this hook with them; `cost` is what it measured
        (megahet/runtime/resplit.py ResplitCost)."""

    def relayout_done(self, cost) -> None:
        """An escalation's move rebuilt the Trainer in another layout, and this hook with it; `cost` is what
        the move measured (megahet/runtime/resplit.py ResplitCost)."""


class MeasuringHook(StepHook):
    """A hook that gathers a few numbers per rank after every step, asynchronously (they travel while
    the step finishes), and folds them in at the start of the next (the balancers)."""

    step: int = -1
    ctx: StepContext | None = None
    """The running step (its start, on the Trainer's clock); None: a hook measured on its own."""
    _pending: tuple | None = None
    """(all_gather handle, rows, step, step seconds) of the last step, until `_take`."""
    trace = None
    """A TraceWriter (global rank 0 with --balance.trace), or None."""

    def _gather(self, mine: torch.Tensor, group=None) -> None:
        ranks = dist.get_world_size(group)
        rows = [mine] if ranks == 1 else [torch.empty_like(mine) for _ in range(ranks)]
        # a group of one gathers nothing: no collective (gloo's costs ~0.1 ms of host time even then)
        handle = None if ranks == 1 else dist.all_gather(rows, mine, group=group, async_op=True)
        started = self.ctx.step_t0 if self.ctx is not None else time.perf_counter()
        self._pending = (handle, rows, self.step, time.perf_counter() - started)

    def _collect(self) -> None:
        """Fold the last step's gathered rows in (`_take`)."""
        raise NotImplementedError

    def _plot(self, written: Path) -> None:
        """Draw the closed trace (written) beside it."""

    def close(self, final: bool = True) -> None:
        """Fold the last step in, close the trace and, when final, draw it."""
        self._collect()
        written = self.trace.close() if self.trace is not None else None
        self.trace = None
        if written is not None and final:
            self._plot(written)

    def _take(self) -> tuple[list[list[float]], int, float] | None:
        """The last step's gathered rows (one per rank, as floats), its step and its seconds (waited for),
        or None. The rows are CPU tensors on every machine (gloo carries them beside NCCL: megahet/platform.py),
        so reading them waits for no device: one read through numpy for all of them."""
        if self._pending is None:
            return None
        handle, rows, step, step_s = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        return torch.stack(rows).numpy().tolist(), step, step_s
