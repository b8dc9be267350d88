"""Executes a ResizePlan on this rank: layer index sets, gradient policy, optimizer freeze, statistics.

Role: mechanism (executes the plan it is given; no policy).

    executor = ResizeExecutor(model, dp_rank=0, tp_rank=1, dp_size=2, imputation="zero", num_microbatches=4)
    executor.apply(plan)              # between steps; no model or engine rebuild
    ... forward/backward ...          # gradient hooks impute and rescale per micro-batch
    executor.before_step(optimizer)   # remember the frozen units
    engine.step()
    executor.after_step(optimizer)    # restore them; update statistics

Gradient policy, per unit u of this TP rank's shard, with k_u = DP replicas that compute u:
- 0 < k_u: replicas that dropped u contribute zero and the others scale u's gradient by D / k_u
  before the data-parallel mean, so u's gradient is averaged over the replicas that computed it
  (count-aware averaging; with one plan on every replica, k_u = D and nothing changes). With uneven
  data-parallel shares (`set_shares`: replica r runs n_r of the M micro-batches) the average is over
  their samples: the scale is M / (sum of n_r over the replicas that compute u).
- k_u = 0 (no replica computed u) — imputation:
  - "zero": no gradient, and the unit is frozen: its weights, fp32 master copy and AdamW moments
    are restored after the optimizer step, so neither momentum nor weight decay moves it.
  - "same": u's gradient is its last measured gradient (from the last step it was computed), and
    AdamW updates u as usual (momentum and weight decay apply).
  - "average": u's gradient is the mean of the gradients of the units this rank computed in the
    same parameter, and AdamW updates u as usual.
The hooks run on every micro-batch's gradient before it is accumulated, so they work the same
under ZeRO-1 and ZeRO-2 (which reduce-scatters during the backward pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import Literal

import numpy as np
import torch

from megahet.compat import deepspeed_zero as zero
from megahet.tensor_parallel.blocks import Block, UnitParam, find_blocks
from megahet.tensor_parallel.migration import MigrationExchange
from megahet.tensor_parallel.plan import BlockKey, ResizePlan, block_name, parse_block_name

Imputation = Literal["zero", "same", "average"]


@dataclasses.dataclass
class _BlockState:
    """A block's share of the plan: host arrays for bookkeeping, and the index and scale tensors the
    layers and gradient hooks use, made once per plan on the parameters' device (no host-to-device
    copy or synchronization per micro-batch)."""

    computed: np.ndarray  # (units,) bool: this rank computes the unit
    imputed_units: np.ndarray  # (units no replica computes,) int64: `imputed` on the host
    kept: torch.Tensor  # (computed units,) int64 on the device: the units this rank computes
    imputed: torch.Tensor  # (units no replica computes,) int64 on the device
    scale: torch.Tensor  # (units,) float32 on the device: D / k_u (M / N_u) where 0 < k_u, else 1
    computed_mask: torch.Tensor  # (units,) bool on the device: `computed`, for the statistics

    @classmethod
    def of(cls, computed: np.ndarray, counts: np.ndarray, total: int, device: torch.device) -> _BlockState:
        """`counts`: replicas (or their micro-batches) computing each unit, of `total`."""
        scale = np.where(counts > 0, total / np.maximum(counts, 1), 1.0)
        imputed = np.flatnonzero(counts == 0)
        return cls(
            computed,
            imputed,
            torch.from_numpy(np.flatnonzero(computed)).to(device),
            torch.from_numpy(imputed).to(device),
            torch.from_numpy(scale).float().to(device),
            torch.from_numpy(computed).to(device),
        )


class ResizeExecutor:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dp_rank: int,
        tp_rank: int,
        dp_size: int,
        imputation: Imputation = "zero",
        num_microbatches: int = 1,
        track_gradients: bool = False,
        track_weights: bool = False,
        score_samples: int = 0,
        tp_group=None,
    ):
        if imputation not in ("zero", "same", "average"):
            raise ValueError(f"imputation must be zero, same or average, got {imputation!r}")
        self.blocks: dict[BlockKey, Block] = find_blocks(model)
        self.dp_rank, self.tp_rank, self.dp_size = dp_rank, tp_rank, dp_size
        self.exchange = MigrationExchange(self.blocks, dp_rank=dp_rank, tp_rank=tp_rank, tp_group=tp_group)
        self.imputation, self.num_microbatches = imputation, num_microbatches
        self.shares = (1,) * dp_size
        """Each replica's weight in the data-parallel mean: micro-batches per step (even: all alike)."""
        self.plan = ResizePlan()
        self._state: dict[BlockKey, _BlockState | None] = dict.fromkeys(self.blocks)
        self._all_computed: dict[BlockKey, torch.Tensor] = {}  # computed_mask of an unresized block
        self._group_state: dict[BlockKey, _BlockState | None] = dict.fromkeys(self.blocks)
        """Grouped-query attention: the state of the key/value groups (units = groups; a group is
        computed while any of its heads is), which the groups' shared k/v rows follow."""
        self._last_grad: dict[UnitParam, torch.Tensor] = {}
        self._step_grad: dict[UnitParam, torch.Tensor] = {}
        self._frozen: list = []
        self._frozen_index: dict[UnitParam, tuple] = {}  # per parameter, _FrozenSlice.indexes of the plan
        self.unit_gradients: dict[BlockKey, torch.Tensor] = {}
        """With track_gradients: each unit's local gradient of the last step at the sampled elements,
        (units, samples) (every element when score_samples is 0 or covers the unit)."""
        self.unit_weights: dict[BlockKey, torch.Tensor] = {}
        """With track_gradients and track_weights (only the taylor score needs them): each unit's weights
        at the same elements as they were in that step's forward pass (taken before the optimizer
        step), (units, samples)."""
        self._sample_index: dict[UnitParam, torch.Tensor | None] = {}
        """Per parameter, the sampled elements' offsets in it, (units, samples), or None for all."""
        self._sample_grad: dict[UnitParam, torch.Tensor] = {}
        self._unhooked: list[tuple[BlockKey, UnitParam, bool]] = []
        """Parameters whose gradient hook is not registered yet: it is registered where it has work (a
        plan that resizes or migrates, statistics, 'same' imputation), so an even split with nothing to
        track runs no hook per parameter and micro-batch (issue 48)."""
        self._flop_layers = [m for block in self.blocks.values() for m in block.layers]
        for block in self.blocks.values():
            if track_gradients:
                for up, index in _sample_elements(block, score_samples).items():
                    self._sample_index[up] = _element_offsets(up, index)
            for up in block.unit_params + block.shared_params:
                self._unhooked.append((block.key, up, up in block.shared_params))
                if imputation == "same":
                    self._last_grad[up] = torch.zeros_like(up.param, dtype=torch.float32)
                    self._step_grad[up] = torch.zeros_like(up.param, dtype=torch.float32)
                if track_gradients and up in self._sample_index:
                    samples = _take(up.param.detach(), up, self._sample_index[up])
                    self._sample_grad[up] = torch.zeros_like(samples, dtype=torch.float32)
        self.track_gradients = track_gradients
        self.track_weights = track_gradients and track_weights
        if track_gradients or imputation == "same":
            self._register_hooks()
        self.sampling = True
        """With track_gradients: whether this step's gradients are sampled (the statistics sample one step
        in resize.score_interval; the ResizeController sets it before each step)."""

    @property
    def block_units(self) -> dict[BlockKey, int]:
        return {key: block.num_units for key, block in self.blocks.items()}

    def unit_work(self, seq_length: int) -> dict[BlockKey, float]:
        """Per block, one unit's forward FLOPs per token (`Block.unit_work`)."""
        return {key: block.unit_work(seq_length) for key, block in self.blocks.items()}

    def executed_flops(self) -> int:
        """Forward GEMM FLOPs executed by this rank's resizable blocks since construction."""
        return sum([layer.executed_flops for layer in self._flop_layers])

    def _register_hooks(self) -> None:
        for key, up, shared in self._unhooked:
            up.param.register_hook(self._make_hook(key, up, shared))
        self._unhooked = []

    def computed_units(self, key: BlockKey) -> np.ndarray:
        state = self._state[key]
        return np.ones(self.blocks[key].num_units, bool) if state is None else state.computed

    def computed_mask(self, key: BlockKey) -> torch.Tensor:
        """`computed_units` as a (units,) bool tensor on the parameters' device, made once per plan (no
        host-to-device copy per step)."""
        state = self._state[key]
        if state is not None:
            return state.computed_mask
        if key not in self._all_computed:
            block = self.blocks[key]
            self._all_computed[key] = torch.ones(
                block.num_units, dtype=torch.bool, device=block.column.weight.device
            )
        return self._all_computed[key]

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Replica r runs shares[r] micro-batches per step from the next step on (heterogeneous data
        parallelism): gradient averaging over the replicas computing a unit weighs them by it."""
        if len(shares) != self.dp_size:
            raise ValueError(f"{len(shares)} shares for {self.dp_size} DP replicas")
        self.num_microbatches = shares[self.dp_rank]
        even = len(set(shares)) == 1
        self.shares = (1,) * self.dp_size if even else tuple(shares)
        self.apply(self.plan)

    def apply(self, plan: ResizePlan) -> None:
        """Make the layers execute `plan` from the next forward pass on."""
        self.plan = plan
        self._frozen_index = {}
        total = sum(self.shares)
        for key, block in self.blocks.items():
            n = block.num_units
            counts = np.asarray(plan.compute_counts(key, self.tp_rank, self.dp_size, n, self.shares))
            dropped = list(plan.dropped(key, self.dp_rank, self.tp_rank))
            if dropped and (max(dropped) >= n or len(dropped) >= n):
                raise ValueError(
                    f"plan drops units {dropped} of block {key}, which has {n}: keep at least one"
                )
            computed = np.ones(n, dtype=bool)  # executed here: neither dropped nor migrated away
            computed[dropped] = False
            computed[list(plan.migrated_away(key, self.dp_rank, self.tp_rank))] = False
            if not computed.any():
                raise ValueError(
                    f"plan leaves rank (dp {self.dp_rank}, tp {self.tp_rank}) no unit of block {key}"
                )
            device = block.column.weight.device
            if computed.all() and (counts == total).all():
                self._state[key] = None
            else:
                self._state[key] = _BlockState.of(computed, counts, total, device)
            self._group_state[key] = (
                self._groups_of(block, plan, computed, device) if block.shared_params else None
            )
        if self._unhooked and any(
            st is not None for st in (*self._state.values(), *self._group_state.values())
        ):
            self._register_hooks()
        self._install(True)
        self.exchange.apply(plan)

    def _groups_of(self, block: Block, plan: ResizePlan, computed: np.ndarray, device) -> _BlockState | None:
        """Grouped-query attention: a group is computed here while one of its heads is, and counts for a
        replica that drops only some of its heads."""
        groups = block.unit_group(np.arange(block.num_units))  # (units,) each unit's group
        computed_groups = np.zeros(block.query_groups, bool)
        np.logical_or.at(computed_groups, groups, computed)
        counts = np.zeros(block.query_groups)
        for dp_rank, weight in enumerate(self.shares):
            alive = np.ones(block.num_units, bool)
            alive[list(plan.dropped(block.key, dp_rank, self.tp_rank))] = False
            alive_groups = np.zeros(block.query_groups, bool)
            np.logical_or.at(alive_groups, groups, alive)
            counts += weight * alive_groups
        if computed_groups.all() and (counts == sum(self.shares)).all():
            return None
        return _BlockState.of(computed_groups, counts, sum(self.shares), device)

    def _install(self, enabled: bool) -> None:
        """Set every block's executed units (and guests) from the current state, or the whole model."""
        for key, block in self.blocks.items():
            state = self._state[key] if enabled else None
            block.apply(None if state is None else state.kept)
        self.exchange.install(enabled)

    def last_gradients(self) -> dict[str, list[torch.Tensor]]:
        """The 'same' policy's remembered gradients, per block (in unit_params order)."""
        return {
            block_name(key): [self._last_grad[up].clone() for up in block.unit_params + block.shared_params]
            for key, block in self.blocks.items()
            if block.unit_params[0] in self._last_grad
        }

    def load_last_gradients(self, saved: dict[str, list[torch.Tensor]]) -> None:
        for name, tensors in saved.items():
            block = self.blocks[parse_block_name(name)]
            for up, tensor in zip(block.unit_params + block.shared_params, tensors):
                self._last_grad[up].copy_(tensor)

    @contextlib.contextmanager
    def full_model(self):
        """Run every unit (e.g. for evaluation), then return to the current plan."""
        self._install(False)
        try:
            yield
        finally:
            self._install(True)

    def _make_hook(self, key: BlockKey, up: UnitParam, shared: bool):
        """The gradient hook of one unit parameter (`shared`: a grouped-query block's k/v rows, whose units
        are its groups)."""
        states = self._group_state if shared else self._state

        def hook(grad: torch.Tensor) -> torch.Tensor:
            state = states[key]
            if up in self._step_grad:
                self._step_grad[up] += grad.float()
            if self.sampling and up in self._sample_grad:
                self._sample_grad[up] += _take(grad, up, self._sample_index[up])  # (units, samples)
            if state is None:
                return grad
            grad = grad.clone()
            imputed = state.imputed
            if len(imputed) and self.imputation == "average":
                mean = up.get(grad, state.kept).mean(dim=0)  # (...) the kept units' mean
                up.set(grad, imputed, mean.expand(len(imputed), *mean.shape).to(grad.dtype))
            elif len(imputed) and self.imputation == "same":
                up.set(
                    grad,
                    imputed,
                    (up.get(self._last_grad[up], imputed) / self.num_microbatches).to(grad.dtype),
                )
            up.scale_(grad, state.scale)
            return grad

        return hook

    def before_step(self, optimizer=None) -> None:
        """Bring migrated units' gradients home; sample the unit weights the step's gradients were taken
        at (statistics); under the zero policy, remember every frozen unit."""
        if self.exchange.active:
            self.exchange.pull_grads()
        if self.track_weights and self.sampling:
            for key, block in self.blocks.items():
                self.unit_weights[key] = torch.cat(
                    [_take(up.param.detach(), up, self._sample_index[up]) for up in block.unit_params],
                    dim=1,
                )
        self._frozen = []
        if self.imputation != "zero":
            return
        for key, block in self.blocks.items():
            for params, state in (
                (block.unit_params, self._state[key]),
                (block.shared_params, self._group_state[key]),
            ):
                if state is None or not len(state.imputed):
                    continue
                for up in params:
                    if up not in self._frozen_index:  # once per plan: a host-to-device copy syncs the stream
                        self._frozen_index[up] = _FrozenSlice.indexes(
                            up.param, up.offsets(state.imputed_units)
                        )
                    self._frozen.append(_FrozenSlice.capture(up.param, *self._frozen_index[up], optimizer))

    def after_step(self, optimizer=None) -> None:
        """Restore frozen units; keep the step's unit gradients ('same' policy, statistics)."""
        for frozen in self._frozen:
            frozen.restore(optimizer)
        self._frozen = []
        if self.exchange.active:
            self.exchange.bytes_last_step += self.exchange.push_weights()
        for key, block in self.blocks.items():
            if self.track_gradients and self.sampling:
                self.unit_gradients[key] = torch.cat(
                    [self._sample_grad[up] for up in block.unit_params], dim=1
                )
                for up in block.unit_params:
                    self._sample_grad[up].zero_()
            for params, state in (
                (block.unit_params, self._state[key]),
                (block.shared_params, self._group_state[key]),
            ):
                keep = slice(None) if state is None else state.kept  # the units computed this step
                for up in params:
                    if up in self._last_grad:
                        up.set(self._last_grad[up], keep, up.get(self._step_grad[up], keep))
                    if up in self._step_grad:
                        self._step_grad[up].zero_()


def _sample_elements(block: Block, samples: int) -> dict[UnitParam, tuple | None]:
    """A fixed random sample of `samples` of a unit's elements (over all its parameters), the same
    for every unit and on every rank (seeded by the block's name): per parameter the index tensors
    into its unit view's trailing dims, or None for all. Gradient variance summed over a uniform
    sample of coordinates is an unbiased estimate (up to the factor elements / samples, the same
    for every unit of the block) of the variance summed over all of them, so the units rank alike at
    a sliver of the memory and time."""
    sizes = [up.element_shape for up in block.unit_params]
    numels = [int(np.prod(shape)) for shape in sizes]
    total = sum(numels)
    if samples <= 0 or samples >= total:
        return dict.fromkeys(block.unit_params)
    generator = torch.Generator().manual_seed(zlib.crc32(block_name(block.key).encode()))
    chosen = torch.randperm(total, generator=generator)[:samples].sort().values
    out, start = {}, 0
    for up, shape, numel in zip(block.unit_params, sizes, numels):
        mine = chosen[(chosen >= start) & (chosen < start + numel)] - start
        out[up] = tuple(i.to(up.param.device) for i in torch.unravel_index(mine, shape))
        start += numel
    return out


def _element_offsets(up: UnitParam, index: tuple | None) -> torch.Tensor | None:
    """Where the sampled elements of every unit sit in the flat parameter, (units, samples), or None."""
    if index is None:
        return None
    dtype = torch.int32 if up.param.numel() < 2**31 else torch.int64
    position = torch.arange(up.param.numel(), dtype=dtype, device=up.param.device).view(up.param.shape)
    return up.get(position, slice(None))[(slice(None), *index)]


def _take(tensor: torch.Tensor, up: UnitParam, offsets: torch.Tensor | None) -> torch.Tensor:
    """(units, samples) float32 values of a parameter-shaped tensor at the sampled elements: one
    index_select on its flat view (advanced indexing of the unit view cost ~4x as much on CPU, as much
    as the layer's own GEMM at 1024 samples)."""
    if offsets is None:
        return up.flat(tensor)
    return tensor.reshape(-1).index_select(0, offsets.view(-1)).view(offsets.shape).float()


@dataclasses.dataclass
class _FrozenSlice:
    """The values of some elements of a parameter: module copy, DeepSpeed fp32 master, optimizer state.

    The elements are given by flat offsets computed on the host from the plan, and moved to the
    parameter's device once: capture and restore are index_select / index_copy_, with no boolean
    masking (a device-to-host synchronization per parameter on a GPU)."""

    param: torch.nn.Parameter
    index: torch.Tensor  # (elements,) int64 on the parameter's device
    module_values: torch.Tensor
    master: tuple | None  # (local index, fp32 values, {state key: values}) of this rank's ZeRO fragment
    torch_state: dict[str, torch.Tensor]

    @staticmethod
    def indexes(param, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(flat offsets in the parameter, offsets in this rank's ZeRO fp32 fragment or None), int64 on
        the devices of the parameter and of the fragment."""
        fragment = zero.hp_fragment(param)  # DeepSpeed ZeRO-1/2 link to the fp32 partition
        local = None if fragment is None else zero.fragment_local_offsets(fragment, offsets)
        return torch.from_numpy(offsets).to(param.device), local

    @classmethod
    @torch.no_grad()
    def capture(cls, param, index: torch.Tensor, local: torch.Tensor | None, optimizer) -> _FrozenSlice:
        master = None
        fragment = zero.hp_fragment(param)
        if fragment is not None and local is not None:
            states = {
                k: v.index_select(0, local)
                for k, v in zero.fragment_optimizer_state(fragment, optimizer).items()
            }
            master = (local, fragment.hp_fragment.index_select(0, local), states)
        torch_state = {}
        if optimizer is not None and param in getattr(optimizer, "state", {}):
            for k, v in optimizer.state[param].items():
                if torch.is_tensor(v) and v.shape == param.shape:
                    torch_state[k] = v.view(-1).index_select(0, index)
        return cls(param, index, param.data.view(-1).index_select(0, index), master, torch_state)

    @torch.no_grad()
    def restore(self, optimizer) -> None:
        self.param.data.view(-1).index_copy_(0, self.index, self.module_values)
        fragment = zero.hp_fragment(self.param)
        if self.master is not None and fragment is not None:
            local, values, states = self.master
            fragment.hp_fragment.index_copy_(0, local, values)
            for k, v in zero.fragment_optimizer_state(fragment, optimizer).items():
                if k in states:
                    v.index_copy_(0, local, states[k])
                else:  # state created by this step: as if never stepped
                    v.index_fill_(0, local, 0.0)
        if optimizer is not None and self.param in getattr(optimizer, "state", {}):
            for k, v in optimizer.state[self.param].items():
                if torch.is_tensor(v) and v.shape == self.param.shape:
                    if k in self.torch_state:
                        v.view(-1).index_copy_(0, self.index, self.torch_state[k])
                    else:
                        v.view(-1).index_fill_(0, self.index, 0.0)
