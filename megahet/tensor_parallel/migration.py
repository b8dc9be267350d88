"""Lightweight migration: move migrated units' weights to helpers and their gradients back to owners.

Role: mechanism (the collectives that move migrated units).

A helper computes a migrated unit from the column-parallel input it already holds (replicated over
the TP group) and adds the unit's partial row-parallel output into its own partial sum before the
all-reduce it already performs, so the forward pass moves no extra activations. What moves, point to
point inside one TP group and proportional to the migrated units only:

- weights, owner -> helper: when the plan changes, and after every optimizer step (the owner keeps
  the unit's parameters, fp32 master and optimizer state, so the helper's copy must follow them);
- gradients, helper -> owner: once per step, after the schedule and before `engine.step()`, added
  into the owner's gradient in time for DeepSpeed's ZeRO-1 reduction, clipping and AdamW.

Ownership does not move: ZeRO's flattened buffers, its global-norm clipping and the checkpoints
stay exactly those of the unmigrated run, which is why training is numerically the same.

    exchange = MigrationExchange(blocks, dp_rank=0, tp_rank=1, tp_group=group)
    exchange.apply(plan)        # allocate guest copies, send current weights (bytes_plan_change)
    exchange.pull_grads()       # before engine.step()  (bytes of the step)
    exchange.push_weights()     # after engine.step()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megahet.tensor_parallel.blocks import Block
from megahet.tensor_parallel.plan import BlockKey, ResizePlan


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class MigrationExchange:
    def __init__(self, blocks: dict[BlockKey, Block], *, dp_rank: int, tp_rank: int, tp_group=None):
        self.blocks, self.dp_rank, self.tp_rank, self.tp_group = blocks, dp_rank, tp_rank, tp_group
        self.moves: dict[BlockKey, dict[tuple[int, int], tuple[int, ...]]] = {}
        self.guests: dict[BlockKey, list[torch.Tensor]] = {}  # per block, laid out like unit_params
        self.lent: dict[tuple[BlockKey, int, int], torch.Tensor] = {}
        """(block, owner, helper) -> the units this rank owns and lends, int64 on the parameters' device
        (made once per plan: a host-to-device copy per step would synchronize the stream)."""
        self.bytes_plan_change = 0
        self.bytes_last_step = 0

    @property
    def active(self) -> bool:
        return any(self.moves.values())

    def _peer(self, tp_rank: int) -> int:
        return dist.get_global_rank(self.tp_group, tp_rank) if self.tp_group is not None else tp_rank

    def _guest_slices(self, key: BlockKey):
        """(owner tp, units, start unit in the guest tensors) of the units migrated to this rank."""
        start = 0
        for (owner, helper), units in self.moves[key].items():
            if helper == self.tp_rank:
                yield owner, units, start
                start += len(units)

    def apply(self, plan: ResizePlan) -> None:
        """Install the plan's migrations: guest copies on helpers, filled with the owners' weights."""
        self.moves = {key: plan.migrations(key, self.dp_rank) for key in self.blocks}
        self.guests = {}
        self.lent = {
            (key, owner, helper): torch.tensor(units, device=self.blocks[key].column.weight.device)
            for key, moves in self.moves.items()
            for (owner, helper), units in moves.items()
            if owner == self.tp_rank
        }
        self.bytes_last_step = 0  # a plan without migrations moves nothing (no stale count)
        for key, block in self.blocks.items():
            hosted = sum(len(u) for (_, helper), u in self.moves[key].items() if helper == self.tp_rank)
            if not hosted:
                block.set_guests(None)
                continue
            tensors = []
            for up in block.unit_params:
                shape = list(up.param.shape)
                shape[up.dim] = up.groups * hosted * up.width
                tensors.append(
                    torch.zeros(shape, dtype=up.param.dtype, device=up.param.device, requires_grad=True)
                )
            self.guests[key] = tensors
            block.set_guests(tensors, hosted)
        self.bytes_plan_change = self.push_weights() if self.active else 0

    def install(self, enabled: bool) -> None:
        """Attach (or detach, e.g. to evaluate the whole model) the guest units, without communication."""
        for key, block in self.blocks.items():
            hosted = self.guests.get(key) if enabled else None
            block.set_guests(hosted, sum(len(u) for _, u, _ in self._guest_slices(key)) if hosted else 0)

    @torch.no_grad()
    def push_weights(self) -> int:
        """Owners send their migrated units' current weights into the helpers' guest copies."""
        ops, receives, sent = [], [], []
        for key in sorted(self.blocks):
            block = self.blocks[key]
            for (owner, helper), units in self.moves[key].items():
                if self.tp_rank == owner:
                    index = self.lent[(key, owner, helper)]
                    for up in block.unit_params:
                        payload = up.units(up.param.detach())[index].contiguous()  # (n, ...) unit-major
                        sent.append(payload)
                        ops.append(dist.P2POp(dist.isend, payload, self._peer(helper), self.tp_group))
            for owner, units, start in self._guest_slices(key):
                for up, guest in zip(block.unit_params, self.guests[key]):
                    view = up.units(guest)[start : start + len(units)]
                    buffer = torch.empty(view.shape, dtype=guest.dtype, device=guest.device)
                    receives.append((view, buffer))
                    ops.append(dist.P2POp(dist.irecv, buffer, self._peer(owner), self.tp_group))
        self._run(ops)
        for view, buffer in receives:
            view.copy_(buffer)
        return _nbytes(sent)

    @torch.no_grad()
    def pull_grads(self) -> int:
        """Helpers send their guest units' gradients (this step, all micro-batches) to the owners,
        who add them into their own parameters' gradients."""
        ops, adds, sent = [], [], []
        for key in sorted(self.blocks):
            block = self.blocks[key]
            for owner, units, start in self._guest_slices(key):
                for up, guest in zip(block.unit_params, self.guests[key]):
                    grad = guest.grad if guest.grad is not None else torch.zeros_like(guest)
                    payload = up.units(grad)[start : start + len(units)].contiguous()
                    sent.append(payload)
                    ops.append(dist.P2POp(dist.isend, payload, self._peer(owner), self.tp_group))
            for (owner, helper), units in self.moves[key].items():
                if self.tp_rank == owner:
                    index = self.lent[(key, owner, helper)]
                    for up in block.unit_params:
                        shape = (len(units), *up.units(up.param).shape[1:])
                        buffer = torch.empty(shape, dtype=up.param.dtype, device=up.param.device)
                        adds.append((up, index, buffer))
                        ops.append(dist.P2POp(dist.irecv, buffer, self._peer(helper), self.tp_group))
        self._run(ops)
        for up, index, buffer in adds:
            if up.param.grad is None:
                up.param.grad = torch.zeros_like(up.param)
            up.units(up.param.grad)[index] += buffer
        for tensors in self.guests.values():
            for guest in tensors:
                guest.grad = None
        self.bytes_last_step = _nbytes(sent)
        return self.bytes_last_step

    @staticmethod
    def _run(ops: list) -> None:
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
