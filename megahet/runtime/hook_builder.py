"""The step hooks of a run, built in one place, in the order the Trainer calls them.

Role: runtime setup (`megahet.training.build_trainer` calls it once per Trainer, a re-split's too; the
hooks are megahet/runtime/*.py, and each gets the Trainer as its `StepContext`, never lambdas).

    trainer.step_hooks = build_step_hooks(plan, trainer, resplits=0, extra_hooks=())

The order, and why:
1. `PipelineBalancer` (hetero.pp_split != even, PP > 1): folds in the last step's per-layer times and
   may ask for a re-split, which ends training after the step;
2. `DataParallelBalancer` (hetero.dp_shares != even): re-plans the shares before the step's data is read,
   so new shares apply from the step's first micro-batch;
3. `BalanceController` (balance.mode != static, or a trace): plans the TP work at the start of a step...
4. `ResizeController` (resize.* or the balancer): ...which this executes, after the plan is made;
5. `DeviceStepHook` (device.profile): the virtual device's step;
6. `PackingController` (data.packing=documents): the cost model's profile and refits, after the step's
   plan is known;
7. `EscalationController` (escalate.mode=on): reads the balancers' speeds once they folded the last
   step in, and may ask for another layout, which ends training after the step;
8. the task's own hooks (`Task.step_hooks`, e.g. the CP placement's speed measurement);
9. the caller's `extra_hooks` (pretrain's), last: they see what megahet's hooks did.

Set-up that goes with the hooks happens here too: the transformer layers' compute is timed when a
balancer reads it, a virtual device is attached to the Trainer's clock, and the plan's starting shares
(or packed replica speeds) and declared TP speeds are applied once every hook exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from megahet.parallel import mesh_coords
from megahet.policy.escalation import rank_speeds
from megahet.policy.speed_profile import parse_collective_delays, parse_profile
from megahet.run_plan import RunPlan
from megahet.runtime.balancer import BalanceController
from megahet.runtime.devices import DeviceStepHook, VirtualDevice, attach_virtual_device
from megahet.runtime.dp_balancer import DataParallelBalancer
from megahet.runtime.escalation import EscalationController, layout_memory, memory_cap_bytes
from megahet.runtime.hooks import StepHook
from megahet.runtime.move_price import MovePricer
from megahet.runtime.packing import PackingController
from megahet.runtime.pp_balancer import PipelineBalancer
from megahet.runtime.resizer import ResizeController
from megahet.runtime.timing import time_layers


def _virtual_device(plan: RunPlan, trainer) -> StepHook:
    cfg, layout = plan.cfg, trainer.layout
    profile = parse_profile(cfg.device.profile)
    index, width = profile.index(layout.tp_rank, layout.tp_size, layout.rank, layout.world_size)
    delay = 0.0
    if cfg.device.collective_delay_ms is not None:
        delays = parse_collective_delays(cfg.device.collective_delay_ms, layout.tp_size, layout.world_size)
        delay = delays[layout.rank if len(delays) == layout.world_size != layout.tp_size else layout.tp_rank]
    device = VirtualDevice(profile, index, width, cfg.device.rate_gflops, collective_delay_s=delay)
    attach_virtual_device(trainer.task.model, device, trainer.clock)  # it pays before each timed collective
    return DeviceStepHook(device)


def _escalation(plan: RunPlan, trainer, balancer, dp_balancer) -> StepHook:
    layout = trainer.layout

    def speeds() -> tuple[float, ...] | None:
        replicas = dp_balancer.replica_speeds() if dp_balancer is not None else None
        groups = [balancer.group_speeds(d) for d in range(layout.dp_size)] if balancer is not None else None
        return rank_speeds(layout.tp_size, layout.dp_size, replicas, groups, layout.strided)

    home_tp = (plan.home_cfg or plan.cfg).parallel.tp
    memory = layout_memory(trainer.task.model, layout.tp_size, plan.cfg.train.precision)
    return EscalationController(
        plan.cfg, layout, trainer, plan.escalation_tps, home_tp, speeds, trainer.logger.print,
        memory, memory_cap_bytes(plan.cfg), MovePricer(trainer, trainer.logger.print),
    )  # fmt: skip


def _rank_coords(trainer) -> list:
    """Every rank's (dp, pp, tp) as the plan assumed (megatron-core's tp-cp-dp-pp order), checked against
    this rank's own place in megatron-core's groups (no collective: each rank checks itself)."""
    layout = trainer.layout
    coords = mesh_coords(layout.world_size, layout.tp_size, layout.pp_size, layout.strided, layout.cp_size)
    mine = (layout.dp_rank, layout.pp_rank, layout.tp_rank)
    if coords[layout.rank] != mine:
        raise RuntimeError(
            f"megatron-core placed rank {layout.rank} at (dp, pp, tp) {mine}, not {coords[layout.rank]}: its "
            "rank order is not tp-cp-dp-pp"
        )
    return coords


def build_step_hooks(
    plan: RunPlan, trainer, resplits: int = 0, extra_hooks: Sequence[StepHook] = ()
) -> list[StepHook]:
    """The Trainer's step hooks for `plan`, in order (see the module docstring); `resplits`: re-splits of
    this run so far. Applies the plan's starting shares and declared TP speeds."""
    cfg, layout, model = plan.cfg, trainer.layout, trainer.task.model
    h = cfg.hetero
    pipeline = h.pp_active and layout.pp_size > 1
    coords = _rank_coords(trainer) if (h.speeds or h.active or h.pp_active) else None
    pp_balancer = dp_balancer = balancer = resizer = device = packing = None
    if pipeline:
        pp_balancer = PipelineBalancer(
            cfg, layout, plan.split, trainer, coords, resplits, trainer.logger.print
        )
    if h.active:  # declared shares are measured and reported too, but never re-planned
        dp_balancer = DataParallelBalancer(cfg, layout, trainer, coords, packed=trainer.task.packed)
    if cfg.resize.active or cfg.balance.active:
        num_microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.dp_size)
        resizer = ResizeController(cfg, model, layout, num_microbatches, trainer.task.seq_length)
    if cfg.balance.active:
        balancer = BalanceController(cfg, layout, resizer, trainer)
    if cfg.device.profile:
        device = _virtual_device(plan, trainer)
    if trainer.task.packed:
        packing = PackingController(cfg, trainer, layout, trainer.task, trainer.logger)
    if cfg.balance.active or pipeline:  # the balancers read the transformer layers' own compute
        time_layers(model, trainer.clock)
    for hook in trainer.task.step_hooks:
        hook.ctx = trainer
    escalation = _escalation(plan, trainer, balancer, dp_balancer) if cfg.escalate.active else None
    ordered = [pp_balancer, dp_balancer, balancer, resizer, device, packing, escalation]
    hooks = [hook for hook in ordered if hook is not None] + [*trainer.task.step_hooks, *extra_hooks]
    trainer.step_hooks = hooks
    if plan.replica_speeds is not None:  # packed documents are planned by cost over speed every step
        trainer.set_replica_speeds(plan.replica_speeds)
    elif plan.shares is not None and plan.shares != trainer.shares:
        trainer.set_shares(plan.shares)  # every hook that counts micro-batches follows
    if balancer is not None and plan.speeds:
        balancer.start_from(plan.tp_group_speeds(layout.pp_rank))
    return hooks
