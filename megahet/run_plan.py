"""The run plan: everything set-up decides, computed once from the configuration and the world.

Role: setup (the plan is data; `plan_run` is the one place that builds it, calling the pure planners
of megahet/policy/; the runtime reads the plan and never re-derives any of it).

    plan = plan_run(cfg, spec, world_size)   # before any rank starts work: every check, once
    plan.cfg                                 # the validated configuration the ranks run, frozen
    plan.tp, plan.pp, plan.dp                # the layout (TP x PP fitted to the world on an elastic resume)
    plan.split                               # layers per pipeline stage (StageSplit)
    plan.speeds                              # declared speeds by rank coordinates (dp, pp, tp); {} if none
    plan.shares                              # the data-parallel shares the run starts from
    plan.resume, plan.reshard, plan.notes    # what to load, whether to reshard it first, what to say

What it replaces: the split used to be written back into `parallel.stage_layers` and parsed again in
five modules, the configuration rewritten up to three times, and `hetero.speeds` parsed in three places.
Now `hetero.speeds` is parsed by validation (to check it) and once here (the value); the split is a
`StageSplit` in the plan; `plan.cfg` is frozen (`MegahetConfig.freeze`): an assignment to it raises. A
re-split makes a new plan (`with_split`), with the same configuration.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any

from megahet.checkpointing import finder
from megahet.checkpointing.elastic import fit_layout, layout_note, needs_reshard, with_layout
from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import ranks_per_node, stage_split, validate
from megahet.engine import fold_deepspeed_json
from megahet.layout_plan import plan_for_launch
from megahet.parallel import mesh_coords
from megahet.policy.declared_speeds import parse_declared_speeds
from megahet.policy.dp_shares import DataParallelShares, RankCoords, dp_shares, even_shares, replica_speeds
from megahet.policy.stage_split import StageSplit
from megahet.runtime.balancer import recorded_targets
from megahet.runtime.stage_plan import starting_split


def check_replay(cfg: MegahetConfig) -> None:
    """balance.replay: a recorded TP trace per pipeline stage, with the plans this mode can execute."""
    b = cfg.balance
    if b.mode == "static":
        raise ConfigError(
            f"balance.replay {b.replay} replays a balancer's plans: set balance.mode to the recorded run's mode"
        )
    for stage in range(cfg.parallel.pp):
        try:
            targets = recorded_targets(b.replay, stage if cfg.parallel.pp > 1 else None)
        except (OSError, ValueError) as err:
            raise ConfigError(f"balance.replay: {err}") from None
        lossless = all(not any(t.gamma.values()) for step in targets.values() for t in step)
        still = all(not t.moves for step in targets.values() for t in step)
        if not ((lossless or b.resizes) and (still or b.migrates)):
            raise ConfigError(
                f"balance.replay {b.replay} holds plans that balance.mode={b.mode} cannot execute "
                f"({'resizing' if not lossless else 'migration'}): set balance.mode to the recorded run's mode"
            )


@dataclasses.dataclass(frozen=True)
class RunPlan:
    cfg: MegahetConfig
    """The validated configuration the ranks run (frozen)."""
    world_size: int
    dp: int
    split: StageSplit
    """Layers per pipeline stage."""
    speeds: Mapping[RankCoords, float]
    """Declared relative speeds (hetero.speeds) by (dp, pp, tp) coordinates; empty when none."""
    shares: DataParallelShares | None
    """The micro-batches per replica the run starts from (None: packed documents, planned per step)."""
    replica_speeds: tuple[float, ...] | None
    """Packed documents with declared speeds: each replica's speed relative to the fastest."""
    resume: finder.Resume | None
    reshard: bool
    """Whether `resume` must be resharded to this layout before it loads (elastic)."""
    notes: tuple[str, ...] = ()
    """Lines rank 0 prints before any rank starts work (which checkpoint, which layout)."""
    user_ds: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The user's DeepSpeed JSON (train.deepspeed_config), already folded into cfg."""
    escalation_tps: tuple[int, ...] = ()
    """escalate.mode=on: the TP sizes whose TP x DP layout of this world fits (the current one among them)."""
    home_cfg: MegahetConfig | None = None
    """After an escalation's move: the run's own configuration, which every layout is derived from."""
    strided: bool = False
    """After an escalation's move: TP groups strided over the ranks (megahet/policy/mesh.py)."""

    @property
    def tp(self) -> int:
        return self.cfg.parallel.tp

    @property
    def pp(self) -> int:
        return self.cfg.parallel.pp

    def with_split(self, split) -> RunPlan:
        """This plan with other layers per stage (a re-split: nothing else changes)."""
        return dataclasses.replace(self, split=StageSplit(split), resume=None, reshard=False, notes=())

    def with_layout(self, tp: int, shares: Sequence[int] | None = None, strided: bool = False) -> RunPlan:
        """This plan at TP `tp` x DP (world / TP), PP 1 (an escalation's move: `escalated_config`); the data
        and the model stay, the split is the whole model, the replicas start from `shares` (even if None),
        the TP groups `strided` over the ranks or not."""
        home = self.home_cfg or self.cfg
        cfg = escalated_config(home, tp, self.world_size)
        dp = validate(cfg, self.world_size)
        total = cfg.train.global_batch_size // cfg.train.micro_batch_size
        start = even_shares(total, dp) if shares is None else DataParallelShares(shares)
        if len(start) != dp or sum(start) != total:
            raise ValueError(f"shares {list(start)}: not {total} micro-batches over {dp} replicas")
        return dataclasses.replace(
            self, cfg=cfg.freeze(), dp=dp, split=stage_split(cfg), speeds=types.MappingProxyType({}),
            shares=start, replica_speeds=None, resume=None, reshard=False, notes=(), home_cfg=home,
            strided=strided and 1 < tp < self.world_size,
        )  # fmt: skip

    def tp_group_speeds(self, pp_rank: int) -> list[list[float]] | None:
        """Declared speeds of stage pp_rank's TP ranks, per replica (what the TP balancer starts from)."""
        if not self.speeds:
            return None
        return [[self.speeds[(dp, pp_rank, tp)] for tp in range(self.tp)] for dp in range(self.dp)]


def escalated_config(cfg: MegahetConfig, tp: int, world: int) -> MegahetConfig:
    """cfg at TP `tp` x DP (world / TP), PP 1, balancing what the layout can by measured speed: DP shares
    (hetero.dp_shares=measured unless the run plans them otherwise) when DP > 1, the TP balancer (the run's
    balance.mode) only when TP > 1. At the run's own TP it is the run's configuration."""
    if tp == cfg.parallel.tp:
        return cfg
    cfg = with_layout(cfg, tp, 1)
    h, b = cfg.hetero, cfg.balance
    shares = h.dp_shares if world // tp == 1 or h.active else "measured"
    return dataclasses.replace(
        cfg,
        hetero=dataclasses.replace(h, dp_shares=shares if world // tp > 1 else "even"),
        balance=b if tp > 1 else dataclasses.replace(b, mode="static"),
    )


def escalation_layouts(cfg: MegahetConfig, world: int) -> tuple[int, ...]:
    """The TP sizes an escalation may move between: those whose `escalated_config` passes validation at
    this world (the run's own among them). A ConfigError when there is no other."""
    tps = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        try:
            validate(escalated_config(cfg, tp, world), world)
        except ConfigError:
            continue
        tps.append(tp)
    if tps == [cfg.parallel.tp]:
        raise ConfigError(
            f"escalate.mode=on: no other TP x DP layout of {world} ranks fits this run (TP must divide the heads "
            "and the MLP, DP the global batch in micro-batches): change the batch or set escalate.mode=off"
        )
    return tuple(tps)


def declared_by_coords(cfg: MegahetConfig, world_size: int) -> dict[RankCoords, float]:
    """hetero.speeds (validated) by each rank's (dp, pp, tp) coordinates; {} when unset. The CP ranks of a
    position (context parallelism) count as their slowest: they exchange keys and values every layer."""
    if not cfg.hetero.speeds:
        return {}
    p = cfg.parallel
    speeds = parse_declared_speeds(cfg.hetero.speeds, world_size, ranks_per_node(world_size))
    out: dict[RankCoords, float] = {}
    for coords, speed in zip(mesh_coords(world_size, p.tp, p.pp, cp=p.cp), speeds, strict=True):
        out[coords] = min(out.get(coords, speed), speed)
    return out


def _starting_shares(
    cfg: MegahetConfig, dp: int, speeds: Mapping[RankCoords, float], packed: bool
) -> tuple[DataParallelShares | None, tuple[float, ...] | None]:
    """(shares, replica speeds) at step 0: even, or from the declared speeds when the shares are planned."""
    t, h = cfg.train, cfg.hetero
    total = t.global_batch_size // t.micro_batch_size
    if not (speeds and h.active):
        return (None, None) if packed else (even_shares(total, dp), None)
    # A TP balancer evens each TP group out; without one a replica runs at its slowest rank.
    per_replica = replica_speeds(speeds, tp_balanced=cfg.balance.plans)
    if packed:
        return None, tuple(s / max(per_replica) for s in per_replica)
    return dp_shares(per_replica, total, healthy_gap=h.healthy_gap), None


def plan_run(cfg: MegahetConfig, spec, world_size: int | None = None) -> RunPlan:
    """Check the configuration, its inputs and the checkpoint to resume against the world, and decide
    the layout, the stage split, the starting shares and what to load. Raises a one-line ConfigError
    before any rank starts work. `spec`: the task (megahet.task.TaskSpec: vocab_size, preflight)."""
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    cfg, user_ds = fold_deepspeed_json(cfg)
    spec.preflight(cfg)  # the inputs first: the planner and the checkpoint checks read the vocabulary
    notes = []
    if cfg.plan.auto:
        cfg, planned = plan_for_launch(cfg, spec.vocab_size(cfg), world)
        notes.append(planned)
    resume = finder.find_resume(cfg)
    if resume is not None:
        finder.check_model(resume, cfg, spec.vocab_size(cfg))
    full = resume is not None and not resume.meta.get("weights_only")
    asked = cfg
    tp, pp = fit_layout(cfg, world) if full else (cfg.parallel.tp, cfg.parallel.pp)
    cfg = with_layout(cfg, tp, pp)
    dp = validate(cfg, world)
    if cfg.balance.replay:
        check_replay(cfg)
    speeds = declared_by_coords(cfg, world)
    split = starting_split(cfg, speeds, spec.vocab_size(cfg), resume)
    reshard = full and needs_reshard(resume, cfg, world, split)
    notes += [resume.note] if resume is not None and resume.note else []
    if resume is not None:
        moved = layout_note(resume, asked, cfg, world, reshard)
        notes += [moved] if moved else []
        if not reshard:
            finder.check_compatible(resume, cfg, finder.zero_ranks(cfg, dp), split)
    shares, per_replica = _starting_shares(cfg, dp, speeds, cfg.data.packing == "documents")
    tps = escalation_layouts(cfg, world) if cfg.escalate.active else ()
    return RunPlan(
        cfg=cfg.freeze(),
        world_size=world,
        dp=dp,
        split=split,
        speeds=types.MappingProxyType(speeds),
        shares=shares,
        replica_speeds=per_replica,
        resume=resume,
        reshard=reshard,
        notes=tuple(notes),
        user_ds=types.MappingProxyType(user_ds),
        escalation_tps=tps,
    )
