"""Build a MegahetConfig from the defaults, a YAML file and `--section.key value` overrides; print
every key with `--help`; read a DeepSpeed JSON.

Role: configuration (parsing: one-line ConfigErrors name the key and the fix).

    cfg = load_config(["--config", "examples/cpu/gpt_tp2_pp2.yaml", "--train.lr", "3e-4"])
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megahet.config.sections import SECTIONS, ConfigError, MegahetConfig


def _section_fields(section: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert a YAML or CLI value to the field's declared type (resolved by `typing.get_type_hints`), or
    raise a ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if hint is int and isinstance(value, (str, float)):
            number = float(value)  # '1e6' (how rope bases are written) is a whole number too
            if not number.is_integer():
                raise ValueError
            return int(number)
        return hint(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} expects {hint.__name__}, got {value!r}") from None


def apply_overrides(cfg: MegahetConfig, overrides: dict[str, Any]) -> MegahetConfig:
    """Set `section.key` values on cfg (in place), checking each key and type."""
    for dotted, value in overrides.items():
        section_name, _, key = dotted.partition(".")
        if section_name not in SECTIONS or not key:
            raise ConfigError(
                f"unknown config key {dotted!r}: keys are <section>.<name> with section in {sorted(SECTIONS)}"
            )
        section = getattr(cfg, section_name)
        fields = _section_fields(section)
        if key not in fields:
            raise ConfigError(f"unknown config key {dotted!r}: {section_name} has {sorted(fields)}")
        setattr(section, key, _coerce(value, typing.get_type_hints(type(section))[key], dotted))
    return cfg


def _flatten_yaml(data: Any, path: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the YAML file must be a mapping of sections, got {type(data).__name__}")
    flat = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values")
        flat.update({f"{section}.{k}": v for k, v in values.items()})
    return flat


class HelpRequested(Exception):
    """--help / -h on the command line: the caller prints config_help() and exits 0."""


def _field_docs(section_type: type) -> dict[str, str]:
    """The docstring written under each dataclass field (read from the source, as torchtitan does)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(section_type))).body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def config_help(defaults: MegahetConfig | None = None) -> str:
    """Every `--section.key` with its default and documentation."""
    cfg = defaults if defaults is not None else MegahetConfig()
    lines = [
        (
            "usage: SCRIPT [--config FILE.yaml] [--deepspeed_config DS.json] [--plan auto --cluster FILE.yaml] "
            "[--section.key VALUE ...]"
        ),
        "",
    ]
    for name in SECTIONS:
        section = getattr(cfg, name)
        docs = _field_docs(type(section))
        lines.append(f"{name}:")
        for field in dataclasses.fields(section):
            lines.append(f"  --{name}.{field.name} (default {getattr(section, field.name)!r})")
            if field.name in docs:
                lines.append(f"      {docs[field.name]}")
        lines.append("")
    return "\n".join(lines)


def _parse_argv(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split argv into (config file, {dotted key: raw value}), accepting launcher flags."""
    config_file, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--help", "-h"):
            raise HelpRequested
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: use --section.key value")
        name, eq, value = arg[2:].partition("=")
        if name in ("local_rank", "local-rank"):  # passed by the deepspeed launcher
            i += 1 if eq else 2
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                if name == "deepspeed":  # bare `--deepspeed` flag, as DeepSpeed users write it
                    i += 1
                    continue
                raise ConfigError(f"--{name} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if name == "config":
            config_file = value
        elif name in ("deepspeed_config", "deepspeed"):
            overrides["train.deepspeed_config"] = value
        elif name in ("plan", "cluster"):  # --plan auto --cluster cluster.yaml (the layout planner)
            overrides[f"plan.{'mode' if name == 'plan' else 'cluster'}"] = value
        else:
            overrides[name.replace("-", "_")] = value
    return config_file, overrides


def load_config(argv: list[str], defaults: MegahetConfig | None = None) -> MegahetConfig:
    """Defaults, then the YAML file given by --config, then the command-line overrides."""
    cfg = defaults if defaults is not None else MegahetConfig()
    config_file, overrides = _parse_argv(argv)
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file {config_file} not found: pass an existing YAML with --config")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"config file {config_file} is not valid YAML{line}: fix its syntax") from None
        apply_overrides(cfg, _flatten_yaml(data or {}, config_file))
    apply_overrides(cfg, overrides)
    return cfg


def load_deepspeed_json(path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"deepspeed config {path} not found: pass an existing JSON file with --deepspeed_config"
        )
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"deepspeed config {path} is not valid JSON ({err.msg} at line {err.lineno})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"deepspeed config {path} must be a JSON object of DeepSpeed settings, got a {type(data).__name__}"
        )
    return data
