"""The pipeline split a run starts from (runtime setup, before any rank starts work).

Role: runtime (setup of heterogeneous pipeline stages: it resolves parallel.stage_layers from the
settings; the pure planner is megahet/policy/stage_split.py).

- `hetero.pp_split=declared`, or `measured` with `hetero.speeds` and no parallel.stage_layers: the split
  that minimizes the slowest stage's time at the declared speeds, counting the output layer on the last
  stage (`model_extra_layers`), is written into cfg.parallel.stage_layers;
- `hetero.pp_split=measured` resuming a checkpoint of the same TP x PP: the checkpoint's split (the run
  goes on where its last re-split left it, rather than resharding back);
- otherwise cfg is returned as it is (parallel.stage_layers, or even).

    cfg = start_split(cfg, world_size, vocab_size=8192, resume=resume)
"""

from __future__ import annotations

import dataclasses

from megahet.config import ConfigError, MegahetConfig
from megahet.parallel import mesh_coords
from megahet.policy.stage_split import (
    best_split,
    declared_stage_times,
    format_split,
    model_extra_layers,
    stage_speeds,
)


def _with_split(cfg: MegahetConfig, split) -> MegahetConfig:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=format_split(split))
    )


def declared_split(cfg: MegahetConfig, world_size: int, vocab_size: int | None) -> tuple[int, ...]:
    """Layers per stage from hetero.speeds (validated before: config_checks)."""
    from megahet.config_checks import ranks_per_node
    from megahet.policy.declared_speeds import parse_declared_speeds

    m, p = cfg.model, cfg.parallel
    speeds = parse_declared_speeds(cfg.hetero.speeds, world_size, ranks_per_node(world_size))
    coords = mesh_coords(world_size, p.tp, p.pp)
    tp_balanced = cfg.balance.plans  # a TP balancer runs each stage's group at its mean speed
    per_stage = stage_speeds(dict(zip(coords, speeds)), p.pp, tp_balanced=tp_balanced)
    head = "lm" if vocab_size is not None else "cls"
    shape = {
        "heads": m.num_attention_heads,
        "query_groups": m.query_groups,
        "gated": m.activation == "swiglu",
    }
    extra = model_extra_layers(m.hidden_size, m.ffn_size, m.seq_length, vocab_size or 0, p.pp, head, **shape)
    layer_s, extra_s = declared_stage_times(per_stage, extra)
    return best_split(layer_s, extra_s, m.num_layers)


def start_split(cfg: MegahetConfig, world_size: int, vocab_size: int | None, resume=None) -> MegahetConfig:
    """cfg (validated: config_checks.validate) with the split this run starts from in
    parallel.stage_layers (see the module docstring)."""
    h, p = cfg.hetero, cfg.parallel
    if not h.pp_active or p.pp < 2:
        return cfg
    if h.pp_split == "declared" and p.stage_layers:
        raise ConfigError(
            "hetero.pp_split=declared computes the layers per stage from hetero.speeds, and parallel.stage_layers "
            "gives them too: drop one (hetero.pp_split=measured starts from parallel.stage_layers)"
        )
    if h.pp_split == "measured" and resume is not None and not resume.meta.get("weights_only"):
        saved = resume.meta["layout"]
        if (saved["tp"], saved["pp"]) == (p.tp, p.pp) and "stage_layers" in saved:
            return _with_split(cfg, saved["stage_layers"])
    if h.speeds and not p.stage_layers:
        try:
            return _with_split(cfg, declared_split(cfg, world_size, vocab_size))
        except ValueError as err:
            raise ConfigError(f"hetero.speeds: {err}") from None
    return cfg
