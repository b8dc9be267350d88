"""The balancer in the training loop: measure -> estimate speeds -> plan -> apply, between steps.

Role: runtime (the balancer's step hook: measure, estimate, plan, hand the plan to the ResizeController).

After every step each rank contributes two numbers — the work its resizable blocks executed (forward
+ backward FLOPs) and its own compute time in its transformer layers (their forward and backward
minus the time it was blocked in collectives, megahet/runtime/timing.py: a fast rank's waits for its slow
peers are not its compute; the embedding, output layer and loss, which no plan moves, are left out
so that a rank doing fewer units does not look slower per unit) — gathered over its pipeline stage's
TP x DP ranks by an asynchronous all-gather that completes while the step finishes. A virtual device
is measured the same way: it only slows its rank down, and the balancer never reads its profile or
charge. At the start of the next step every rank feeds the
same `AffineSpeedEstimator`s (one per DP replica's TP group: each rank's layer time as fixed work plus
work per unit, so that a rank that gave units away does not look slower per unit; megahet/policy/detector.py)
with them and, every `balance.interval` steps,
runs the same pure planner (`megahet.policy.planner.balance`: static, resize, migrate or semi, with
hysteresis and a return to the even split when the group is healthy), so the resulting plan is
identical everywhere. The ResizeController turns the targets into units at the next step.

Every TP group of every pipeline stage balances itself (blocks and speeds are stage-local). With context
parallelism the CP ranks of a TP group's position run one plan: they exchange the keys and values of the
same heads every layer, so a head kept, dropped or migrated on one must be so on all. The gather then spans
the stage's TP x DP x CP ranks, and each TP rank of a replica is measured at its slowest CP rank.

Telemetry (`report()`, logged by the logging rank for its stage's first DP replica): per TP rank the
estimated speed (`speed_tpR`), dropped fraction (`gamma_tpR`) and migrated units (`moved_tpR`:
fraction of its own units a helper computes, minus the guests it computes; < 0 for a helper), and
`balance_eff`, the compute efficiency of the interval: the time the executed work would take split in
proportion to the measured speeds, over the slowest rank's compute time (1 = perfectly balanced).
`balance.trace` writes all of it per step and per rank to JSONL, drawn as a PNG at the end.

`balance.replay TRACE` executes a recorded trace's targets (each row carries the targets its step ran)
step by step instead of planning: unit selection is seeded by the step, so the same command and seed
repeat a lossy run's plans, and its losses, exactly. It still measures, and writes its own trace.

Checkpoints carry the balancer's state (`state_dict`): the speed samples of every estimator, the
targets, the change count, the efficiency window and whether a plan is due, so a resumed run plans
exactly as the uninterrupted one would from the same measurements; its trace continues the saved
run's (rows after the checkpoint's step, from a run that was killed later, are dropped).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout
from megahet.policy.detector import AffineSpeedEstimator, MedianWindow, units_of_work
from megahet.policy.planner import WorkTarget, balance, ideal_shares, step_times
from megahet.runtime.hooks import MeasuringHook, StepContext
from megahet.runtime.trace_plot import read_trace
from megahet.runtime.trace_writer import TraceWriter, trace_path


def compute_efficiency(
    work: list[float], busy: list[float], fixed: list[float] | None = None, phi: list[float] | None = None
) -> float:
    """The ideal step of the executed work over the slowest rank's step: the ideal splits the movable work
    by each rank's measured speed so that the whole steps (movable plus `fixed` seconds) end together;
    without `fixed`, the movable compute alone. With `phi` (each rank's fixed layer work in units of U,
    `work` then in units of U: the affine model of megahet/policy/detector.py) rank i's busy time is
    c_i (phi_i + work_i), its speed 1 / c_i, and phi_i c_i seconds of it stay with it whatever the split;
    without, its speed is work_i / busy_i."""
    if min(busy) <= 0 or min(work) <= 0:
        return float("nan")
    fixed = fixed or [0.0] * len(work)
    unit = sum(work) / len(work)  # ideal_shares' U: the executed work split N ways
    phi = [p / unit for p in phi] if phi else [0.0] * len(work)
    speeds = [(p + w / unit) / t for p, w, t in zip(phi, work, busy)]  # U per second
    whole = [f + p / s for f, p, s in zip(fixed, phi, speeds)]  # seconds no split moves
    ideal = max(step_times(ideal_shares(speeds, whole), speeds, whole))
    return ideal / max(t + f for t, f in zip(busy, fixed))


def _stage_tag(stage: int | None) -> str | None:
    """A pipeline stage's trace tag (stage1: run_stage1.jsonl), None without pipeline stages."""
    return None if stage is None else f"stage{stage}"


def recorded_targets(path: str, stage: int | None) -> dict[int, list[WorkTarget]]:
    """The TP targets each step of a --balance.trace run executed, [dp] per step, from its trace (the
    stage's own file when `stage` is given); ValueError naming the problem when it has none."""
    file = trace_path(path, _stage_tag(stage))
    rows = read_trace(file)
    if any("targets" not in row for row in rows):
        raise ValueError(
            f"{file} records no plans (written before balance.replay existed): record the run again"
        )

    def target(saved: dict) -> WorkTarget:  # JSON keys are strings
        gamma = {int(r): g for r, g in saved["gamma"].items()}
        moves = {int(o): {int(h): f for h, f in helpers.items()} for o, helpers in saved["moves"].items()}
        return WorkTarget(gamma=gamma, moves=moves)

    return {row["step"]: [target(t) for t in row["targets"]] for row in rows}


class BalanceController(MeasuringHook):
    checkpointed = True
    split_free = True  # per-rank speeds and work fractions: a re-split keeps them (carry)
    settings_free = ("trace",)
    """Settings a resumed run may change and keep this state (checkpoint.py compares the rest)."""

    def __init__(
        self,
        cfg: MegahetConfig,
        layout: ParallelLayout,
        resize,
        ctx: StepContext,
    ):
        self.cfg, self.layout, self.resize = cfg.balance, layout, resize
        self.ctx = ctx
        """The running step: `ctx.times` is the step just done as the Trainer measured it
        (megahet/runtime/timing.py). The balancer plans on `layers_s`, this rank's own compute inside its
        transformer layers (their time minus the time blocked in collectives); the trace also records
        `compute_s` and `wait_s`. `ctx.step_t0`: when the current step began, so plan changes and
        transfers count."""
        self.estimators = [
            AffineSpeedEstimator(layout.tp_size, cfg.balance.window) for _ in range(layout.dp_size)
        ]
        """Per TP group, each rank's layer time as fixed + per unit (megahet/policy/detector.py)."""
        self.fixed = [MedianWindow(layout.tp_size, cfg.balance.window) for _ in range(layout.dp_size)]
        """Per TP group, each rank's fixed work (`StepTimes.fixed_s`) in units of the time the group's
        fastest rank takes for U units, smoothed as the speeds are (`balance.whole_step`)."""
        self.targets = [WorkTarget() for _ in range(layout.dp_size)]
        self.changes = 0
        self.warm = False
        """Whether this process has measured a step (its first is a warm-up, not a sample)."""
        self._flops0 = 0.0
        self._efficiency: list[float] = []
        self._due = False
        self.step = -1
        self._plan_fractions: tuple = (None, [])
        """(the executed plan, its unit fractions per DP replica): the trace's, computed once per plan."""
        self.trace = None
        """This stage's trace (its first TP rank of DP replica 0 writes it), if one is asked for."""
        stage = layout.pp_rank if layout.pp_size > 1 else None
        if cfg.balance.trace and layout.tp_rank == 0 and layout.dp_rank == 0 and layout.cp_rank == 0:
            self.trace = TraceWriter(trace_path(cfg.balance.trace, _stage_tag(stage)))
        self.replayed = recorded_targets(cfg.balance.replay, stage) if cfg.balance.replay else None
        """balance.replay: the recorded run's targets by step (executed instead of planned ones)."""

    def before_forward_backward(self, step: int) -> None:
        """Fold the last step's gathered measurements in, plan if due, then start measuring this step.

        Runs before the ResizeController's hook (setup() puts the balancer first), so a new plan is
        executed from this step on: the same step as planning right after the gather would give."""
        self._collect()
        if self.replayed is not None:
            self._due = False
            self._replay(step)
        elif self._due:
            self._due = False
            self._plan()
        self.step = step
        self._flops0 = self.resize.executor.executed_flops()

    def after_step(self, engine) -> None:
        """Measure this step and start gathering it over the stage's TP x DP (x CP) ranks (asynchronously: the
        few numbers travel while the step finishes; `_collect` waits for them)."""
        work = 3.0 * (self.resize.executor.executed_flops() - self._flops0)  # forward + 2x backward
        t = self.ctx.times
        where, times = [self.layout.dp_rank, self.layout.tp_rank], [t.layers_s, t.compute_s, t.wait_s]
        mine = torch.tensor([*where, work, *times, t.fixed_s, t.optimizer_s], dtype=torch.float64)
        self._gather(mine, ps.get_tensor_and_data_parallel_group(with_context_parallel=True))

    def _collect(self) -> None:
        """Wait for the pending gather; feed the estimators, the efficiency and the trace with it."""
        gathered = self._take()
        if gathered is None:
            return
        rows, step, step_s = gathered
        table = {}  # (dp, tp) -> its row; with CP, the slowest CP rank's (its layers' own compute)
        for r in rows:
            key = (int(r[0]), int(r[1]))
            if key not in table or r[3] > table[key][1]:
                table[key] = r[2:]
        tp, dp = range(self.layout.tp_size), range(self.layout.dp_size)
        # [field][dp][tp]: work, layers' own compute, all own compute, collective waits, fixed work, and
        # the optimizer step's part of it
        works, busys, computes, waits, fixeds, optimizers = (
            [[table[(d, t)][i] for t in tp] for d in dp] for i in range(6)
        )
        units = [units_of_work(work, t.work(self.layout.tp_size)) for work, t in zip(works, self.targets)]
        for d, (u, busy, fixed) in enumerate(zip(units, busys, fixeds)):
            if self.warm:  # a process's first step (lazy initialization, first collectives) is no sample
                self.estimators[d].update(u, busy)
                self.fixed[d].update(self._fixed_in_units(d, u, busy, fixed))
        self.warm = True
        whole = self.cfg.whole_step
        efficiency = [
            compute_efficiency(u, b, f if whole else None, e.phis())
            for u, b, f, e in zip(units, busys, fixeds, self.estimators)
        ]
        self._efficiency.append(efficiency[self.layout.dp_rank])
        if self.trace is not None:
            self._write_trace(
                step, step_s, works, busys, efficiency, computes, waits, fixeds, optimizers, units
            )
        self._due = (
            self.cfg.plans  # static mode only measures: its targets stay the even split
            and (step + 1) % self.cfg.interval == 0
            and all(e.ready for e in self.estimators)
        )

    def _fixed_in_units(
        self, dp: int, units: list[float], busy: list[float], fixed_s: list[float]
    ) -> list[float]:
        """Each rank's fixed seconds outside the layers in units of the time the group's fastest rank took
        for U units in the same step (its layer time over its fixed layer work plus its units)."""
        phis = self.estimators[dp].phis()
        per_second = [(p + u) / b for p, u, b in zip(phis, units, busy) if u > 0 and b > 0]
        if not per_second:
            return [-1.0] * len(busy)  # nothing measured: no sample
        fastest = max(per_second)
        return [f * fastest for f in fixed_s]

    def _targets(self, speeds: list[list[float]], fixed: list[list[float]] | None = None) -> list[WorkTarget]:
        """The pure planner on [dp][tp] relative speeds (and fixed work), from the current targets (the
        same on every rank)."""
        b = self.cfg
        knobs = {"tolerance": b.tolerance, "healthy_gap": b.healthy_gap, "hysteresis_threshold": b.hysteresis}
        fixed = fixed or [None] * len(speeds)
        return [
            balance(group, b.mode, current, fixed=f, **knobs)
            for group, current, f in zip(speeds, self.targets, fixed)
        ]

    def fixed_work(self) -> list[list[float]]:
        """[dp][tp] fixed work in units of U at the group's fastest speed: the fixed layer work of the affine
        model, plus, with `balance.whole_step`, the work outside the layers (once measured)."""
        layers = [e.fixed() for e in self.estimators]
        if not self.cfg.whole_step or not all(f.ready for f in self.fixed):
            return layers
        return [[a + b for a, b in zip(x, f.medians())] for x, f in zip(layers, self.fixed)]

    def _plan(self) -> None:
        """Plan on the estimated speeds and fixed work; hand changed targets to the ResizeController."""
        new = self._targets([e.unit_speeds() for e in self.estimators], self.fixed_work())
        if new != self.targets:
            self.targets = new
            self.changes += 1
            self.resize.set_targets(new)

    def _replay(self, step: int) -> None:
        """The recorded run's targets of this step, if it recorded the step and they changed."""
        new = self.replayed.get(step)
        if new is not None and new != self.targets:
            self.targets = new
            self.changes += 1
            self.resize.set_targets(new)

    def start_from(self, speeds: list[list[float]]) -> None:
        """Plan from declared speeds (hetero.speeds), [dp][tp] of this stage, before any measurement: a
        mixed cluster is balanced from the first step; the measured speeds take over when they are ready."""
        self.targets = self._targets([[s / max(group) for s in group] for group in speeds])
        self.resize.set_targets(self.targets)

    def state_dict(self) -> dict:
        """What the next decisions depend on (the last step's gather folded in first)."""
        self._collect()
        return {
            "step": self.step,
            "samples": [e.state_dict() for e in self.estimators],
            "fixed_samples": [[list(s) for s in f.samples] for f in self.fixed],
            "targets": [dataclasses.asdict(t) for t in self.targets],
            "changes": self.changes,
            "efficiency": list(self._efficiency),
            "due": self._due,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore it; the ResizeController restores the executed plan itself."""
        fixed = state.get("fixed_samples") or [
            [[] for _ in f.samples] for f in self.fixed
        ]  # older checkpoints
        for estimator, saved in zip(self.estimators, state["samples"], strict=True):
            estimator.load_state_dict(saved)
        for window, saved in zip(self.fixed, fixed):
            for samples, values in zip(window.samples, saved, strict=True):
                samples.clear()
                samples.extend(values)
        self.targets = [WorkTarget(**t) for t in state["targets"]]
        self.resize.set_targets(self.targets, replan=False)  # it restores the executed plan itself
        self.changes, self._efficiency, self._due = state["changes"], list(state["efficiency"]), state["due"]
        self.step = state["step"]
        if self.trace is not None:
            self.trace.resume_from = self.step + 1

    def carry(self, state: dict) -> None:
        """A re-split rebuilt the stage: its new blocks get the carried work fractions at the next step."""
        self.load_state_dict(state)
        self.resize.set_targets(self.targets)

    def group_speeds(self, dp: int) -> list[float] | None:
        """Replica `dp`'s TP ranks' estimated speeds (the fastest = 1), None before the estimator is ready."""
        return self._speeds(dp)

    def _speeds(self, dp: int) -> list[float] | None:
        estimator = self.estimators[dp]
        return estimator.speeds() if estimator.ready else None

    def _fractions(self) -> list[dict[str, list[float]]]:
        """Per DP replica, the executed plan's dropped / sent / hosted fractions per TP rank (once per plan)."""
        plan = self.resize.executor.plan
        if self._plan_fractions[0] is not plan:
            dps = range(self.layout.dp_size)
            self._plan_fractions = (
                plan,
                [plan.unit_fractions(self.resize.units, dp, self.layout.tp_size) for dp in dps],
            )
        return self._plan_fractions[1]

    def _write_trace(
        self, step, step_s, works, busys, efficiency, computes, waits, fixeds, optimizers, units
    ) -> None:
        """One JSON line per step: the executed plan and the measurements, indexed [dp][tp]."""
        dps = range(self.layout.dp_size)
        fractions = self._fractions()
        row = {
            "step": step,
            "step_s": step_s,
            "microbatches": list(self.ctx.shares),
            "efficiency": efficiency,
            "busy_s": busys,
            "compute_s": computes,
            "wait_s": waits,
            "fixed_s": fixeds,
            "optimizer_s": optimizers,
            "work_gflop": [[w / 1e9 for w in ws] for ws in works],
            "speed": [self._speeds(dp) for dp in dps],
            "units": units,
            "phi": [e.phis() for e in self.estimators],
            "targets": [
                vars(t) for t in self.targets
            ],  # WorkTarget's fields (asdict's deep copy: 10x slower)
            **{k: [f[k] for f in fractions] for k in ("dropped", "sent", "hosted")},
        }
        self.trace.write(row)

    def metrics(self) -> dict[str, float]:
        self._collect()
        estimator = self.estimators[self.layout.dp_rank]
        speed = estimator.speeds()[self.layout.tp_rank] if estimator.ready else 1.0
        return {"est_speed": speed, "plan_changes": float(self.changes)}

    def report(self) -> dict[str, float]:
        """Per TP rank of this rank's TP group: speed, dropped fraction, migrated units; and the
        interval's compute efficiency. No communication: every rank of the group knows it all."""
        self._collect()
        dp = self.layout.dp_rank
        speeds = self._speeds(dp) or [1.0] * self.layout.tp_size
        fractions = self._fractions()[dp]
        out = {}
        for name, values in (
            ("speed", speeds),
            ("gamma", fractions["dropped"]),
            ("moved", [s - h for s, h in zip(fractions["sent"], fractions["hosted"])]),
        ):
            out.update({f"{name}_tp{r}": v for r, v in enumerate(values)})
        finite = [e for e in self._efficiency if not math.isnan(e)]
        out["balance_eff"] = sum(finite) / len(finite) if finite else float("nan")
        self._efficiency = []
        return out

    def _plot(self, written: Path) -> None:
        """tools/plot_balance.py draws it again."""
        from megahet.runtime.trace_plot import plot_trace  # lazy: matplotlib, only when a trace is drawn

        plot_trace(written, written.with_suffix(".png"))
