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

import numpy as np
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
        self.lent: dict[tuple[BlockKey, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        """(block, owner, helper) -> (the units this rank owns and lends, their k/v groups under grouped-query
        attention), int64 on the parameters' device (made once per plan: a host-to-device copy per step
        would synchronize the stream)."""
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

    def _guest_groups(self, key: BlockKey):
        """Grouped-query attention: (owner tp, groups, start group in the shared guest tensors) of the
        k/v groups that go with the heads migrated to this rank."""
        start = 0
        for (owner, helper), units in self.moves[key].items():
            if helper == self.tp_rank:
                groups = np.unique(self.blocks[key].unit_group(units))
                yield owner, groups, start
                start += len(groups)

    def _pieces(self, key: BlockKey, owner: int, helper: int):
        """(unit parameter, the owner's index of units or groups it lends) for one owner -> helper move."""
        block = self.blocks[key]
        units, groups = self.lent[(key, owner, helper)]
        return [(up, units) for up in block.unit_params] + [(sp, groups) for sp in block.shared_params]

    def _guest_pieces(self, key: BlockKey):
        """(unit parameter, guest tensor, start, count) of every slice of the guests, per owner."""
        block, guests = self.blocks[key], self.guests[key]
        shared_guests = guests[len(block.unit_params) :]
        pieces = []
        for owner, units, start in self._guest_slices(key):
            pieces.append((owner, [(up, g, start, len(units)) for up, g in zip(block.unit_params, guests)]))
        if block.shared_params:  # grouped-query attention only: no per-step group arithmetic elsewhere
            for (owner, groups, start), (_, entry) in zip(self._guest_groups(key), pieces):
                entry += [(sp, g, start, len(groups)) for sp, g in zip(block.shared_params, shared_guests)]
        return pieces

    def apply(self, plan: ResizePlan) -> None:
        """Install the plan's migrations: guest copies on helpers, filled with the owners' weights."""
        self.moves = {key: plan.migrations(key, self.dp_rank) for key in self.blocks}
        self.guests = {}
        self.lent = {}
        for key, moves in self.moves.items():
            block = self.blocks[key]
            device = block.column.weight.device
            for (owner, helper), units in moves.items():
                if owner == self.tp_rank:
                    groups = (
                        np.unique(block.unit_group(units)) if block.shared_params else np.zeros(0, np.int64)
                    )
                    self.lent[(key, owner, helper)] = (
                        torch.tensor(units, device=device),
                        torch.from_numpy(groups).to(device),
                    )
        self.bytes_last_step = 0  # a plan without migrations moves nothing (no stale count)
        for key, block in self.blocks.items():
            hosted = sum(len(u) for (_, helper), u in self.moves[key].items() if helper == self.tp_rank)
            if not hosted:
                block.set_guests(None)
                continue
            groups = sum(len(g) for _, g, _ in self._guest_groups(key)) if block.shared_params else 0
            tensors = [
                torch.zeros(
                    up.guest_shape(n), dtype=up.param.dtype, device=up.param.device, requires_grad=True
                )
                for up, n in [(up, hosted) for up in block.unit_params]
                + [(sp, groups) for sp in block.shared_params]
            ]
            self.guests[key] = tensors
        self.install(True)
        self.bytes_plan_change = self.push_weights() if self.active else 0

    def _head_groups(self, key: BlockKey) -> torch.Tensor | None:
        """Grouped-query attention: each guest head's position among the guest k/v groups (owner order)."""
        block = self.blocks[key]
        if not block.shared_params:
            return None
        positions = []
        for (_, units, _), (_, groups, start) in zip(self._guest_slices(key), self._guest_groups(key)):
            positions.append(start + np.searchsorted(groups, block.unit_group(units)))
        return torch.from_numpy(np.concatenate(positions)).to(block.column.weight.device)

    def install(self, enabled: bool) -> None:
        """Attach (or detach, e.g. to evaluate the whole model) the guest units, without communication."""
        for key, block in self.blocks.items():
            hosted = self.guests.get(key) if enabled else None
            if hosted is None:
                block.set_guests(None)
                continue
            units = sum(len(u) for _, u, _ in self._guest_slices(key))
            block.set_guests(hosted, units, self._head_groups(key))

    @torch.no_grad()
    def push_weights(self) -> int:
        """Owners send their migrated units' current weights into the helpers' guest copies."""
        ops, receives, sent = [], [], []
        for key in sorted(self.blocks):
            for owner, helper in self.moves[key]:
                if self.tp_rank == owner:
                    for up, index in self._pieces(key, owner, helper):
                        payload = up.get(up.param.detach(), index).contiguous()  # (n, ...) unit-major
                        sent.append(payload)
                        ops.append(dist.P2POp(dist.isend, payload, self._peer(helper), self.tp_group))
            for owner, pieces in self._guest_pieces(key) if key in self.guests else ():
                for up, guest, start, n in pieces:
                    view = up.guest_units(guest)[start : start + n]
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
            for owner, pieces in self._guest_pieces(key) if key in self.guests else ():
                for up, guest, start, n in pieces:
                    grad = guest.grad if guest.grad is not None else torch.zeros_like(guest)
                    payload = up.guest_units(grad)[start : start + n].contiguous()
                    sent.append(payload)
                    ops.append(dist.P2POp(dist.isend, payload, self._peer(owner), self.tp_group))
            for owner, helper in self.moves[key]:
                if self.tp_rank == owner:
                    for up, index in self._pieces(key, owner, helper):
                        shape = (len(index), *up.element_shape)
                        buffer = torch.empty(shape, dtype=up.param.dtype, device=up.param.device)
                        adds.append((up, index, buffer))
                        ops.append(dist.P2POp(dist.irecv, buffer, self._peer(helper), self.tp_group))
        self._run(ops)
        for up, index, buffer in adds:
            if up.param.grad is None:
                up.param.grad = torch.zeros_like(up.param)
            up.add(up.param.grad, index, buffer)
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
