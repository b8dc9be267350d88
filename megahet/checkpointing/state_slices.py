"""A reshard plan's runs on real tensors: read them from one layout's flat state, write them into another's.

Role: mechanism (megahet/policy/reshard_plan.py says which frame runs move between which ranks; this
moves the elements; megahet/runtime/state_move.py exchanges them between ranks, and
megahet/checkpointing/sharded_state.py reads them from checkpoint files).

A rank's state of one (tensor, key) is a flat tensor: the whole TP-local tensor for the weights, its
ZeRO fragment [lo, hi) of it for the optimizer keys (`Holding`). `take` reads the elements of frame
runs from such a tensor, in frame order; `put` writes them into the new layout's tensor; `keep` copies
what a rank holds in both layouts; `apply_plan` runs a whole plan in one process (every rank's old state
in, every rank's new state out: the tests, and offline tools). `engine_state` views a live DeepSpeed
engine's state as the plan's holdings (its parameters and its ZeRO fragments); `load_engine_state`
writes a new holding into a freshly built engine.

    new_states = apply_plan(plan, params, old_states, dtypes)   # {rank: {(name, key): flat tensor}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from megahet.checkpointing.optimizer_state import prepare_adam
from megahet.compat import deepspeed_zero as zero
from megahet.policy.reshard_plan import (
    WEIGHT,
    Holding,
    Param,
    ReshardPlan,
    State,
    intersect,
    local_ranges,
    rank_holdings,
)

Flat = dict[tuple[str, str], torch.Tensor]  # (unsharded name, key) -> flat tensor, of one rank


def take(flat: torch.Tensor, holding: Holding, runs: np.ndarray) -> torch.Tensor:
    """The elements of frame `runs` (held by `holding`) from its flat tensor, in frame order; (n,)."""
    ranges = local_ranges(holding, runs)
    if len(ranges) == 1:
        a, b = ranges[0]
        return flat[a:b]
    return torch.cat([flat[a:b] for a, b in ranges]) if len(ranges) else flat[:0]


def put(flat: torch.Tensor, holding: Holding, runs: np.ndarray, values: torch.Tensor) -> None:
    """Write `values` ((n,), in frame order) into the elements of frame `runs` of `holding`'s flat tensor."""
    at = 0
    for a, b in local_ranges(holding, runs):
        flat[a:b].copy_(values[at : at + b - a])
        at += b - a
    if at != values.numel():
        raise ValueError(f"{holding.local_name}: {values.numel()} values for {at} elements")


def empty_like_holding(
    holding: Holding, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The new layout's flat tensor of `holding` (its [lo, hi)), to be filled by put."""
    return torch.empty(holding.hi - holding.lo, dtype=dtype, device=device)


def _one_range(ranges: np.ndarray) -> tuple[int, int] | None:
    """[start, stop) if the (k, 2) ranges follow one another with no gap, else None."""
    if not len(ranges) or (len(ranges) > 1 and (ranges[1:, 0] != ranges[:-1, 1]).any()):
        return None
    return int(ranges[0, 0]), int(ranges[-1, 1])


def keep(old: Flat, before: State, after: State, new: Flat, share: bool = False) -> None:
    """Copy into `new` what this rank held in `before` and still holds in `after` (nothing crosses ranks).

    `share`: where the rank keeps the whole of a tensor's new holding, as one stretch of its old flat
    tensor in the same order, `new` takes a view of the old tensor instead of a copy (no pass over the
    memory; the old storage stays alive while the view does). A re-split keeps most of its stage so."""
    for k, h in after.items():
        had = before.get(k)
        if had is not None and k in old:
            runs = intersect(h.runs, had.runs)
            if not len(runs):
                continue
            source = _one_range(local_ranges(had, runs)) if share else None
            if source is not None and _one_range(local_ranges(h, runs)) == (0, h.hi - h.lo):
                new[k] = old[k][source[0] : source[1]]
            else:
                put(new[k], h, runs, take(old[k], had, runs))


def apply_plan(
    plan: ReshardPlan,
    params: Sequence[Param],
    old_states: Mapping[int, Flat],
    dtypes: Mapping[str, torch.dtype],
) -> dict[int, Flat]:
    """Run `plan` in one process: every old rank's flat tensors in (`old_states`), every new rank's out
    (`dtypes`: per key)."""
    before = {r: rank_holdings(params, plan.old, r, plan.blocks) for r in range(plan.old.world)}
    after = {r: rank_holdings(params, plan.new, r, plan.blocks) for r in range(plan.new.world)}
    new_states: dict[int, Flat] = {}
    for r, state in after.items():
        new_states[r] = {k: empty_like_holding(h, dtypes[k[1]]) for k, h in state.items()}
        keep(old_states.get(r, {}), before.get(r, {}), state, new_states[r])
    for t in plan.transfers:
        k = (t.name, t.key)
        put(
            new_states[t.dst][k],
            after[t.dst][k],
            t.runs,
            take(old_states[t.src][k], before[t.src][k], t.runs),
        )
    return new_states


def engine_state(engine, holdings: State) -> Flat:
    """This rank's state as `holdings` says it holds it, as views of the live engine: the module's
    parameters (weights) and the ZeRO fragments of its fp32 masters and Adam moments. ValueError when
    DeepSpeed's fragments are not where the plan puts them."""
    params = dict(engine.module.named_parameters())
    out: Flat = {}
    for (name, key), h in holdings.items():
        param = params[h.local_name]
        if key == WEIGHT:
            out[(name, key)] = param.detach().reshape(-1)
            continue
        fragment = zero.hp_fragment(param)
        lo, hi = zero.fragment_range(fragment) if fragment is not None else (0, 0)
        if (lo, hi) != (h.lo, h.hi) and hi > lo:
            raise ValueError(
                f"{h.local_name}: DeepSpeed's ZeRO fragment is [{lo}, {hi}), the reshard plan's [{h.lo}, {h.hi}): "
                f"the plan cannot address this engine's optimizer state"
            )
        if fragment is None or hi == lo:
            out[(name, key)] = torch.zeros(0, dtype=torch.float32, device=param.device)
        else:
            out[(name, key)] = _fragment_view(fragment, key, engine.optimizer)
    return out


def _fragment_view(fragment, key: str, optimizer) -> torch.Tensor:
    """The ZeRO fragment's flat view of optimizer key `key`: its fp32 master or an Adam moment."""
    if key == "fp32":
        return zero.fragment_master(fragment)
    return zero.fragment_optimizer_state(fragment, optimizer)[key]


def load_weights(model: torch.nn.Module, holdings: State, flat: Flat) -> None:
    """Write the weights of this rank's new state (`flat`, of `holdings`) into a freshly built `model`,
    before its engine is made, and drop them from `flat`: DeepSpeed then flattens the parameters into its
    buffers, and no second copy of the weights is held while it does."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for (name, key), h in holdings.items():
            if key == WEIGHT:
                params[h.local_name].view(-1).copy_(flat.pop((name, key)))


def check_holds_every_parameter(module: torch.nn.Module, holdings: State) -> None:
    """ValueError unless `holdings` gives state for every parameter of `module` (a stage built to be
    loaded: one left out would keep the values it was built with)."""
    missing = sorted(
        {name for name, _ in module.named_parameters()} - {h.local_name for h in holdings.values()}
    )
    if missing:
        raise ValueError(
            f"the reshard plan holds no state for {missing[0]}: it would keep the values it was built with"
        )


def load_engine_state(
    engine, holdings: State, flat: Flat, step: int, lrs: list[float] | None, weights_loaded: bool = False
) -> None:
    """Write this rank's new state (`flat`, of `holdings`) into a freshly built engine: the weights into
    the module's parameters (unless `weights_loaded`: load_weights wrote them before the engine was
    built), the fp32 masters and then the Adam moments (at Adam `step`, learning rates `lrs`) into its
    ZeRO fragments. Consumes `flat`: each tensor is dropped once written, and the fp32 masters before
    the moments are made, so that the state is never held twice over."""
    params = dict(engine.module.named_parameters())
    check_holds_every_parameter(engine.module, holdings)

    def write(keys: set[str]) -> None:
        for (name, key), h in holdings.items():
            if key not in keys:
                continue
            param, values = params[h.local_name], flat.pop((name, key))
            fragment = zero.hp_fragment(param)
            if fragment is None or h.hi == h.lo:
                continue
            if zero.fragment_range(fragment) != (h.lo, h.hi):
                raise ValueError(f"{h.local_name}: the new engine's ZeRO fragment is not the plan's")
            _fragment_view(fragment, key, engine.optimizer).copy_(values)

    if not weights_loaded:
        load_weights(engine.module, holdings, flat)
    with torch.no_grad():
        write({"fp32"})
        prepare_adam(engine, step, lrs, written=True)
        write({"exp_avg", "exp_avg_sq"})
