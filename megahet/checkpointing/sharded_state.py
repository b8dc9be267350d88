"""A checkpoint's state as a reshard plan sees it: per rank, flat tensors of the runs it holds.

Role: mechanism (reads DeepSpeed's files into the flat holdings of megahet/policy/reshard_plan.py;
megahet/runtime/state_move.py moves them).

- `checkpoint_params` lists the model's trained parameters, unsharded, from a saved checkpoint.
- `read_rank_state` reads one rank's state from a DeepSpeed checkpoint: its model states file (the
  weights) and its own ZeRO file (the fp32 masters and Adam moments of its fragment: DeepSpeed's
  `param_slice_mappings` say where each parameter's fragment sits in the flat partition). It checks
  that DeepSpeed partitioned the parameters as the plan says (`zero_fragments`, in the stage's module
  order): the plan's frame is only as right as that.
- `read_per_parameter_state` reads one rank's state from a per-parameter checkpoint (the rank-0
  reshard's output: megahet_optimizer_mp_rank_MM.pt holds every parameter whole), cut to the rank's
  ZeRO fragment.

    params = checkpoint_params(folder, meta)
    layout = saved_layout(meta)
    state = read_rank_state(folder, params, layout, rank=3, blocks=2)  # {(name, key): flat tensor}
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from megahet.checkpointing.checkpoint import optimizer_file
from megahet.checkpointing.convert import ShardLayout
from megahet.checkpointing.optimizer_state import one_adam_step, zero_files
from megahet.checkpointing.safe_load import load_file
from megahet.checkpointing.state_slices import Flat, empty_like_holding, put, take
from megahet.compat import deepspeed_zero as zero
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import ConfigError
from megahet.policy.reshard_plan import (
    WEIGHT,
    Layout,
    Param,
    ReshardPlan,
    State,
    rank_holdings,
    stage_params,
    unsharded_params,
    zero_groups,
)
from megahet.policy.stage_split import StageSplit


def saved_layout(meta: dict) -> Layout:
    """The TP x PP x DP and layers per stage a checkpoint's megahet.json records."""
    saved, model = meta["layout"], meta["model"]
    layers, pp = model["num_layers"], saved["pp"]
    split = saved.get("stage_layers") or (layers // pp,) * pp
    tied = not model.get("untie_embeddings_and_output_weights", False)
    return Layout(
        saved["tp"], pp, saved.get("dp", 1), StageSplit(split), tied=tied, strided=saved.get("strided", False)
    )


def checkpoint_params(folder: Path, meta: dict) -> list[Param]:
    """The unsharded model's trained parameters (names and shapes) of a checkpoint, from the `param_shapes`
    its TP rank 0 model states files record per stage (memory-mapped: the weights are not read)."""
    layout = saved_layout(meta)
    stages = []
    for stage in range(layout.pp):
        shapes = load_file(folder / model_states_file(stage * layout.tp), mmap=True)["param_shapes"]
        stages.append([(name, tuple(shape)) for group in shapes for name, shape in group.items()])
    gated = ShardLayout.recorded(meta).gated
    return unsharded_params(stages, layout.tp, layout.split, gated, layout.tied)


def _stage_order(params: Sequence[Param], layout: Layout, stage: int) -> list[list[str]]:
    """The stage's local parameter names per ZeRO group (decayed, then not), in module order."""
    named = stage_params(params, layout, stage)
    return [[named[i][0] for i in group] for group in zero_groups(named)]


def read_rank_state(
    folder: Path,
    params: Sequence[Param],
    layout: Layout,
    rank: int,
    blocks: int,
    mmap: bool = False,
    holding: State | None = None,
) -> Flat:
    """`rank`'s weights and ZeRO fragments from the DeepSpeed checkpoint `folder` saved at `layout`
    (reads that rank's model states file and its own ZeRO file only; `mmap`: memory-mapped, so that only
    the pages of the elements later read are loaded; `holding`: the rank's holdings, if the caller has
    them already)."""
    d, stage, t = layout.coords(rank)
    mp = stage * layout.tp + t
    holding = rank_holdings(params, layout, rank, blocks) if holding is None else holding
    states = load_file(folder / model_states_file(mp), mmap=mmap)
    order = [list(group) for group in states["param_shapes"]]
    if order != _stage_order(params, layout, stage):
        raise ConfigError(
            f"{folder}: mp_rank_{mp:02d}'s parameters are not in the order the reshard plan assumes "
            f"(DeepSpeed's groups {order}): the plan cannot address its ZeRO fragments"
        )
    name_of = {h.local_name: name for (name, key), h in holding.items() if key == WEIGHT}
    module = states["module"]
    out: Flat = {(name, WEIGHT): module[local].reshape(-1) for local, name in name_of.items()}
    saved = load_file(zero_files(folder, mp)[d], mmap=mmap)
    for partition in zero.file_partitions(saved):
        for local, address in partition.mapping.items():
            name = name_of[local]
            h = holding[(name, "fp32")]
            if address.numel != h.hi - h.lo:
                raise ConfigError(
                    f"{folder}: DP rank {d} of mp_rank_{mp:02d} holds {address.numel} elements of {local}, the "
                    f"reshard plan's ZeRO partition gives it {h.hi - h.lo}: DeepSpeed partitioned otherwise"
                )
            for key, flat in partition.flats.items():
                out[(name, key)] = flat.narrow(0, address.start, address.numel)
    for (name, key), h in holding.items():
        if (name, key) not in out:  # no fragment of this parameter on this DP rank
            out[(name, key)] = torch.zeros(0, dtype=torch.float32)
    return out


def read_per_parameter_state(
    folder: Path, params: Sequence[Param], layout: Layout, rank: int, blocks: int
) -> Flat:
    """`rank`'s weights and ZeRO fragments from a per-parameter checkpoint (the rank-0 reshard's)."""
    _, stage, t = layout.coords(rank)
    mp = stage * layout.tp + t
    module = load_file(folder / model_states_file(mp))["module"]
    optimizer = load_file(folder / optimizer_file(mp))
    out: Flat = {}
    for (name, key), h in rank_holdings(params, layout, rank, blocks).items():
        whole = module[h.local_name] if key == WEIGHT else optimizer[key][h.local_name]
        out[(name, key)] = whole.reshape(-1)[h.lo : h.hi]
    return out


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "madvise") and sys.platform.startswith("linux") else None
    except OSError:
        return None


_LIBC = _libc()
_MADV_DONTNEED = 4  # Linux: drop the pages from this process (a file mapping's are read again on access)


def release_pages(view: torch.Tensor) -> None:
    """Drop the pages under `view`, a read-only view of a memory-mapped file (torch.load(mmap=True)), from
    this process's memory: they stay in the page cache and are read again if touched. Linux only; a
    no-op elsewhere."""
    if _LIBC is None or view.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = view.data_ptr() // page * page
    stop = view.data_ptr() + view.numel() * view.element_size()
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_DONTNEED)


def read_planned_state(
    folder: Path, params: Sequence[Param], plan: ReshardPlan, rank: int, dtypes, into: Flat | None = None
) -> Flat:
    """New `rank`'s state under `plan` (made with keep=False: it holds nothing yet), read from the old
    ranks' files in `folder`: memory-mapped, one old rank at a time, copying only its runs and dropping
    the file pages it read once copied, so that the rank's memory holds its own new state and little
    more. `into`: the flat tensors to write it into (views of a built engine: `engine_state`; on its
    device), else new ones."""
    after = rank_holdings(params, plan.new, rank, plan.blocks)
    new = into if into is not None else {k: empty_like_holding(h, dtypes[k[1]]) for k, h in after.items()}
    if new.keys() != after.keys():
        raise ValueError(f"the destination holds {len(new)} tensors, the plan gives this rank {len(after)}")
    by_source: dict[int, list] = {}
    for t in plan.received_by(rank):
        by_source.setdefault(t.src, []).append(t)
    for src, transfers in sorted(by_source.items()):
        held = rank_holdings(params, plan.old, src, plan.blocks)
        old = read_rank_state(folder, params, plan.old, src, plan.blocks, mmap=True, holding=held)
        for t in transfers:
            k = (t.name, t.key)
            put(new[k], after[k], t.runs, take(old[k], held[k], t.runs))
            release_pages(old[k])
        del old  # unmaps the source's files
    return new


def saved_scalars(folder: Path, meta: dict) -> dict:
    """What every rank of a resharded restart holds alike: Adam's step (the one every ZeRO file of the
    checkpoint was saved at, as rank 0's reshard requires) and learning rates (a ZeRO file's), the LR
    schedule and the engine's step count (a model states file's)."""
    layout = saved_layout(meta)
    states = load_file(folder / model_states_file(0), mmap=True)
    files = [f for mp in range(layout.tp * layout.pp) for f in zero_files(folder, mp)]
    saved = [load_file(f, mmap=True) for f in files]
    return {
        "step": one_adam_step(folder, [part.step for file in saved for part in zero.file_partitions(file)]),
        "lr": zero.file_group_lrs(saved[0]),
        "lr_scheduler": states.get("lr_scheduler"),
        "global_steps": states.get("global_steps"),
    }
