"""The price of a first move to another layout, before one has been measured (issue 46).

Role: runtime (the escalation's, megahet/runtime/escalation.py; the move it prices is megahet/runtime/relayout.py,
whose measured cost replaces this price once it has moved).

The escalation weighs a move against its cost (break-even, megahet/policy/escalation.py). Before a move that
cost is predicted from what this run measured of the move's three parts (megahet/runtime/resplit.py
`ResplitCost`):
- planning, rehearsed: the live parameters gathered and the reshard plan to the candidate computed, timed;
- the transfer: the bytes the busiest rank sends or receives under that plan, at the world's point-to-point
  bandwidth, measured once by a ring of send/recv of the same size (1-16 MiB a rank);
- the rebuild: what of the run's setup the move does again, as measured at start (`Trainer.rebuild_s`:
  megatron-core's groups, and the model's and engine's build; not the rendezvous, nor a checkpoint's read).
Each part is the slowest rank's. Every rank calls the pricer at the same decision with the same candidate (it
runs collectives), so every rank gets the same price; a candidate is priced once.

    price_move = MovePricer(trainer, log)
    price_move(choice)        # seconds (a LayoutChoice: its TP, DP and placement)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megahet.parallel import slowest_over_ranks
from megahet.platform import cuda_available, device
from megahet.policy.escalation import LayoutChoice
from megahet.policy.reshard_plan import ReshardPlan
from megahet.runtime.resplit import plan_move, state_dtypes

PROBE_BYTES = (1 << 20, 16 << 20)
"""The bandwidth probe's size a rank: the busiest rank's bytes, within these bounds."""


@dataclasses.dataclass(frozen=True)
class MovePrice:
    rebuild_s: float
    plan_s: float
    bytes: int
    """The busiest rank's: the larger of what it sends and what it receives."""
    bandwidth: float
    """Bytes a second, rank to rank."""

    @property
    def transfer_s(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def total_s(self) -> float:
        return self.rebuild_s + self.plan_s + self.transfer_s

    def describe(self) -> str:
        return (
            f"{self.total_s:.2f} s: the rebuild {self.rebuild_s:.2f} s (as at start), planning "
            f"{self.plan_s:.2f} s (rehearsed), {self.bytes / 2**20:.1f} MiB at {self.bandwidth / 2**20:.0f} "
            f"MiB/s rank to rank (measured) {self.transfer_s:.2f} s"
        )


def busiest_bytes(moves: ReshardPlan, itemsize: dict[str, int], world: int) -> int:
    """The most bytes one rank sends, or receives, under `moves`."""
    sent, received = [0] * world, [0] * world
    for t in moves.transfers:
        nbytes = t.numel * itemsize[t.key]
        sent[t.src] += nbytes
        received[t.dst] += nbytes
    return max(max(s, r) for s, r in zip(sent, received))


def ring_bandwidth(nbytes: int) -> float:
    """Bytes a second each rank sends to the next while it receives from the previous (the world's ring),
    at the slowest rank's time. Every rank calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(nbytes, dtype=torch.uint8, device=device())  # [nbytes]
    into = torch.empty_like(out)
    dist.barrier()
    t0 = time.perf_counter()
    ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, into, (rank - 1) % world)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    if cuda_available():
        torch.cuda.synchronize()
    return nbytes / max(slowest_over_ranks(time.perf_counter() - t0)[0], 1e-9)


class MovePricer:
    """The first move's price per candidate layout, rehearsed on `trainer` (its model, layout and run plan)."""

    def __init__(self, trainer, log: Callable[[str], None]):
        self.trainer, self.log = trainer, log
        self.prices: dict[tuple[int, bool], MovePrice] = {}
        self.bandwidth: float | None = None

    def __call__(self, choice: LayoutChoice) -> float:
        key = (choice.tp, choice.strided)
        if key not in self.prices:
            self.prices[key] = price = self._rehearse(choice)
            strided = ", TP groups strided" if choice.strided else ""
            self.log(
                f"escalation: a first move to TP {choice.tp} x DP {choice.dp}{strided} priced at {price.describe()}"
            )
        return self.prices[key].total_s

    def _rehearse(self, choice: LayoutChoice) -> MovePrice:
        trainer = self.trainer
        model, plan = trainer.engine.module, trainer.plan
        dist.barrier()
        t0 = time.perf_counter()
        *_, moves = plan_move(
            model, trainer.layout, plan, choice.tp, 1, choice.dp, plan.split, choice.strided
        )
        (plan_s,) = slowest_over_ranks(time.perf_counter() - t0)
        itemsize = {key: dtype.itemsize for key, dtype in state_dtypes(model).items()}
        nbytes = busiest_bytes(moves, itemsize, trainer.layout.world_size)
        if self.bandwidth is None:
            self.bandwidth = ring_bandwidth(min(max(nbytes, PROBE_BYTES[0]), PROBE_BYTES[1]))
        return MovePrice(trainer.rebuild_s or trainer.build_s, plan_s, nbytes, self.bandwidth)
