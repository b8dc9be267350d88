"""The pipeline split a run starts from (setup, before any rank starts work; megahet/run_plan.py).

Role: runtime setup of heterogeneous pipeline stages: it chooses the run's layers per stage from the
settings; the pure planner is megahet/policy/stage_split.py.

- `hetero.pp_split=declared`, or `measured` with `hetero.speeds` and no parallel.stage_layers: the split
  that minimizes the slowest stage's time at the declared speeds, counting the output layer on the last
  stage (`model_extra_layers`);
- `hetero.pp_split=measured` resuming a checkpoint of the same TP x PP: the checkpoint's split (the run
  goes on where its last re-split left it, rather than resharding back);
- otherwise parallel.stage_layers, or even.

    split = starting_split(cfg, speeds_by_coords, vocab_size=8192, resume=resume)   # StageSplit
"""

from __future__ import annotations

from collections.abc import Mapping

from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import stage_split
from megahet.policy.dp_shares import RankCoords
from megahet.policy.stage_split import (
    StageSplit,
    best_split,
    check_split,
    declared_stage_times,
    model_extra_layers,
    stage_speeds,
)


def declared_split(
    cfg: MegahetConfig, speeds: Mapping[RankCoords, float], vocab_size: int | None
) -> StageSplit:
    """Layers per stage from the declared speeds by rank coordinates (hetero.speeds, validated)."""
    m, p = cfg.model, cfg.parallel
    tp_balanced = cfg.balance.plans  # a TP balancer runs each stage's group at its mean speed
    per_stage = stage_speeds(speeds, p.pp, tp_balanced=tp_balanced)
    head = "lm" if vocab_size is not None else "cls"
    shape = {
        "heads": m.num_attention_heads,
        "query_groups": m.query_groups,
        "gated": m.activation == "swiglu",
    }
    extra = model_extra_layers(m.hidden_size, m.ffn_size, m.seq_length, vocab_size or 0, p.pp, head, **shape)
    layer_s, extra_s = declared_stage_times(per_stage, extra)
    return best_split(layer_s, extra_s, m.num_layers)


def starting_split(
    cfg: MegahetConfig, speeds: Mapping[RankCoords, float], vocab_size: int | None, resume=None
) -> StageSplit:
    """The layers per stage this run starts from (see the module docstring); cfg is validated."""
    h, p = cfg.hetero, cfg.parallel
    if not h.pp_active or p.pp < 2:
        return stage_split(cfg)
    if h.pp_split == "declared" and p.stage_layers:
        raise ConfigError(
            "hetero.pp_split=declared computes the layers per stage from hetero.speeds, and parallel.stage_layers "
            "gives them too: drop one (hetero.pp_split=measured starts from parallel.stage_layers)"
        )
    if h.pp_split == "measured" and resume is not None and not resume.meta.get("weights_only"):
        saved = resume.meta["layout"]
        if (saved["tp"], saved["pp"]) == (p.tp, p.pp) and "stage_layers" in saved:
            split = StageSplit(saved["stage_layers"])
            check_split(split, cfg.model.num_layers, p.pp)  # the same model (check_model): always holds
            return split
    if speeds and not p.stage_layers:
        try:
            return declared_split(cfg, speeds, vocab_size)
        except ValueError as err:
            raise ConfigError(f"hetero.speeds: {err}") from None
    return stage_split(cfg)
