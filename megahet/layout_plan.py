"""The layout planner on a run's configuration: the plans for a described cluster, checked by megahet's own
validation, as a table and as configurations (tools/plan.py; `--plan auto` in megahet/run_plan.py).

Role: setup (glue between the configuration and the pure planner, megahet/policy/layout_search.py).

    cluster = read_plan_cluster(cfg)
    plans = plan_layouts(cfg, cluster, vocab_size=spec.vocab_size(cfg))
    print(plan_table(plans))
    cfg = with_plan(cfg, plans[0])          # the fastest plan's settings on top of the run's

Only GPT models are planned (the cost model counts a causal language model's layers and output layer).
"""

from __future__ import annotations

import json
from pathlib import Path

from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.config_checks import ranks_per_node, validate
from megahet.policy.calibration import Calibration, Profile, fit_calibration
from megahet.policy.cluster import Cluster, read_cluster
from megahet.policy.layout_cost import ModelShape
from megahet.policy.layout_search import Plan, TrainSetting, pareto, search

PROFILE_START_STEPS = 2
"""A profile's first steps (start-up: allocation, first-touch) that the calibration leaves out."""


def read_calibration(cfg: MegahetConfig, cluster: Cluster, vocab_size: int) -> Calibration | None:
    """The calibration plan.profile measures (None without one): one profiling run's trace, or several
    (comma-separated, one layout, a micro-batch size each: the efficiency per size). One-line ConfigErrors
    for a missing or unreadable file, profiles of other layouts and a profile_node the cluster lacks."""
    p = cfg.plan
    if not p.profile:
        return None
    if not 0 <= p.profile_node < len(cluster.nodes):
        raise ConfigError(
            f"plan.profile_node {p.profile_node} is not a node of plan.cluster (0..{len(cluster.nodes) - 1})"
        )
    profiles = [_read_profile(cfg, name.strip()) for name in p.profile.split(",")]
    node = cluster.nodes[p.profile_node]
    try:
        return fit_calibration(
            profiles, ModelShape.of(cfg.model, vocab_size, 1), reference_tflops=node.tflops,
            precision=cfg.train.precision, link_gbps=node.intra_gbps,
        )  # fmt: skip
    except ValueError as err:
        raise ConfigError(f"plan.profile {p.profile}: {err}") from None


def _read_profile(cfg: MegahetConfig, name: str) -> Profile:
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"plan.profile {name} not found: pass the --balance.trace file of a profiling run (docs/planning.md)"
        )
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return Profile.from_trace_rows(
            rows, cfg.model.num_layers, cfg.train.global_batch_size, skip=PROFILE_START_STEPS
        )
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ConfigError(f"plan.profile {name}: not a profiling run's trace ({err})") from None


def train_setting(cfg: MegahetConfig, calibration: Calibration | None = None) -> TrainSetting:
    p = cfg.plan
    try:
        micro_batches = tuple(int(x) for x in p.micro_batches.split(","))
    except ValueError:
        raise ConfigError(
            f"plan.micro_batches must be sizes such as 1,2,4, got {p.micro_batches!r}"
        ) from None
    if min(micro_batches) < 1:
        raise ConfigError(f"plan.micro_batches must be sizes >= 1, got {p.micro_batches!r}")
    if not 0 <= p.memory_reserve < 1 or not 0 < p.efficiency <= 1:
        raise ConfigError("plan.memory_reserve must be in [0, 1) and plan.efficiency in (0, 1]")
    return TrainSetting(
        global_batch=cfg.train.global_batch_size, micro_batches=micro_batches, precision=cfg.train.precision,
        memory_reserve=p.memory_reserve, efficiency=p.efficiency, calibration=calibration,
    )  # fmt: skip


def with_plan(cfg: MegahetConfig, plan: Plan) -> MegahetConfig:
    """A copy of `cfg` with the plan's settings: layout, micro-batch size, ZeRO stage, layers per stage
    (parallel.stage_layers) and DP shares (hetero.speeds, declared). Shares or a split the run re-plans
    from measurements (`measured`) start from the plan's."""
    planned = apply_overrides(_copy(cfg), plan.overrides())
    h, asked = planned.hetero, cfg.hetero
    if not plan.split.uneven:
        planned.parallel.stage_layers = None
    if plan.shares.even:
        h.speeds = None
    h.dp_shares = (
        "measured" if asked.dp_shares == "measured" else ("even" if plan.shares.even else "declared")
    )
    h.pp_split = "measured" if asked.pp_split == "measured" else "even"
    return planned


def _copy(cfg: MegahetConfig) -> MegahetConfig:
    return apply_overrides(MegahetConfig(), _flat(cfg))


def _flat(cfg: MegahetConfig) -> dict[str, object]:
    return {
        f"{name}.{key}": value for name, section in cfg.to_dict().items() for key, value in section.items()
    }


def read_plan_cluster(cfg: MegahetConfig, missing: str = "plan: pass the cluster description") -> Cluster:
    """The cluster plan.cluster describes; a one-line ConfigError (starting with `missing` when no file
    is given) for a missing or bad file."""
    if not cfg.plan.cluster:
        raise ConfigError(f"{missing}: pass --cluster cluster.yaml (docs/planning.md)")
    try:
        return read_cluster(cfg.plan.cluster, cfg.train.precision)
    except ValueError as err:
        raise ConfigError(f"plan.cluster: {err}") from None


def plan_layouts(
    cfg: MegahetConfig,
    cluster: Cluster,
    vocab_size: int,
    launched: bool = False,
    calibration: Calibration | None = None,
) -> list[Plan]:
    """Every plan for `cluster` that fits and that megahet's validation accepts, fastest first.
    `launched`: the job already runs on the cluster in its file's order, so only that order is tried;
    `calibration`: in place of plan.profile's."""
    if vocab_size is None:
        raise ConfigError("plan.mode=auto plans GPT models (pretrain_gpt.py): leave it off for this task")
    setting = train_setting(cfg, calibration or read_calibration(cfg, cluster, vocab_size))

    def fits(plan: Plan) -> bool:
        try:
            validate(with_plan(cfg, plan), cluster.world_size)
        except ConfigError:
            return False
        return True

    orders = [tuple(range(len(cluster.nodes)))] if launched else None
    return search(cluster, lambda tp: ModelShape.of(cfg.model, vocab_size, tp), setting, fits, orders)


def plan_table(plans: list[Plan], top: int = 10) -> str:
    """The fastest `top` plans and the Pareto set (memory against time), one line each; the memory columns
    are the fullest GPU's (its predicted GiB, its fraction of what it may use, and which GPU it is)."""
    front = {id(p) for p in pareto(plans)}
    shown = plans[:top] + [p for p in plans[top:] if id(p) in front]
    width = max([34, *(len(p.layout) for p in shown)])
    lines = [
        (
            f"{'#':>3}  {'layout':<{width}} {'micro':>5} {'ZeRO':>4}  {'step s':>9} {'vs best':>7} "
            f"{'peak GiB':>8} {'of GPU':>6}  pareto  launch order  fullest GPU"
        )
    ]
    best = plans[0].step_s if plans else 0.0
    for plan in shown:
        lines.append(
            f"{plans.index(plan) + 1:>3}  {plan.layout:<{width}} {plan.micro_batch:>5} {plan.zero_stage:>4}  "
            f"{plan.step_s:>9.4g} {plan.step_s / best:>6.2f}x {plan.peak_gib:>8.2f} "
            f"{plan.memory_fraction:>6.0%}  {'*' if id(plan) in front else ' ':^6}  "
            f"{','.join(map(str, plan.node_order)):<12}  {plan.fullest}"
        )
    return "\n".join(lines)


def plan_overrides_yaml(cfg: MegahetConfig, plan: Plan) -> dict[str, dict[str, object]]:
    """The run's own settings (those that differ from the defaults) with the plan's on top, as the
    sections of a `--config` YAML file."""
    defaults, planned = _flat(MegahetConfig()), _flat(with_plan(cfg, plan))
    sections: dict[str, dict[str, object]] = {}
    for dotted, value in planned.items():
        if dotted.startswith("plan.") or value == defaults[dotted]:
            continue
        section, key = dotted.split(".", 1)
        sections.setdefault(section, {})[key] = value
    return sections


def plan_for_launch(cfg: MegahetConfig, vocab_size: int | None, world_size: int) -> tuple[MegahetConfig, str]:
    """`--plan auto`: the fastest plan for plan.cluster with its nodes in their launch order, applied to
    `cfg`, and the line rank 0 prints about it. One-line ConfigErrors for a missing or bad cluster file, a
    cluster that is not the job's, and a model that fits no layout."""
    p = cfg.plan
    cluster = read_plan_cluster(cfg, "plan.mode=auto needs plan.cluster")
    per_node = ranks_per_node(world_size)
    if (cluster.world_size, cluster.gpus_per_node) != (world_size, per_node):
        raise ConfigError(
            f"plan.cluster {p.cluster} describes {len(cluster.nodes)} nodes x {cluster.gpus_per_node} GPUs, this job "
            f"runs {world_size} ranks, {per_node} per node: launch one rank per GPU it lists, or describe the nodes "
            f"the job runs on"
        )
    plans = plan_layouts(cfg, cluster, vocab_size, launched=True)
    if not plans:
        raise ConfigError(
            f"plan.cluster: no layout of this model fits {p.cluster}'s GPUs (memory, or the configuration's "
            f"checks): use more or larger GPUs, smaller micro-batches (plan.micro_batches) or a smaller model"
        )
    best = plans[0]
    note = (
        f"plan auto: {best.layout}, micro-batch {best.micro_batch}, ZeRO-{best.zero_stage}, DP shares "
        f"{best.shares}; predicted {best.step_s:.3g} s per step, {best.peak_gib:.2f} GiB on the fullest GPU "
        f"({best.memory_fraction:.0%} of what it may use); {len(plans)} plans fit (tools/plan.py lists them)"
    )
    return with_plan(cfg, best), note
