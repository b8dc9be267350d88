"""ZeRO optimizer state per parameter, independent of the parallel layout (mechanism; no policy).

DeepSpeed's ZeRO-1/2 (and BF16_Optimizer) files `[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`
hold, per DP rank D of model-parallel rank MM, flat fp32 partitions of each parameter group (the fp32
masters and Adam's exp_avg / exp_avg_sq) and `param_slice_mappings`: per group, each parameter's
fragment (numel, start) in that partition. A parameter's full tensor is its fragments concatenated in
DP order, shaped as the model states file's `param_shapes` says (DeepSpeed's ds_to_universal reads
them the same way). `read_zero_state` gives those full tensors by (stage-local) parameter name;
megahet/checkpointing/convert.py reshards them with the weights; `load_into_engine` sets them into a running engine
through DeepSpeed's per-parameter API (safe_set_full_fp32_param / safe_set_full_optimizer_state), which
is correct for any DP size, ZeRO stage and partitioning.

    state = read_zero_state(Path("ckpt/iter_0000020"), mp_rank=0)   # {"fp32": {name: t}, ..., "step": 20}
    load_into_engine(engine, state)                                  # after engine.load_checkpoint(load_module_only=True)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from megahet.checkpointing.safe_load import load_file
from megahet.compat import deepspeed_zero as zero
from megahet.compat.deepspeed_checkpoint import (
    model_states_file,
    zero_dp_rank,
    zero_file_kind,
    zero_shard_files,
)
from megahet.config import ConfigError

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's per-element state, beside its step."""

TENSOR_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
"""Per-parameter tensors: the fp32 master weight and Adam's two moments."""


def zero_files(folder: Path, mp_rank: int) -> list[Path]:
    """This model-parallel rank's ZeRO shard files, in DP order (checked to be DP ranks 0..N-1 of one
    kind: bf16_ or not)."""
    files = zero_shard_files(folder, mp_rank)
    if not files:
        raise ConfigError(
            f"train.load: {folder} has no ZeRO optimizer shards for mp_rank_{mp_rank:02d}: it cannot be "
            f"resharded with its optimizer state (a weights-only checkpoint restarts the optimizer)"
        )
    kinds = {zero_file_kind(f) for f in files}
    ranks = [zero_dp_rank(f) for f in files]
    if len(kinds) > 1 or ranks != list(range(len(files))):
        raise ConfigError(
            f"train.load: {folder}'s ZeRO shards of mp_rank_{mp_rank:02d} are not one set of DP ranks 0..N-1 "
            f"({[f.name for f in files]}): the checkpoint is incomplete or mixed; resume from another one"
        )
    return files


def one_adam_step(folder: Path, steps: Iterable[int]) -> int:
    """The one Adam step that the ZeRO partitions of checkpoint `folder` were saved at (`steps`: theirs); a
    one-line error where they differ (files of two saves mixed in one folder)."""
    distinct = sorted(set(steps))
    if len(distinct) != 1:
        raise ConfigError(
            f"train.load: {folder}: the ZeRO shards were saved at different Adam steps {distinct}: its files "
            f"come from more than one save; resume from another checkpoint"
        )
    return distinct[0]


def read_zero_state(folder: Path, mp_rank: int) -> dict:
    """{"fp32" | "exp_avg" | "exp_avg_sq": {name: full tensor}, "step": Adam's step, "lr": each param
    group's learning rate, "lr_scheduler" / "global_steps": the engine's} of one model-parallel rank,
    merged over its DP shards."""
    model_states = load_file(folder / model_states_file(mp_rank))
    shapes = model_states["param_shapes"]
    shape_of = {name: shape for group in shapes for name, shape in group.items()}
    fragments: dict[str, dict[str, list[torch.Tensor]]] = {key: {} for key in TENSOR_KEYS}
    steps: set[int] = set()
    files = zero_files(folder, mp_rank)
    for file in files:
        saved = load_file(file)
        for partition in zero.file_partitions(saved):
            steps.add(partition.step)
            # address: (numel, start) of the parameter in this partition
            for name, address in partition.mapping.items():
                for key, buffer in partition.flats.items():
                    fragments[key].setdefault(name, []).append(buffer.narrow(0, address.start, address.numel))
    missing = sorted(set(shape_of) - set(fragments["fp32"]))
    if missing or len(files) != zero.file_partition_count(saved, len(files)):
        raise ConfigError(
            f"train.load: {folder} mp_rank_{mp_rank:02d}: the ZeRO shards ({len(files)} DP ranks) do not hold "
            f"every parameter ({missing[:1] or 'partition count'} missing): the checkpoint is incomplete"
        )
    state: dict = {
        "step": one_adam_step(folder, steps),
        "lr": zero.file_group_lrs(saved),
        "lr_scheduler": model_states.get("lr_scheduler"),
        "global_steps": model_states.get("global_steps"),
    }
    for key, by_name in fragments.items():
        state[key] = {}
        for name, parts in by_name.items():
            full = torch.cat(parts).float()  # (numel,) in DP order
            shape = shape_of[name]
            if full.numel() != shape.numel():
                raise ConfigError(
                    f"train.load: {folder} mp_rank_{mp_rank:02d}: the ZeRO shards hold {full.numel()} values of "
                    f"{name}, its shape {tuple(shape)} needs {shape.numel()}: the checkpoint is incomplete"
                )
            state[key][name] = full.view(shape).clone()
    return state


def load_into_engine(engine, state: dict) -> None:
    """Set the per-parameter fp32 masters, Adam moments, step and learning rates into the engine's ZeRO optimizer
    (every parameter the optimizer partitions must be in `state`)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    prepare_adam(engine, state["step"], state.get("lr"))
    params = dict(engine.module.named_parameters())
    trained = {name for name, p in params.items() if zero.hp_fragment(p) is not None}
    missing = sorted(trained - set(state["fp32"]))
    if missing:
        raise ConfigError(f"train.load: the checkpoint's optimizer state has no {missing[0]}: not this model")
    for name in trained:
        param = params[name]
        safe_set_full_fp32_param(param, state["fp32"][name].to(param.device))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, state[key][name].to(param.device), key)


def prepare_adam(engine, step: int, lrs: list[float] | None, written: bool = False) -> None:
    """Give the engine's ZeRO optimizer Adam's state at `step` (zero moments), the learning rates `lrs`
    per group (the schedule's value at the save, until its next step) and each parameter's link to its
    fragment of that state, so that the per-parameter state can be written into it.

    `written`: every parameter's fragment of both moments is written right after (a moved or read state).
    The moments are then allocated without being filled, so their memory becomes resident only as each
    fragment is written and its source dropped (zeros would make both moments resident while the whole
    state to be written into them is still held); only the elements that no fragment covers (ZeRO's
    alignment padding) are zeroed."""
    optimizer = engine.optimizer
    _init_adam_state(optimizer.optimizer, step, torch.empty_like if written else torch.zeros_like)
    if lrs is not None:
        for group, lr in zip(optimizer.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    zero.link_optimizer_state(optimizer)
    if written:
        zero.zero_outside_fragments(optimizer, engine.module.parameters(), MOMENTS)


def _init_adam_state(adam: torch.optim.Optimizer, step: int, new=torch.zeros_like) -> None:
    """Give every flat fp32 partition Adam's state (moments made by `new`, at `step`), as torch's own
    load_state_dict lays it out: torch creates it lazily at the first step, and DeepSpeed links each
    parameter's fragment of it only once it exists."""
    saved = adam.state_dict()
    flats = [p for group in adam.param_groups for p in group["params"]]
    saved["state"] = {
        i: {"step": torch.tensor(float(step)), **{key: new(p) for key in MOMENTS}}
        for i, p in enumerate(flats)
    }
    adam.load_state_dict(saved)
