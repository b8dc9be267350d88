"""Declared device speeds (`--hetero.speeds`): a per-rank or per-node declaration in, one relative speed
per global rank out. Pure.

Role: policy (input: what a user declares about a mixed cluster; the data-parallel shares and the TP plan
start from it, as HAP and Cephalo plan statically).

    parse_declared_speeds("1,1,0.5,0.5", world_size=4, ranks_per_node=2)   # [1.0, 1.0, 0.5, 0.5]
    parse_declared_speeds("cluster.yaml", world_size=16, ranks_per_node=8)  # a file, e.g.
        # nodes: {0: 1.0, 1: 0.45}       an A100 node and a V100 node; node i = ranks 8i..8i+7
        # ranks: {5: 0.5}                or single ranks (a list gives every rank); unnamed ones are 1

Every error is one line naming the problem and the fix (config_checks.py turns it into a ConfigError).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

FILE_SUFFIXES = (".yaml", ".yml", ".json")


def parse_declared_speeds(spec: str, world_size: int, ranks_per_node: int) -> list[float]:
    """One speed per global rank (relative: only ratios matter) from an inline list or a file."""
    if Path(spec).suffix in FILE_SUFFIXES:
        return _from_mapping(_read(spec), spec, world_size, ranks_per_node)
    try:
        speeds = [float(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"{spec!r} is neither a comma-separated list of speeds nor a .yaml/.json file"
        ) from None
    if len(speeds) != world_size:
        raise ValueError(
            f"{len(speeds)} speeds declared for a world of {world_size} ranks: give one per global rank "
            f"(or a file with nodes: {{NODE: SPEED}})"
        )
    return _checked(speeds)


def _read(spec: str) -> Any:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"file {spec} not found: pass an existing YAML/JSON file or an inline list")
    try:
        return (json.loads if path.suffix == ".json" else yaml.safe_load)(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError):
        raise ValueError(f"file {spec} is not valid {path.suffix[1:].upper()}: fix its syntax") from None


def _from_mapping(data: Any, spec: str, world_size: int, ranks_per_node: int) -> list[float]:
    if not isinstance(data, dict) or len(set(data) & {"ranks", "nodes"}) != 1 or len(data) != 1:
        raise ValueError(f"file {spec} must hold exactly one of `ranks:` or `nodes:`")
    ((kind, entries),) = data.items()
    if kind == "ranks" and isinstance(entries, list):
        return parse_declared_speeds(",".join(str(x) for x in entries), world_size, ranks_per_node)
    if not isinstance(entries, dict):
        raise ValueError(f"file {spec}: `{kind}:` must map {kind[:-1]} numbers to speeds")  # noqa: TRY004 (a config value)
    if kind == "nodes" and world_size % ranks_per_node:
        raise ValueError(
            f"a world of {world_size} ranks is not whole nodes of {ranks_per_node}: declare ranks:"
        )
    count = world_size if kind == "ranks" else world_size // ranks_per_node
    per_entry = [1.0] * count
    for key, speed in entries.items():
        if not isinstance(key, int) or not 0 <= key < count:
            raise ValueError(f"file {spec} names {kind[:-1]} {key!r}, but there are {kind} 0..{count - 1}")
        per_entry[key] = speed
    per_entry = _checked(per_entry)
    if kind == "ranks":
        return per_entry
    return [per_entry[rank // ranks_per_node] for rank in range(world_size)]


def _checked(speeds: list) -> list[float]:
    try:
        speeds = [float(s) for s in speeds]
    except (TypeError, ValueError):
        raise ValueError(f"speeds must be numbers, got {speeds}") from None
    bad = [s for s in speeds if not (s > 0 and math.isfinite(s))]
    if bad:
        raise ValueError(
            f"speeds must be positive and finite, got {bad[0]}: declare a slow device as e.g. 0.5"
        )
    return speeds
