"""Where a block's work units sit in its parameters, and the accessors the executor and migration use.

Role: mechanism (index arithmetic on parameter-shaped tensors; no policy).

A `UnitParam` says which slices of one parameter along `dim` belong to which unit:

- plain: unit u is `width` consecutive elements at u * width (an MLP unit's fc1 row, an MHA head's
  [q, k, v] rows, a head's proj columns);
- `groups` > 1: the dim is (groups, units, width) and a unit owns one slice of each group (SwiGLU's
  fc1 is [gates; ups]: unit u is its gate row u and its up row F + u);
- `GroupedUnitParam`: the dim is `blocks` equal periods and the units are `count` slices of `width` at
  `offset` inside each period, unit u in period u // count. Grouped-query attention's linear_qkv has one
  period per key/value group, [q_0 .. q_{r-1}, k, v] heads of hn rows each: its query heads are the
  units (count r, offset 0) and, with a group as the unit, its key/value pair (count 1, width 2 hn,
  offset r hn).

Every accessor takes a tensor shaped like the parameter (the parameter, its gradient, an optimizer
state) and a sorted index of units (a device tensor) or `slice(None)` for all:

    up.get(grad, index)           # (n, ...) the units' slices, unit-major
    up.set(grad, index, values)   # write them back
    up.add(grad, index, values)   # accumulate (migrated units' gradients coming home)
    up.scale_(grad, scale)        # multiply each unit's slices by scale[u], in place
    up.flat(tensor)               # (units, elements) float32 copy, for statistics
    up.guest_units(guest)         # the unit view of a helper's guest copy (n units, unit-major)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch


@dataclasses.dataclass(frozen=True, eq=False)  # identity semantics: a key in per-parameter dicts
class UnitParam:
    """A parameter whose slices along `dim` are work units of `width` elements each (see the module
    docstring for `groups`)."""

    param: torch.nn.Parameter
    dim: int
    width: int
    groups: int = 1

    def units(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of `tensor` (shaped like the parameter) with the unit axis first: (units, ...); with
        groups, (units, ..., groups, width, ...)."""
        if self.groups == 1:
            return tensor.unflatten(self.dim, (-1, self.width)).movedim(self.dim, 0)
        return tensor.unflatten(self.dim, (self.groups, -1, self.width)).movedim(self.dim + 1, 0)

    @property
    def num_units(self) -> int:
        return self.param.shape[self.dim] // (self.groups * self.width)

    @property
    def element_shape(self) -> torch.Size:
        """The shape of one unit's slices (the unit view without its unit axis)."""
        return self.units(self.param).shape[1:]

    def get(self, tensor: torch.Tensor, index) -> torch.Tensor:
        return self.units(tensor)[index]

    def set(self, tensor: torch.Tensor, index, values: torch.Tensor) -> None:
        self.units(tensor)[index] = values

    def add(self, tensor: torch.Tensor, index, values: torch.Tensor) -> None:
        self.units(tensor)[index] += values  # unique units: no accumulation within one call

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> None:
        """Multiply unit u's slices by scale[u] (a (units,) device tensor), in place."""
        units = self.units(tensor)
        units.mul_(scale.to(tensor.dtype).view(-1, *[1] * (units.dim() - 1)))

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """(units, elements) float32: every unit's slices, flattened."""
        return self.units(tensor).flatten(1).float()

    def guest_shape(self, units: int) -> list[int]:
        """The shape of a guest copy holding `units` migrated units (laid out as `guest_units` reads)."""
        shape = list(self.param.shape)
        shape[self.dim] = self.groups * units * self.width
        return shape

    def guest_units(self, guest: torch.Tensor) -> torch.Tensor:
        """The unit view of a guest copy: the parameter's own layout with fewer units."""
        return self.units(guest)

    def _rows_np(self, units: np.ndarray) -> np.ndarray:
        """Indexes along `dim` of the units' elements (host int64), every group's rows."""
        rows = (np.asarray(units, np.int64)[:, None] * self.width + np.arange(self.width)).reshape(-1)
        stride = self.param.shape[self.dim] // self.groups
        return (np.arange(self.groups)[:, None] * stride + rows).reshape(-1)

    def rows(self, units: torch.Tensor) -> torch.Tensor:
        """Indexes along `dim` of the given units' elements (a device tensor in, on its device), in the
        parameter's own order: per group, the units' rows."""
        offsets = torch.arange(self.width, device=units.device)
        rows = (units[:, None] * self.width + offsets).reshape(-1)  # (units * width,)
        if self.groups == 1:
            return rows
        stride = self.param.shape[self.dim] // self.groups
        return (torch.arange(self.groups, device=units.device)[:, None] * stride + rows).reshape(-1)

    def offsets(self, units: np.ndarray) -> np.ndarray:
        """Where the given units' elements sit in the flat parameter: host int64, computed from the shape
        alone (no device tensor is read, so no synchronization)."""
        shape = self.param.shape
        before, after = math.prod(shape[: self.dim]), math.prod(shape[self.dim + 1 :])
        rows = self._rows_np(units)
        start = np.arange(before)[:, None, None] * (shape[self.dim] * after)  # (before, 1, 1)
        return (start + rows[None, :, None] * after + np.arange(after)[None, None, :]).reshape(-1)


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedUnitParam(UnitParam):
    """Units that are `count` slices of `width` at `offset` in each of `blocks` periods of the dim (unit u
    in period u // count): grouped-query attention's query heads (count r) or key/value pairs (count 1).

    With count > 1 the units are not one strided axis of the parameter, so the accessors index a
    (blocks, count, ...) view with (u // count, u % count); a guest copy is plain (units, width) rows."""

    blocks: int = 1
    count: int = 1
    offset: int = 0

    def _view(self, tensor: torch.Tensor) -> torch.Tensor:
        """(blocks, count, ...) view: the units' slices, period-major."""
        period = tensor.shape[self.dim] // self.blocks
        view = tensor.unflatten(self.dim, (self.blocks, period)).narrow(
            self.dim + 1, self.offset, self.count * self.width
        )
        view = view.unflatten(self.dim + 1, (self.count, self.width))  # (..., blocks, count, width, ...)
        return view.movedim(self.dim, 0).movedim(self.dim + 1, 1)

    def _at(self, index) -> tuple:
        if isinstance(index, slice):
            return (slice(None), slice(None))
        return (index // self.count, index % self.count)

    def units(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.count != 1:
            raise TypeError(
                "query-head units of grouped-query attention have no strided view: use the accessors"
            )
        return self._view(tensor).squeeze(1)  # (blocks, ...), a view

    @property
    def num_units(self) -> int:
        return self.blocks * self.count

    @property
    def element_shape(self) -> torch.Size:
        return self._view(self.param).shape[2:]

    def get(self, tensor: torch.Tensor, index) -> torch.Tensor:
        if isinstance(index, slice):
            return self._view(tensor).flatten(0, 1)  # a copy when count > 1
        return self._view(tensor)[self._at(index)]

    def set(self, tensor: torch.Tensor, index, values: torch.Tensor) -> None:
        view = self._view(tensor)
        if isinstance(index, slice):
            view.copy_(values.unflatten(0, (self.blocks, self.count)))
        else:
            view.index_put_(self._at(index), values)

    def add(self, tensor: torch.Tensor, index, values: torch.Tensor) -> None:
        self._view(tensor).index_put_(self._at(index), values, accumulate=True)

    def scale_(self, tensor: torch.Tensor, scale: torch.Tensor) -> None:
        view = self._view(tensor)
        view.mul_(scale.to(tensor.dtype).view(self.blocks, self.count, *[1] * (view.dim() - 2)))

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._view(tensor).flatten(2).flatten(0, 1).float()

    def guest_shape(self, units: int) -> list[int]:
        shape = list(self.param.shape)
        shape[self.dim] = units * self.width
        return shape

    def guest_units(self, guest: torch.Tensor) -> torch.Tensor:
        return guest.unflatten(self.dim, (-1, self.width)).movedim(self.dim, 0)

    def _rows_np(self, units: np.ndarray) -> np.ndarray:
        units = np.asarray(units, np.int64)
        period = self.param.shape[self.dim] // self.blocks
        start = units // self.count * period + self.offset + units % self.count * self.width
        return (start[:, None] + np.arange(self.width)).reshape(-1)

    def rows(self, units: torch.Tensor) -> torch.Tensor:
        period = self.param.shape[self.dim] // self.blocks
        start = units // self.count * period + self.offset + units % self.count * self.width
        return (start[:, None] + torch.arange(self.width, device=units.device)).reshape(-1)
