"""Execute a reshard plan (megahet/policy/reshard_plan.py) on real tensors.

Role: mechanism (the plan says which frame runs move between which ranks; this moves the elements).

A rank's state of one (tensor, key) is a flat tensor (megahet/checkpointing/state_slices.py: take,
put, keep; `apply_plan` runs a whole plan in one process).

- `exchange` runs this rank's part of a plan over the process group: it keeps what it holds, sends the
  runs it is the source of and receives the runs it needs, one message per transfer, small ones packed
  per peer (`torch.distributed.batch_isend_irecv`), on the device the state lives on.
- the engine's side (`engine_state`, `load_engine_state`) is in megahet/checkpointing/state_slices.py.

    mine = exchange(plan, rank, before, after, engine_state(engine, before), dtypes)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megahet.checkpointing.state_slices import Flat, empty_like_holding, keep, put, take
from megahet.policy.reshard_plan import ReshardPlan, State, local_ranges

SMALL_BYTES = 1 << 20
"""Runs smaller than this travel packed: one message per peer and dtype instead of hundreds (a small
model's runs are tens of KiB). On the 2-core CPU host it did not change the 10 M re-split's transfer
(x1.7-7.0 a plain send, against x2.3-6.0 unpacked: stalls of 4 ranks on 2 cores, docs/benchmarks.md);
per-message latency on a network or NCCL is not measured."""


def exchange(
    plan: ReshardPlan,
    rank: int,
    before: State,
    after: State,
    old: Flat,
    dtypes: Mapping[str, torch.dtype],
    device: torch.device | str = "cpu",
    keep_local: bool = True,
    packed_below: int = SMALL_BYTES,
) -> Flat:
    """This rank's new state under `plan` (every rank of the group calls it with the same plan): the runs
    it receives, and (`keep_local`) what it keeps of `old` (its flat tensors of `before`); it sends the
    runs others need from it. Returns the flat tensors of `after` on `device` (without `keep_local`,
    the runs it kept are still to be copied: `keep`).

    A run of at least `packed_below` bytes is one message, sent from a view of the old state and received
    straight into the new state where the run is contiguous there (no packing); smaller runs to one
    peer travel packed in one message per dtype. Messages between two ranks match in order: the packed
    ones first (by dtype), then the others in plan order."""
    ranks = max(plan.old.world, plan.new.world)
    if ranks > dist.get_world_size():  # gloo would write to ranks that do not exist
        raise ValueError(
            f"the reshard plan spans {ranks} ranks, the process group has {dist.get_world_size()}"
        )

    def small(t) -> bool:
        return t.numel * dtypes[t.key].itemsize < packed_below

    new = {k: empty_like_holding(h, dtypes[k[1]], device) for k, h in after.items()}
    packed_out: dict[tuple[int, str], list[torch.Tensor]] = {}
    packed_in: dict[tuple[int, str], list] = {}
    ops, scattered = [], []
    for t in plan.sent_by(rank):
        values = take(old[(t.name, t.key)], before[(t.name, t.key)], t.runs)
        if small(t):
            packed_out.setdefault((t.dst, str(dtypes[t.key])), []).append(values)
        else:
            ops.append(dist.P2POp(dist.isend, values.contiguous(), t.dst))
    for t in plan.received_by(rank):
        k = (t.name, t.key)
        if small(t):
            packed_in.setdefault((t.src, str(dtypes[t.key])), []).append(t)
            continue
        ranges = local_ranges(after[k], t.runs)
        if len(ranges) == 1:  # straight into the new state
            buffer = new[k][ranges[0, 0] : ranges[0, 1]]
        else:
            buffer = torch.empty(t.numel, dtype=dtypes[t.key], device=device)
            scattered.append((t, buffer))
        ops.append(dist.P2POp(dist.irecv, buffer, t.src))
    packed = [dist.P2POp(dist.isend, torch.cat(v), dst) for (dst, _), v in sorted(packed_out.items())]
    received = []
    for (src, _), transfers in sorted(packed_in.items()):
        buffer = torch.empty(sum(t.numel for t in transfers), dtype=dtypes[transfers[0].key], device=device)
        packed.append(dist.P2POp(dist.irecv, buffer, src))
        received.append((transfers, buffer))
    ops = packed + ops
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if keep_local:
        keep(old, before, after, new)
    for transfers, buffer in received:
        scattered += zip(transfers, buffer.split([t.numel for t in transfers]))
    for t, buffer in scattered:
        put(new[(t.name, t.key)], after[(t.name, t.key)], t.runs, buffer)
    return new
