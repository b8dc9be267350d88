"""The shipped example configs and launch scripts stay valid: each YAML loads and validates for the
world size its launch script starts, and each script names an existing config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megahet.config import load_config
from megahet.config_checks import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# config -> world size of the launch that uses it
WORLDS = {
    "cpu/gpt_packed_dp2.yaml": 2,
    "cpu/gpt_tp2_pp2.yaml": 4,
    "cpu/llama_tp2.yaml": 2,
    "cpu/vit_tp2.yaml": 2,
    "gpu/gpt_tp2_pp2_dp2.yaml": 8,
    "gpu/llama_600m_tp2_dp4.yaml": 8,
}


@pytest.mark.parametrize("name,world", sorted(WORLDS.items()))
def test_example_config_validates(name: str, world: int):
    cfg = load_config(["--config", str(EXAMPLES / name)])
    dp = validate(cfg, world)
    assert dp == world // (cfg.parallel.tp * cfg.parallel.pp)


def test_every_example_config_is_covered():
    assert {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml")} == set(WORLDS)


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.rglob("*.sh")))
def test_launch_scripts_reference_existing_files(script: str):
    text = next(EXAMPLES.rglob(script)).read_text()
    referenced = re.findall(r"examples/[\w/.-]+\.(?:yaml|json)|examples/gpu/hostfile", text)
    assert referenced, f"{script} launches no example config"
    for path in referenced:
        assert (EXAMPLES.parent / path).is_file(), f"{script} names missing {path}"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_ds_configs_are_json(name: str):
    assert isinstance(json.loads((EXAMPLES / name).read_text()), dict)
