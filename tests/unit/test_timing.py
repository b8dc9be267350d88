"""The own-compute clock (megahet/runtime/timing.py): regions minus collective waits, which collectives it
wraps, async Work waits, nesting, and that nothing outside a region is counted. The two-rank check
that a fast rank's waits for a slow peer are not its compute is in tests/distributed/test_timing.py."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from megahet.compat.collectives import COLLECTIVES, WRAPPED
from megahet.runtime.timing import CommClock, ComputeTimers, time_layers


class FakeStamps:
    """A clock that moves only when told to."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def seconds(self, start: float, end: float) -> float:
        return end - start


def test_compute_is_regions_minus_waits_inside_them():
    stamps = FakeStamps()
    clock = CommClock(stamps)
    timers = ComputeTimers(clock)
    with clock.blocked():  # outside a region: not a wait of the step
        stamps.t += 5.0
    timers("forward-compute").start()
    stamps.t += 1.0  # own compute
    with clock.blocked():
        stamps.t += 0.5  # waiting for a peer
    stamps.t += 0.25
    timers("forward-compute").stop()
    timers("forward-recv").start()  # a pipeline wait: not a compute region
    stamps.t += 3.0
    timers("forward-recv").stop()
    timers("backward-compute").start()
    stamps.t += 2.0
    with clock.blocked(), clock.blocked():  # a collective calling another is timed once
        stamps.t += 1.0
    timers("backward-compute").stop()
    times = clock.read()
    assert times[:3] == (3.25, 1.5, 0.0)
    assert (times.collectives, times.median_wait_s) == (2, 0.75)  # the nested one counted once
    assert clock.read() == (0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0)  # read resets


def test_phases_time_the_fixed_work_minus_their_collectives_without_paying_virtual_delays():
    """Issue 31: the optimizer step outside the regions and the data reads inside them are timed as
    phases; their collectives are not their own work, and a virtual device pays nothing in them."""
    stamps = FakeStamps()
    clock = CommClock(stamps)
    paid = []
    clock.before_collective.append(lambda: paid.append(stamps.t))
    timers = ComputeTimers(clock)
    timers("forward-compute").start()
    with clock.phase("data"):
        stamps.t += 0.25  # reading a micro-batch: part of the region's compute too
    stamps.t += 1.0
    timers("forward-compute").stop()
    paid.clear()
    with clock.phase("optimizer"):
        stamps.t += 0.5  # AdamW on this rank's partition
        with clock.blocked():
            stamps.t += 2.0  # ZeRO's all-gather: waiting for the peers
        with clock.phase("data"):  # phases do not nest: not timed
            stamps.t += 0.125
    times = clock.read()
    assert times == (1.25, 0.0, 0.0, 0.625, 0.25, 1, 2.0)  # a phase's collective is counted too
    assert times.fixed_s == 1.25 + 0.625  # no layers timed: all own compute plus the optimizer
    assert paid == []  # a collective in a phase pays no emulated delay
    assert clock.read() == (0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0)


def test_layer_compute_excludes_what_is_outside_layers_and_their_waits():
    stamps = FakeStamps()
    clock = CommClock(stamps)
    clock.open_layer()  # outside a region: not timed
    stamps.t += 9.0
    clock.close_layer()
    clock.open_region()
    stamps.t += 1.0  # embedding: compute, not layer compute
    clock.open_layer()
    stamps.t += 2.0
    with clock.blocked():  # the layer's all-reduce
        stamps.t += 0.5
    clock.close_layer()
    with clock.blocked():  # the loss's all-reduce
        stamps.t += 0.25
    clock.close_region()
    assert clock.read()[:3] == (3.0, 0.75, 2.0)


def test_time_layers_times_forward_and_backward_of_the_layers_in_one_interval_each(world1):
    from resize_gpt import VOCAB, gpt

    model = gpt()
    clock = CommClock()
    assert time_layers(model, clock) == 2
    clock.open_region()
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).sum().backward()
    clock.close_region()
    assert len(clock._layers) == 2  # one interval forward, one backward, for both layers (issue 48)
    compute, wait, layers, *_ = clock.read()
    assert 0 < layers < compute and wait == 0
    assert len(clock._layers) == 0


def test_before_collective_runs_inside_regions_only_and_at_region_end():
    clock = CommClock(FakeStamps())
    calls = []
    clock.before_collective.append(lambda: calls.append(clock.in_region))
    with clock.blocked():
        pass
    assert calls == []
    clock.open_region()
    with clock.blocked():
        pass
    clock.close_region()
    assert calls == [True, True]  # before the collective, and what is owed at the region's end


def test_installed_wraps_torch_distributed_and_megatron_bound_names_within_the_block_only(world1):
    from megatron.core.tensor_parallel import layers, mappings

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    bound = (mappings.dist_all_gather_func, layers.dist_reduce_scatter_func)
    assert not any(getattr(fn, WRAPPED, False) for fn in originals.values())  # constructing: no side effect
    clock = CommClock()
    with clock.installed():
        for name in originals:
            assert getattr(getattr(dist, name), WRAPPED, False), name
        assert getattr(mappings.dist_all_gather_func, WRAPPED)
        assert getattr(mappings.dist_reduce_scatter_func, WRAPPED)
        assert getattr(layers.dist_all_gather_func, WRAPPED)
        # P2POp insists on the original isend / irecv: those stay unwrapped.
        assert not hasattr(dist.isend, WRAPPED)
        with CommClock().installed():  # nested: the outer wrappers stay, the inner clock is active
            assert dist.all_reduce is not originals["all_reduce"]
        assert getattr(dist.all_reduce, WRAPPED)
    assert {name: getattr(dist, name) for name in originals} == originals  # restored after the block
    assert (mappings.dist_all_gather_func, layers.dist_reduce_scatter_func) == bound


def test_real_collectives_in_a_region_are_timed_and_async_waits_too(world1):
    clock = CommClock()
    stack = contextlib.ExitStack()
    stack.enter_context(clock.installed())
    stack.callback(clock.read)
    x = torch.ones(4)
    dist.all_reduce(x)  # outside a region: a plain result
    clock.open_region()
    work = dist.all_reduce(x, async_op=True)
    assert type(work).__name__ == "_TimedWork"
    work.wait()
    assert work.is_completed()  # the rest of the Work is the real one
    dist.all_reduce(x)
    clock.close_region()
    compute, wait, *_ = clock.read()
    assert compute >= 0 and wait > 0
    assert len(clock._waits) == 0
    stack.close()


def test_compute_timers_accept_every_timer_name():
    timers = ComputeTimers(CommClock(FakeStamps()))
    timers("forward-send-backward-recv", log_level=2).start(barrier=False)
    timers("forward-send-backward-recv").stop()
    assert timers("forward-compute") is timers("forward-compute")


@pytest.mark.gpu
def test_cuda_event_clock_needs_no_synchronize_per_region():
    from megahet.runtime.timing import CudaStamps

    clock = CommClock(CudaStamps())
    a = torch.randn(2048, 2048, device="cuda")
    clock.open_region()
    for _ in range(20):
        a = a @ a / 2048
    clock.close_region()
    compute, wait, *_ = clock.read()
    assert compute > 0 and wait == 0


def test_cuda_event_clock_logic_without_a_gpu(monkeypatch):
    """What a GPU run goes through, with torch.cuda.Event faked on the host: one event per stamp, read
    after the step in milliseconds -> seconds, and no torch.cuda.synchronize() anywhere in a step."""
    from megahet.runtime.timing import CudaStamps

    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.t, self.synced = None, False

        def record(self):
            self.t = stamps_now[0]
            recorded.append(self)

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3  # milliseconds, as CUDA reports

    stamps_now = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronized in a step"))
    clock = CommClock(CudaStamps())
    clock.open_region()
    stamps_now[0] = 2.0
    with clock.blocked():
        stamps_now[0] = 2.5
    clock.close_region()
    assert len(recorded) == 4 and not any(e.synced for e in recorded)
    assert clock.read()[:3] == (2.0, 0.5, 0.0)  # read once, after the step


def test_the_one_interval_covers_every_layer_forward_and_backward(world1):
    """Each layer's forward sleeps 20 ms, and the gradient between the two layers waits 30 ms in backward:
    the layers' time holds all of it (the interval runs from the first layer's start to the last one's end,
    and back)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from resize_gpt import VOCAB, gpt

    model = gpt()
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]

    def slow_forward(module, args, output):
        time.sleep(0.02)
        if module is layers[0]:
            out = output[0] if isinstance(output, tuple) else output
            out.register_hook(lambda grad: time.sleep(0.03))  # in the backward, between the two layers

    for layer in layers:
        layer.register_forward_hook(slow_forward)
    clock = CommClock()
    time_layers(model, clock)
    clock.open_region()
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).sum().backward()
    clock.close_region()
    _, _, layers_s, *_ = clock.read()
    assert layers_s >= 0.065  # 0.07 slept inside; one layer at a time counted only 0.04 of it


def test_a_collective_over_a_group_of_one_is_not_timed_nor_counted_nor_delayed(world1):
    """megatron-core's cross-entropy all-reduces over the TP group even at TP 1: a collective that waits for
    no peer is no collective to the escalation's count (issue 46), and a late virtual device is not late to it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    clock = CommClock()
    delays = []
    clock.on_collective.append(lambda: delays.append(1))
    x = torch.ones(3)
    with clock.installed():
        clock.open_region()
        dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())  # a group of one: not timed
        dist.all_reduce(x)  # the default group: timed (here of one rank too, as a stand-in for the world)
        clock.close_region()
    times = clock.read()
    assert (times.collectives, len(delays)) == (1, 1)
