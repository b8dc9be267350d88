"""Execute a reshard plan (megahet/policy/reshard_plan.py) on real tensors.

Role: mechanism (the plan says which frame runs move between which ranks; this moves the elements).

A rank's state of one (tensor, key) is a flat tensor (megahet/checkpointing/state_slices.py: take,
put, keep; `apply_plan` runs a whole plan in one process).

- `exchange` runs this rank's part of a plan over the process group: it keeps what it holds, sends the
  runs it is the source of and receives the runs it needs, one message per peer and dtype
  (`torch.distributed.batch_isend_irecv`), on the device the state lives on.
- the engine's side (`engine_state`, `load_engine_state`) is in megahet/checkpointing/state_slices.py.

    mine = exchange(plan, rank, before, after, engine_state(engine, before), dtypes)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megahet.checkpointing.state_slices import Flat, empty_like_holding, keep, put, take
from megahet.policy.reshard_plan import WEIGHT, ReshardPlan, State, Transfer


def _by_peer(transfers: Sequence[Transfer], peer_of) -> dict[tuple[int, bool], list[Transfer]]:
    """Transfers grouped by (peer, weights?): one message per peer and dtype, in plan order."""
    out: dict[tuple[int, bool], list[Transfer]] = {}
    for t in transfers:
        out.setdefault((peer_of(t), t.key == WEIGHT), []).append(t)
    return out


def exchange(
    plan: ReshardPlan,
    rank: int,
    before: State,
    after: State,
    old: Flat,
    dtypes: Mapping[str, torch.dtype],
    device: torch.device | str = "cpu",
) -> Flat:
    """This rank's new state under `plan` (every rank of the group calls it with the same plan): what it
    keeps of `old` (its flat tensors of `before`), and the runs it receives; it sends the runs others
    need from it. Returns the flat tensors of `after` on `device`."""
    new = {k: empty_like_holding(h, dtypes[k[1]], device) for k, h in after.items()}
    keep(old, before, after, new)
    ops, received = [], []
    for (dst, weights), group in _by_peer(plan.sent_by(rank), lambda t: t.dst).items():
        payload = torch.cat([take(old[(t.name, t.key)], before[(t.name, t.key)], t.runs) for t in group])
        ops.append(dist.P2POp(dist.isend, payload.contiguous(), dst, tag=int(weights)))
    for (src, weights), group in _by_peer(plan.received_by(rank), lambda t: t.src).items():
        dtype = dtypes[group[0].key]
        buffer = torch.empty(sum(t.numel for t in group), dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, buffer, src, tag=int(weights)))
        received.append((group, buffer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for group, buffer in received:
        at = 0
        for t in group:
            k = (t.name, t.key)
            put(new[k], after[k], t.runs, buffer[at : at + t.numel])
            at += t.numel
    return new
