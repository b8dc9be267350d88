"""The shipped example configs and launch scripts stay valid: each YAML loads and validates for the
world size its launch script starts, and each script names an existing config; the layout planner's
worked example (a cluster file and a 7 B model) ranks its plans as docs/planning.md shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megahet.config import load_config
from megahet.config_checks import validate
from megahet.layout_plan import plan_layouts, plan_table, read_plan_cluster, with_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# config -> world size of the launch that uses it
WORLDS = {
    "cpu/gpt_packed_dp2.yaml": 2,
    "cpu/gpt_tp2_escalate.yaml": 2,
    "cpu/gpt_tp2_pp2.yaml": 4,
    "cpu/llama_cp2_placed.yaml": 2,
    "cpu/llama_tp2.yaml": 2,
    "cpu/vit_tp2.yaml": 2,
    "gpu/gpt_tp2_pp2_dp2.yaml": 8,
    "gpu/llama_600m_tp2_dp4.yaml": 8,
}


@pytest.mark.parametrize("name,world", sorted(WORLDS.items()))
def test_example_config_validates(name: str, world: int):
    cfg = load_config(["--config", str(EXAMPLES / name)])
    dp = validate(cfg, world)
    assert dp == world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)


PLANNER = ("gpu/llama_7b.yaml", "gpu/cluster_a100_v100.yaml")
"""The layout planner's worked example: a model to plan and the cluster to plan it for."""


def test_every_example_config_is_covered():
    assert {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml")} == {*WORLDS, *PLANNER}


REGENERATE = f"python tools/plan.py --cluster examples/{PLANNER[1]} --config examples/{PLANNER[0]} --top 5"


def test_the_planners_worked_example_ranks_as_the_docs_show():
    """docs/planning.md's table is the golden file: a planner change that changes it fails here, and the
    table is regenerated (REGENERATE) and pasted into the docs, with the reason in the commit. The best
    plan's data-parallel shares are derived here on their own: 16 replicas (2 per node) share 256 micro-batches
    by the kinds' fp32 rates (NVIDIA's data sheets: A100 19.5 TFLOP/s, V100 15.7), 32 x 19.5 / 35.2 = 17.7
    per A100 pair's replica -> 18, 14 on the V100s."""
    model, cluster = (str(EXAMPLES / name) for name in PLANNER)
    cfg = load_config(["--config", model, "--plan.cluster", cluster])
    plans = plan_layouts(cfg, read_plan_cluster(cfg), vocab_size=cfg.data.vocab_size)
    best = plans[0]
    a100, v100, per_pair = 19.5, 15.7, 2 * cfg.train.global_batch_size // 16
    on_a100 = round(per_pair * a100 / (a100 + v100))
    assert best.shares == (on_a100,) * 8 + (per_pair - on_a100,) * 8 == (18,) * 8 + (14,) * 8
    assert validate(with_plan(cfg, best), 64) == 16
    docs = (EXAMPLES.parent / "docs" / "planning.md").read_text()
    for line in plan_table(plans, top=5).splitlines():  # the table `tools/plan.py --top 5` prints
        assert line in docs, (
            f"the planner's table changed; if that is meant, run `{REGENERATE}`, paste its table into "
            f"docs/planning.md and say why in the commit. Line not in the docs: {line}"
        )


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
