"""The layout planner on a run's configuration (issue 30): `tools/plan.py` lists the plans and writes
configurations that megahet's validation accepts; `--plan auto` plans at start-up for the launched
cluster (its nodes in the file's order) and runs the fastest plan; bad inputs are one-line errors.
Whether a written configuration starts and trains: tests/distributed/test_layout_plan.py.

Run: ``python -m pytest tests/unit/test_layout_plan_cli.py -q`` (a few seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from one_line import one_line

from megahet import run_plan
from megahet.config import ConfigError, load_config
from megahet.config_checks import validate
from megahet.layout_plan import plan_for_launch, plan_layouts, with_plan
from megahet.policy.cluster import read_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

MODEL = ["--model.num_layers", "8", "--model.hidden_size", "64", "--model.num_attention_heads", "4",
         "--model.seq_length", "32", "--train.global_batch_size", "16"]  # fmt: skip
VOCAB = 1000


def _cluster_file(tmp_path: Path, fast: float = 0.02, slow: float = 0.01, memory_gib: float = 2.0) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n"
        f"  - {{name: fast, gpus: 2, memory_gib: {memory_gib}, tflops: {fast}, intra_gbps: 1}}\n"
        f"  - {{name: slow, gpus: 2, memory_gib: {memory_gib}, tflops: {slow}, intra_gbps: 1}}\n"
        "network_gbps: 0.5\n"
    )
    return str(path)


def test_tools_plan_lists_plans_and_writes_configs_that_validate(tmp_path, capsys) -> None:
    from plan import main

    cluster = _cluster_file(tmp_path)
    assert main(["--cluster", cluster, *MODEL, "--top", "3", "--out", str(tmp_path / "plans")]) == 0
    out = capsys.readouterr().out
    assert "plans fit" in out and "launch order" in out and "TP " in out
    written = sorted((tmp_path / "plans").glob("plan_*.yaml"))
    assert len(written) >= 3
    for path in written:
        cfg = load_config(["--config", str(path)])
        validate(cfg, 4)
        assert cfg.model.num_layers == 8 and cfg.train.global_batch_size == 16
        assert "pretrain_gpt.py --config" in path.read_text()
    best = load_config(["--config", str(written[0])])
    import pretrain_gpt  # importable once tools/plan.py is: the reference uses the vocabulary it plans with

    vocab = pretrain_gpt.vocab_size(load_config(MODEL))
    plans = plan_layouts(load_config(MODEL), read_cluster(cluster, "fp32"), vocab)
    assert (best.parallel.tp, best.parallel.pp) == (plans[0].tp, plans[0].pp)
    if not plans[0].shares.even:  # the slow node's replicas are declared slower
        speeds = [float(s) for s in best.hetero.speeds.split(",")]
        assert best.hetero.dp_shares == "declared" and min(speeds) < 1 == max(speeds)


def test_tools_plan_help_lists_every_option(capsys) -> None:
    """Issue 49: --help listed only --top and --out, and cut its description mid-sentence."""
    from plan import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "the fastest plans that fit, with predicted step time and memory,\nthe Pareto set" in out
    for option in (
        "--top",
        "--out",
        "--plan.cluster",
        "--plan.micro_batches",
        "--plan.profile",
        "--model.num_layers",
    ):
        assert option in out, option


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "--cluster cluster.yaml"),
        (["--cluster", "missing.yaml"], "plan.cluster: cluster file missing.yaml not found"),
        (["--cluster", "CLUSTER", "--plan.micro_batches", "1,x"], "plan.micro_batches must be sizes"),
    ],
)
def test_tools_plan_bad_inputs_are_one_line_errors(tmp_path, capsys, argv, needle) -> None:
    from plan import main

    argv = [a.replace("CLUSTER", _cluster_file(tmp_path)) for a in argv]
    assert main([*MODEL, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megahet: error:") and "\n" not in err and needle in err, err


def test_plan_auto_runs_the_fastest_plan_for_the_launched_cluster(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = load_config([*MODEL, "--plan", "auto", "--cluster", _cluster_file(tmp_path)])
    planned, note = plan_for_launch(cfg, VOCAB, 4)
    best = plan_layouts(cfg, read_cluster(cfg.plan.cluster, "fp32"), VOCAB, launched=True)[0]
    assert best.node_order == (0, 1)  # launched: the file's order only
    assert (planned.parallel.tp, planned.parallel.pp, planned.train.micro_batch_size) == (
        best.tp, best.pp, best.micro_batch,
    )  # fmt: skip
    assert note.startswith(f"plan auto: {best.layout}") and "predicted" in note
    plan = run_plan.plan_run(cfg, _NoInputs(), 4)
    assert plan.cfg.parallel.tp == best.tp and plan.notes[0] == note


class _NoInputs:
    name = "gpt"

    def preflight(self, cfg) -> None:
        pass

    def vocab_size(self, cfg) -> int:
        return VOCAB


def test_plan_auto_keeps_measured_shares_and_splits_starting_from_the_plan(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = load_config([*MODEL, "--plan", "auto", "--cluster", _cluster_file(tmp_path), "--hetero.dp_shares",
                       "measured", "--parallel.stage_layers", "7,1", "--parallel.pp", "2"])  # fmt: skip
    planned, _ = plan_for_launch(cfg, VOCAB, 4)
    assert planned.hetero.dp_shares == "measured"
    plans = plan_layouts(cfg, read_cluster(cfg.plan.cluster, "fp32"), VOCAB, launched=True)
    assert planned.parallel.stage_layers == (plans[0].overrides().get("parallel.stage_layers"))
    even = with_plan(load_config(MODEL), plans[0])
    assert even.hetero.dp_shares in ("even", "declared") and even.hetero.pp_split == "even"


@pytest.mark.parametrize(
    "extra, env, world, needle",
    [
        ([], {"LOCAL_WORLD_SIZE": "2"}, 8, "describes 2 nodes x 2 GPUs, this job runs 8 ranks, 2 per node"),
        ([], {"LOCAL_WORLD_SIZE": "4"}, 4, "4 per node"),
        (["--plan.cluster", ""], {}, 4, "plan.mode=auto needs plan.cluster"),
        (["MEMORY"], {"LOCAL_WORLD_SIZE": "2"}, 4, "no layout of this model fits"),
    ],
)
def test_plan_auto_bad_inputs_are_one_line_errors(tmp_path, monkeypatch, extra, env, world, needle) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    tiny = extra == ["MEMORY"]
    cluster = _cluster_file(tmp_path, memory_gib=1e-4 if tiny else 2.0)
    cfg = load_config([*MODEL, "--plan", "auto", "--cluster", cluster, *([] if tiny else extra)])
    with pytest.raises(ConfigError) as err:
        plan_for_launch(cfg, VOCAB, world)
    one_line(err, needle)
