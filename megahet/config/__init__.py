"""One configuration system for every megahet entry point: dataclasses, a YAML file, CLI overrides.

Role: configuration (the settings, as data).

    cfg = load_config(["--config", "examples/cpu/gpt_tp2_pp2.yaml", "--train.lr", "3e-4"])

Sections are `model`, `parallel`, `train`, `data`, `logging`, `resize`, `device`, `balance`,
`hetero`, `plan` and `escalate` (megahet/config/sections.py); a key is overridden on the command line as
`--section.key value` (or `--section.key=value`, megahet/config/loading.py).
DeepSpeed users' habits also work:
`--deepspeed_config ds.json` (or `--deepspeed ds.json`) merges a ds_config over the one megahet
builds, and the launchers' `--local_rank` is accepted. Unknown keys, bad types and inconsistent
values are one-line `ConfigError`s raised before any rank starts work (the whole-config checks are
in megahet/config_checks.py).
"""

from megahet.config.loading import (
    HelpRequested,
    apply_overrides,
    config_help,
    load_config,
    load_deepspeed_json,
)
from megahet.config.sections import (
    SECTIONS,
    BalanceConfig,
    ConfigError,
    DataConfig,
    DeviceConfig,
    EscalateConfig,
    HeteroConfig,
    LoggingConfig,
    MegahetConfig,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    ResizeConfig,
    TrainConfig,
)

__all__ = [
    "SECTIONS",
    "BalanceConfig",
    "ConfigError",
    "DataConfig",
    "DeviceConfig",
    "EscalateConfig",
    "HelpRequested",
    "HeteroConfig",
    "LoggingConfig",
    "MegahetConfig",
    "ModelConfig",
    "ParallelConfig",
    "PlanConfig",
    "ResizeConfig",
    "TrainConfig",
    "apply_overrides",
    "config_help",
    "load_config",
    "load_deepspeed_json",
]
