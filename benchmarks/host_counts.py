"""Machine-independent counts of the host work in a training step (issue 48): they do not drift with the
machine's load, so they compare across machines and days, and CI holds them to budgets
(tests/unit/test_host_budget.py). Used by benchmarks/host_overhead.py.

    with HostCounts() as counts:
        trainer.train_step()
    counts.aten_ops, counts.megahet_calls, counts.host_syncs, counts.cuda_events

- `aten_ops`: ATen operators dispatched (a TorchDispatchMode below autograd: forward, backward, optimizer),
  and per operator (`ops`; `op_differences` ranks where two systems differ);
- `megahet_calls`: Python function calls into megahet's own code (`sys.setprofile`);
- `host_syncs`: calls that make the host wait for the device: Tensor.item / .tolist (on a GPU they copy a
  value back), torch.cuda.synchronize, and Event.synchronize / elapsed_time (counted on CPU too, where they
  cost nothing, because a GPU would pay for each);
- `cuda_events`: torch.cuda.Event.record calls (none on CPU: the CPU clock is perf_counter).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megahet

PACKAGE = str(Path(megahet.__file__).resolve().parent)
SYNC_METHODS = frozenset({"item", "tolist"})
"""Tensor methods (builtins: `c_call` events) that return device values to the host."""
SYNC_FUNCTIONS = {("synchronize", "torch/cuda/__init__.py"), ("synchronize", "torch/cuda/streams.py"),
                  ("elapsed_time", "torch/cuda/streams.py"), ("synchronize", "megahet/platform.py")}  # fmt: skip
"""Python functions (name, file suffix) that wait for the device (megahet.platform.synchronize wraps
torch.cuda.synchronize where there is a GPU: counted once, at the wrapper, on CPU too)."""
EVENT_RECORD = ("record", "torch/cuda/streams.py")


def _on_tensor(method) -> bool:
    return isinstance(getattr(method, "__self__", None), torch.Tensor)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.names: collections.Counter[str] = collections.Counter()
        """Dispatches per operator (aten.add_, c10d.allreduce_, ...): where two systems' counts differ."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class HostCounts:
    """Counts the host work of what runs inside the block (this thread)."""

    def __init__(self):
        self.aten_ops = self.megahet_calls = self.host_syncs = self.cuda_events = 0
        self._mode = _OpCounter()
        self._kinds: dict = {}  # code object -> what it counts as (None: nothing)

    def _kind(self, code) -> str | None:
        kind = self._kinds.get(code, ...)
        if kind is ...:
            path = code.co_filename.replace("\\", "/")
            name = code.co_name
            if any(name == n and path.endswith(f) for n, f in SYNC_FUNCTIONS):
                kind = "sync"
            elif name == EVENT_RECORD[0] and path.endswith(EVENT_RECORD[1]):
                kind = "event"
            elif path.startswith(PACKAGE):
                kind = "megahet"
            else:
                kind = None
            self._kinds[code] = kind
        return kind

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            kind = self._kind(frame.f_code)
            if kind == "megahet":
                self.megahet_calls += 1
            elif kind == "sync":
                self.host_syncs += 1
            elif kind == "event":
                self.cuda_events += 1
        elif event == "c_call" and getattr(arg, "__name__", "") in SYNC_METHODS and _on_tensor(arg):
            self.host_syncs += 1

    def __enter__(self):
        self._mode.__enter__()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self._mode.__exit__(*exc)
        self.aten_ops = self._mode.ops

    def as_dict(self, steps: int = 1) -> dict[str, float]:
        """Per step, over `steps` counted steps (with `ops`: the dispatches per operator)."""
        return {
            "aten_ops": self.aten_ops / steps, "megahet_calls": self.megahet_calls / steps,
            "host_syncs": self.host_syncs / steps, "cuda_events": self.cuda_events / steps,
            "ops": {name: n / steps for name, n in sorted(self._mode.names.items())},
        }  # fmt: skip


def op_differences(
    ops: dict[str, float], base: dict[str, float], least: float = 1.0
) -> list[tuple[str, float]]:
    """(operator, dispatches per step beyond `base`'s), the largest first, where they differ by `least`."""
    diff = {name: ops.get(name, 0.0) - base.get(name, 0.0) for name in {*ops, *base}}
    return sorted(((n, d) for n, d in diff.items() if abs(d) >= least), key=lambda item: (-item[1], item[0]))
