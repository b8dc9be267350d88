"""A rank's own compute per step: megatron-core's compute regions minus the time blocked in collectives.

Role: runtime (measurement: what the balancer reads).

Inside a TP group every block ends in a collective (row-parallel all-reduce in the forward, the
column-parallel input-gradient all-reduce in the backward, the vocab-parallel embedding and
cross-entropy reductions, ZeRO-2's reduce-scatters). A fast rank reaches each one early and waits there
for the slow one, so the wall time of a forward or backward region is about the slowest rank's on every
rank and hides the straggler. What differs is the time a rank spends *outside* those waits: its own
compute. `CommClock` wraps torch.distributed's collectives (megatron-core, DeepSpeed and megahet all call
them through the `torch.distributed` module) and `ComputeTimers` — megatron-core's `config.timers` —
opens the 'forward-compute' / 'backward-compute' regions the schedule already times (pipeline
send/receive waits fall outside them). Own compute = region time - collective time inside regions.

The work no plan moves (issue 31: a slow device is slow at everything): `phase(name)` times a part of
the step outside the regions the same way — its time minus the collectives inside it — and inside them
(the data a forward step reads). The Trainer opens `optimizer` around `engine.step()` (ZeRO's reductions
and gathers are waits; the copies, clipping and AdamW on this rank's partition are its own) and `data`
around every micro-batch read. The reductions a rank computes inside a collective are not told apart
from its waits (a host clock cannot see where a peer's arrival ends and the reduction begins): they
count as waits.

Clocks: on CPU, `time.perf_counter()`. On a GPU, CUDA events recorded on the current stream (a collective
is timed by events before and after the call, or around `work.wait()` for an asynchronous one: the stream
time spent waiting for it), read once after the step: nothing synchronizes per region or collective.

    clock = CommClock()                  # no side effect
    timers = ComputeTimers(clock)        # model.config.timers = timers; the schedule opens the regions
    time_layers(model, clock)            # also the own compute inside the transformer layers (one interval
                                         # per block of consecutive layers)
    with clock.installed():              # torch.distributed's collectives timed within the block only
        ... one step ...
    with clock.phase("optimizer"):       # own time outside the regions: the optimizer step
        engine.step()
    times = clock.read()                 # StepTimes(compute_s, wait_s, layers_s, optimizer_s, data_s,
                                         # collectives, median_wait_s) (resets)

The TP balancer reads `layers_s` as the compute of the work a plan can move (a rank doing fewer units
still runs the same embedding, output layer and loss: counting them would make it look slower per unit)
and `fixed_s` as the rest of its own work, which it plans around (megahet/policy/planner.py).

`CommClock.before_collective` callbacks run just before every collective issued inside a region (and at
the end of every timed transformer layer): a virtual device (megahet/runtime/devices.py) pays its emulated
delay there, so its peers wait in that collective exactly as they do behind a really slow device, and the
delay of a layer's work is inside that layer's time (the pipeline balancer's per-layer time).
`CommClock.on_collective` callbacks run before every timed collective, in regions and phases alike: a
virtual device's per-collective delay (`device.collective_delay_ms`, a time-sliced rank) sleeps there.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from megahet.compat.collectives import collectives_wrapped
from megahet.compat.megatron_timers import COMPUTE_REGIONS
from megahet.platform import cuda_available


class StepTimes(NamedTuple):
    compute_s: float
    """Own compute: the forward/backward compute regions minus the time blocked in collectives."""
    wait_s: float
    """Time blocked in collectives inside the regions (waiting for peers, and the transfers)."""
    layers_s: float
    """Own compute inside the transformer layers timed by `time_layers` (the work a plan moves: the
    embedding, output layer and loss, which no plan changes, are left out), else 0."""
    optimizer_s: float = 0.0
    """Own time in the optimizer step (`phase("optimizer")`: its collectives excluded)."""
    data_s: float = 0.0
    """Time reading micro-batches (`phase("data")`, inside the compute regions: a part of `compute_s`)."""
    collectives: int = 0
    """Collectives timed this step, in the regions and the phases (the escalation's per-collective cost)."""
    median_wait_s: float = 0.0
    """The median of their waits: a rank's wait per collective that one long wait (a compute imbalance,
    absorbed by the first collective after it) does not move (megahet/runtime/escalation.py)."""

    @property
    def fixed_s(self) -> float:
        """Own work no TP plan moves: the compute outside the transformer layers (embedding, output
        layer, loss, data) and the optimizer step."""
        return max(self.compute_s - self.layers_s, 0.0) + self.optimizer_s


class HostStamps:
    """Host clock: a stamp is perf_counter()."""

    def now(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaStamps:
    """CUDA events on the current stream: a stamp is an event, read after the step."""

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # already complete when read after the step: no stall
        return start.elapsed_time(end) / 1e3


class _TimedWork:
    """An async collective's Work whose wait() counts as time blocked in the collective."""

    def __init__(self, work, clock: CommClock):
        self._work, self._clock = work, clock

    @torch.compiler.disable
    def wait(self, *args, **kwargs):
        with self._clock.blocked():
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommClock:
    """Collective time inside compute regions, and the regions themselves, per step."""

    _active: CommClock | None = None
    """The clock whose `installed()` block is running: the collective wrappers time into it."""

    def __init__(self, stamps: HostStamps | CudaStamps | None = None):
        self.stamps = stamps or (CudaStamps() if cuda_available() else HostStamps())
        self.before_collective: list[Callable[[], None]] = []
        """Called before each collective issued inside a compute region (virtual devices pay here)."""
        self.on_collective: list[Callable[[], None]] = []
        """Called before every collective the clock times, in a region or a phase (the optimizer step's
        gradient reduction too), outside its wait: a virtual device's per-collective delay (a time-sliced
        rank arrives late to each)."""
        self.sync_host = False
        """Synchronize the GPU around each collective, so host clocks see its wait (virtual devices on a
        GPU only; a real run never sets it)."""
        self.blocked_host_s = 0.0
        """Host seconds blocked in collectives inside regions, cumulative (what a virtual device reads)."""
        self.region_host_start = 0.0
        """perf_counter() when the current (or last) region opened."""
        self._region_start = None
        self._regions: list[tuple] = []  # (start, end) stamps of closed regions
        self._waits: list[tuple] = []  # (start, end) stamps of collectives inside regions
        self._layer_start = None
        self._layers: list[tuple] = []  # (start, end) stamps of transformer layers' forward / backward
        self._layer_waits: list[tuple] = []  # (start, end) stamps of collectives inside them
        self._depth = 0  # a collective calling another (all_gather_object) is timed once
        self._phase: str | None = None
        self._phases: dict[str, list[tuple]] = {}  # name -> (start, end) stamps of its intervals
        self._phase_waits: dict[str, list[tuple]] = {}  # name -> stamps of the collectives inside it

    @contextlib.contextmanager
    def installed(self) -> Iterator[CommClock]:
        """Within the block (a training step: the Trainer opens it), torch.distributed's collectives are
        timed into this clock; the originals are back after it (megahet/compat/collectives.py)."""
        previous, CommClock._active = CommClock._active, self
        try:
            with collectives_wrapped(_wrap):
                yield self
        finally:
            CommClock._active = previous

    @property
    def in_region(self) -> bool:
        return self._region_start is not None

    def open_region(self) -> None:
        self.region_host_start = time.perf_counter()
        self._region_start = self.stamps.now()

    def close_region(self) -> None:
        if self._region_start is None:
            return
        for pay in self.before_collective:  # what is owed is paid before the region ends
            pay()
        self._regions.append((self._region_start, self.stamps.now()))
        self._region_start = None

    def open_layer(self) -> None:
        if self.in_region:
            self._layer_start = self.stamps.now()

    def close_layer(self) -> None:
        if self._layer_start is not None:
            for pay in self.before_collective:  # a virtual device's delay for the layer's work stays in it
                pay()
            self._layers.append((self._layer_start, self.stamps.now()))
            self._layer_start = None

    def blocked(self):
        """Context manager timing one blocking call inside a region or a phase (else a no-op)."""
        return _Blocked(self)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a part of the step by name: its own time is the block's minus the collectives inside it
        (`read()` returns `optimizer` and `data`). Phases do not nest; an inner one is not timed."""
        if self._phase is not None:
            yield
            return
        self._phase, start = name, self.stamps.now()
        try:
            yield
        finally:
            self._phases.setdefault(name, []).append((start, self.stamps.now()))
            self._phase = None

    def read(self) -> StepTimes:
        """The step's times since the last read (then reset); on a GPU reads the events."""
        total = self._seconds(self._regions)
        region_waits = [self.stamps.seconds(a, b) for a, b in self._waits]
        phase_waits = {
            name: [self.stamps.seconds(a, b) for a, b in w] for name, w in self._phase_waits.items()
        }
        waits = sum(region_waits)
        layers = self._seconds(self._layers) - self._seconds(self._layer_waits)
        own = {
            name: max(self._seconds(spans) - sum(phase_waits.get(name, [])), 0.0)
            for name, spans in self._phases.items()
        }
        every = region_waits + [w for name in phase_waits for w in phase_waits[name]]
        self._regions, self._waits, self._layers, self._layer_waits = [], [], [], []
        self._phases, self._phase_waits = {}, {}
        return StepTimes(
            max(total - waits, 0.0), waits, max(layers, 0.0), own.get("optimizer", 0.0), own.get("data", 0.0),
            len(every), statistics.median(every) if every else 0.0,
        )  # fmt: skip

    def _seconds(self, intervals: list[tuple]) -> float:
        return sum(self.stamps.seconds(a, b) for a, b in intervals)


class _Blocked:
    def __init__(self, clock: CommClock):
        self.clock = clock

    def __enter__(self):
        c = self.clock
        outermost = c._depth == 0
        c._depth += 1
        self.region = outermost and c.in_region
        self.phase = c._phase if outermost else None
        if self.region:  # a virtual device pays before its peers could go on (phases: no emulated delay)
            for pay in c.before_collective:
                pay()
            if c.sync_host:
                torch.cuda.synchronize()
        if self.region or self.phase is not None:
            for delay in c.on_collective:  # the rank's own lateness: not part of the wait
                delay()
            self.host0, self.start = time.perf_counter(), c.stamps.now()

    def __exit__(self, *exc):
        c = self.clock
        c._depth -= 1
        if not (self.region or self.phase is not None):
            return
        if self.region and c.sync_host:
            torch.cuda.synchronize()
        interval = (self.start, c.stamps.now())
        if self.phase is not None:
            c._phase_waits.setdefault(self.phase, []).append(interval)
        if not self.region:
            return
        c._waits.append(interval)
        if c._layer_start is not None:
            c._layer_waits.append(interval)
        c.blocked_host_s += time.perf_counter() - self.host0


def _alone(args: tuple, kwargs: dict) -> bool:
    """The collective's group is this rank alone (megatron-core's vocabulary-parallel cross-entropy at TP 1, a
    gradient norm over a model-parallel group of one): it waits for no peer, so it is neither timed nor
    counted, and a virtual device is not late to it."""
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group is not None and group.size() == 1


def _wrap(fn):
    # eager under torch.compile (--train.compile): a collective is a graph break anyway, and traced, the
    # clock's interval lists would be guards that change with every collective (recompiles)
    @torch.compiler.disable
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        clock = CommClock._active
        if clock is None or _alone(args, kwargs):
            return fn(*args, **kwargs)
        with clock.blocked():
            out = fn(*args, **kwargs)
        timed = clock.in_region or clock._phase is not None
        if timed and out is not None and hasattr(out, "wait"):
            return _TimedWork(out, clock)
        return out

    return collective


class _LayerBackwardEnds(torch.autograd.Function):
    """Identity on a layer's input; its backward runs once the layer's backward has produced the input's
    gradient, i.e. when the layer's backward ends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: CommClock) -> torch.Tensor:
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.clock.close_layer()
        return grad, None


def time_layers(model: torch.nn.Module, clock: CommClock) -> int:
    """Time the transformer layers' forward and backward in `clock` (its `layers_s`); returns how many
    layers are covered.

    One interval per run of consecutive layers, not one per layer (issue 48: what a plan needs is the
    layers' total, and each interval is hooks, an autograd node and, on a GPU, two CUDA events): a
    TransformerBlock's layers are timed from its first layer's start to its last layer's end, forward and
    backward; a TransformerLayer outside any block is timed alone. Forward: module hooks. Backward: from the
    moment the last layer's output gradient arrives (a tensor hook) to the moment the first layer's input
    gradient is complete (an identity Function on the input). Module backward hooks would not do:
    megatron-core passes the hidden states as a keyword, and a full backward hook on a module without
    positional tensor inputs fires as soon as the backward starts."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def forward_pre(module, args, kwargs):
        clock.open_layer()
        if args:
            return (_mark_input(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _mark_input(kwargs["hidden_states"])}

    def _mark_input(x: torch.Tensor) -> torch.Tensor:
        return _LayerBackwardEnds.apply(x, clock) if torch.is_grad_enabled() and x.requires_grad else x

    def forward_post(module, args, output):
        clock.close_layer()
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda grad: clock.open_layer())

    runs = [list(block.layers) for block in model.modules() if isinstance(block, TransformerBlock)]
    runs = [run for run in runs if run]
    in_runs = {id(layer) for run in runs for layer in run}
    runs += [[m] for m in model.modules() if isinstance(m, TransformerLayer) and id(m) not in in_runs]
    for run in runs:
        run[0].register_forward_pre_hook(forward_pre, with_kwargs=True)
        run[-1].register_forward_hook(forward_post)
    return sum(len(run) for run in runs)


class ComputeTimers:
    """megatron-core's `config.timers` interface: its compute regions open and close the clock's regions.

    The schedule times 'forward-compute' and 'backward-compute' around the model's own work; every other
    timer name it uses is accepted and ignored. Nothing here synchronizes a GPU."""

    class _Timer:
        def __init__(self, clock: CommClock | None, name: str):
            self.clock = clock if name in COMPUTE_REGIONS else None

        def start(self, barrier: bool = False) -> None:
            if self.clock is not None:
                self.clock.open_region()

        def stop(self) -> None:
            if self.clock is not None:
                self.clock.close_region()

    def __init__(self, clock: CommClock):
        self.clock = clock
        self._timers: dict[str, ComputeTimers._Timer] = {}

    def __call__(self, name: str, log_level: int = 0) -> _Timer:
        return self._timers.setdefault(name, ComputeTimers._Timer(self.clock, name))
