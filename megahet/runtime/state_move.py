"""Execute a reshard plan (megahet/policy/reshard_plan.py) on real tensors.

Role: mechanism (the plan says which frame runs move between which ranks; this moves the elements).

A rank's state of one (tensor, key) is a flat tensor (megahet/checkpointing/state_slices.py: take,
put, keep; `apply_plan` runs a whole plan in one process).

- `exchange` runs this rank's part of a plan over the process group: it keeps what it holds, sends the
  runs it is the source of and receives the runs it needs, one message per transfer
  (`torch.distributed.batch_isend_irecv`), on the device the state lives on.
- the engine's side (`engine_state`, `load_engine_state`) is in megahet/checkpointing/state_slices.py.

    mine = exchange(plan, rank, before, after, engine_state(engine, before), dtypes)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megahet.checkpointing.state_slices import Flat, empty_like_holding, keep, put, take
from megahet.policy.reshard_plan import ReshardPlan, State, local_ranges


def exchange(
    plan: ReshardPlan,
    rank: int,
    before: State,
    after: State,
    old: Flat,
    dtypes: Mapping[str, torch.dtype],
    device: torch.device | str = "cpu",
    keep_local: bool = True,
) -> Flat:
    """This rank's new state under `plan` (every rank of the group calls it with the same plan): the runs
    it receives, and (`keep_local`) what it keeps of `old` (its flat tensors of `before`); it sends the
    runs others need from it. Returns the flat tensors of `after` on `device` (without `keep_local`,
    the runs it kept are still to be copied: `keep`).

    One message per transfer, sent from a view of the old state and received straight into the new
    state where the run is contiguous there (no packing); messages between two ranks match in plan
    order."""
    ranks = max(plan.old.world, plan.new.world)
    if ranks > dist.get_world_size():  # gloo would write to ranks that do not exist
        raise ValueError(
            f"the reshard plan spans {ranks} ranks, the process group has {dist.get_world_size()}"
        )
    new = {k: empty_like_holding(h, dtypes[k[1]], device) for k, h in after.items()}
    ops, scattered = [], []
    for t in plan.sent_by(rank):
        k = (t.name, t.key)
        ops.append(dist.P2POp(dist.isend, take(old[k], before[k], t.runs).contiguous(), t.dst))
    for t in plan.received_by(rank):
        k = (t.name, t.key)
        ranges = local_ranges(after[k], t.runs)
        if len(ranges) == 1:  # straight into the new state
            buffer = new[k][ranges[0, 0] : ranges[0, 1]]
        else:
            buffer = torch.empty(t.numel, dtype=dtypes[t.key], device=device)
            scattered.append((t, buffer))
        ops.append(dist.P2POp(dist.irecv, buffer, t.src))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if keep_local:
        keep(old, before, after, new)
    for t, buffer in scattered:
        put(new[(t.name, t.key)], after[(t.name, t.key)], t.runs, buffer)
    return new
