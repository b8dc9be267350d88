"""DeepSpeed ZeRO-1/2's per-parameter links and optimizer file layout (private API, DeepSpeed 0.19).

ZeRO-1/2 keeps each parameter's fp32 master and Adam state as a fragment of a flat partition per
parameter group. megahet reaches into that in three places, all through this module:
- the resizing and migration executor (megahet/tensor_parallel/executor.py) freezes and restores some
  elements of a parameter's master and Adam moments: `hp_fragment`, `fragment_local_offsets`,
  `fragment_optimizer_state`;
- the per-parameter optimizer state (megahet/checkpointing/optimizer_state.py) reads a ZeRO file's
  partitions (`file_partitions`, `file_group_lrs`, `file_partition_count`) and links Adam's state into
  a new engine (`link_optimizer_state`);
- the engine (megahet/engine.py) flags pipeline copies of a parameter for DeepSpeed's gradient norm
  (`mark_pipe_replicated`).

Private API used (each checked by tests/unit/test_compat.py):
- `param._hp_mapping` (a `tensor_fragment`): `lp_fragment_address` and `hp_fragment_address` (numel,
  start), `hp_fragment`,
  `optim_fragment`, `param_group_index`, `set_optim_state_fragment(flat, state)`;
- the ZeRO optimizer's `single_partition_of_fp32_groups`, `optimizer` (the wrapped Adam) and
  `_lazy_init_hp_params_optimizer_state()`;
- a ZeRO file's `optimizer_state_dict` keys: `single_partition_of_fp32_groups`,
  `base_optimizer_state` (torch's state dict, or a list per group), `param_slice_mappings` and
  `partition_count`;
- `param.ds_pipe_replicated`, read by DeepSpeed's gradient norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from deepspeed.runtime.constants import PIPE_REPLICATED

OPTIMIZER_STATE = "optimizer_state_dict"
"""The key of the ZeRO optimizer's state in a `*_optim_states.pt` file."""
FP32_PARTITIONS = "single_partition_of_fp32_groups"
BASE_STATE = "base_optimizer_state"
SLICE_MAPPINGS = "param_slice_mappings"


def hp_fragment(param: torch.nn.Parameter):
    """The parameter's link to its fragment of the ZeRO fp32 partition, or None (not partitioned here)."""
    return getattr(param, "_hp_mapping", None)


def fragment_local_offsets(fragment, offsets: np.ndarray) -> torch.Tensor:
    """Of the parameter's flat `offsets`, those in this rank's fragment, as offsets into the fragment
    (int64, on the fragment's device)."""
    addr = fragment.lp_fragment_address
    mine = offsets[(offsets >= addr.start) & (offsets < addr.start + addr.numel)] - addr.start
    return torch.from_numpy(mine).to(fragment.hp_fragment.device)


def fragment_range(fragment) -> tuple[int, int]:
    """[start, stop) of the parameter's flat elements that its ZeRO fragment holds."""
    addr = fragment.lp_fragment_address
    return addr.start, addr.start + addr.numel


def fragment_master(fragment) -> torch.Tensor:
    """The fragment's fp32 master elements (a flat view into the ZeRO partition)."""
    return fragment.hp_fragment


def adam_step(zero_optimizer) -> int:
    """Adam's step count (every flat partition shares it; 0 before the first step)."""
    inner = zero_optimizer.optimizer
    for state in inner.state.values():
        return int(state["step"])
    return 0


def fragment_optimizer_state(fragment, optimizer) -> dict[str, torch.Tensor]:
    """This ZeRO fragment's optimizer-state views ({} before the first step), linking them if needed.

    DeepSpeed (0.19) links every parameter to its optimizer state once, right after the optimizer
    step of the *first* parameter group, when the other groups (megahet's no-weight-decay group:
    biases) have no state yet; their links then stay empty for good. Link them here from the flat
    fp32 partition's state once it exists.
    """
    if not fragment.optim_fragment and optimizer is not None:
        flats = getattr(optimizer, FP32_PARTITIONS, None)
        inner = getattr(optimizer, "optimizer", None)
        if flats is not None and inner is not None:
            flat = flats[fragment.param_group_index]
            if inner.state.get(flat):
                fragment.set_optim_state_fragment(flat, inner.state[flat])
    return fragment.optim_fragment or {}


def zero_outside_fragments(zero_optimizer, params, keys: Sequence[str]) -> None:
    """Zero the elements of each flat fp32 partition's optimizer state `keys` that no parameter's fragment
    covers (ZeRO's alignment padding), where the state was allocated without being filled."""
    flats = getattr(zero_optimizer, FP32_PARTITIONS)
    spans: list[list[tuple[int, int]]] = [[] for _ in flats]
    for param in params:
        fragment = hp_fragment(param)
        if fragment is not None:
            addr = fragment.hp_fragment_address
            spans[fragment.param_group_index].append((addr.start, addr.start + addr.numel))
    for flat, covered in zip(flats, spans, strict=True):
        state = zero_optimizer.optimizer.state[flat]
        at = 0
        for start, stop in [*sorted(covered), (flat.numel(), flat.numel())]:
            if start > at:
                for key in keys:
                    state[key][at:start].zero_()
            at = max(at, stop)


def link_optimizer_state(zero_optimizer) -> None:
    """Link each parameter's fragment to the Adam state of its flat partition (after that state is set)."""
    zero_optimizer._lazy_init_hp_params_optimizer_state()


def _group_states(optimizer_state: dict) -> list[dict]:
    """Adam's state of each group's flat partition: torch's state_dict (state keyed by group index, as
    each group holds one flat tensor) or DeepSpeed's elastic list of per-group states."""
    base = optimizer_state[BASE_STATE]
    if isinstance(base, list):
        return base
    return [base["state"][i] for i in range(len(base["param_groups"]))]


class Partition(NamedTuple):
    """One parameter group's partition in a ZeRO file: its flat fp32 master and Adam moments by key
    ("fp32", "exp_avg", "exp_avg_sq"; each (numel,)), Adam's step, and {parameter name: fragment address
    (numel, start)} in those flats."""

    flats: dict[str, torch.Tensor]
    step: int
    mapping: dict


def file_partitions(saved: dict) -> list[Partition]:
    """Per parameter group of one ZeRO file's object, its `Partition`."""
    state = saved[OPTIMIZER_STATE]
    groups = zip(state[FP32_PARTITIONS], _group_states(state), state[SLICE_MAPPINGS], strict=True)
    return [
        Partition(
            {"fp32": fp32, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]},
            int(adam["step"]),
            mapping,
        )
        for fp32, adam, mapping in groups
    ]


def file_group_lrs(saved: dict) -> list[float] | None:
    """Each parameter group's learning rate at the save (what the next step uses), if recorded."""
    base = saved[OPTIMIZER_STATE][BASE_STATE]
    return [group["lr"] for group in base["param_groups"]] if isinstance(base, dict) else None


def file_partition_count(saved: dict, default: int) -> int:
    """The DP size the file's optimizer was partitioned over (`default` when not recorded)."""
    return saved[OPTIMIZER_STATE].get("partition_count", [default])[0]


def mark_pipe_replicated(param: torch.nn.Parameter) -> None:
    """Count `param` once in DeepSpeed's gradient norm over the model-parallel group (a pipeline copy)."""
    setattr(param, PIPE_REPLICATED, True)
