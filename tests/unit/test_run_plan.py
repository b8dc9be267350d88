"""Tests of megahet/run_plan.py: set-up decides once, into a typed plan, and never rewrites the config.

- `plan_run` validates the configuration and checks the task's inputs exactly once each (also with
  a planned pipeline split, where both used to run twice), and parses hetero.speeds into speeds by
  rank coordinates; the split (`StageSplit`) and the starting shares (`DataParallelShares`) are types;
- the planned split lives in the plan: `parallel.stage_layers` keeps what the user wrote;
- the plan's configuration is frozen: any assignment raises, naming the section and key;
- a real run (one process, pretrain_vit) trains on the plan's frozen configuration: after set-up and
  training the Trainer's configuration is the plan's, unchanged.

Run: ``python -m pytest tests/unit/test_run_plan.py -q``
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from one_line import one_line
from test_resize_executor import _pretrain_vit

from megahet import run_plan, training
from megahet.config import ConfigError, load_config
from megahet.policy.dp_shares import DataParallelShares
from megahet.policy.stage_split import StageSplit


class _Spec:
    """A task without inputs that counts its input checks."""

    name = "test"

    def __init__(self):
        self.preflights = 0

    def vocab_size(self, cfg) -> None:
        return None

    def preflight(self, cfg) -> None:
        self.preflights += 1


def _counting_validate(monkeypatch) -> list:
    calls = []
    real = run_plan.validate
    monkeypatch.setattr(run_plan, "validate", lambda cfg, world: calls.append(world) or real(cfg, world))
    return calls


BASE = ["--model.num_layers", "8", "--model.hidden_size", "64", "--parallel.pp", "2"]


def test_a_declared_pipeline_split_and_shares_are_planned_once_into_types(monkeypatch) -> None:
    validations, spec = _counting_validate(monkeypatch), _Spec()
    cfg = load_config(
        [*BASE, "--hetero.pp_split", "declared", "--hetero.dp_shares", "declared",
         "--hetero.speeds", "0.5,0.5,1,1", "--train.global_batch_size", "8", "--train.micro_batch_size", "1"]
    )  # fmt: skip
    plan = run_plan.plan_run(cfg, spec, world_size=4)
    assert validations == [4] and spec.preflights == 1
    assert type(plan.split) is StageSplit and plan.split == (3, 5)  # stage 0 (ranks 0, 1) is slow
    assert plan.cfg.parallel.stage_layers is None  # the plan holds the split, not the config
    # Ranks are TP-fastest, then DP, then PP: rank 1 is (dp 1, pp 0, tp 0).
    assert dict(plan.speeds) == {(0, 0, 0): 0.5, (1, 0, 0): 0.5, (0, 1, 0): 1.0, (1, 1, 0): 1.0}
    assert plan.tp_group_speeds(0) == [[0.5], [0.5]] and plan.tp_group_speeds(1) == [[1.0], [1.0]]
    assert type(plan.shares) is DataParallelShares and plan.shares == (4, 4)  # each replica: 0.5 then 1
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 2) and plan.resume is None and not plan.reshard
    assert plan.with_split((5, 3)).split == (5, 3) and plan.with_split((5, 3)).cfg is plan.cfg


def test_uneven_declared_replicas_start_from_uneven_shares() -> None:
    cfg = load_config(
        ["--hetero.dp_shares", "declared", "--hetero.speeds", "1,0.25",
         "--train.global_batch_size", "10", "--train.micro_batch_size", "1"]
    )  # fmt: skip
    plan = run_plan.plan_run(cfg, _Spec(), world_size=2)
    assert plan.shares == (8, 2) and plan.split == (cfg.model.num_layers,)


def test_an_escalating_run_plans_the_layouts_it_may_move_between() -> None:
    """escalate.mode=on (issue 46): the TP sizes whose TP x DP layout fits the world; the moved-to plan balances
    replicas by measured shares and keeps the TP balancer only where there is a TP group; the way back is the
    run's own configuration; no other layout is a one-line error before any rank starts."""
    argv = ["--parallel.tp", "2", "--balance.mode", "semi", "--escalate.mode", "on",
            "--train.global_batch_size", "8", "--train.micro_batch_size", "2"]  # fmt: skip
    plan = run_plan.plan_run(load_config(argv), _Spec(), world_size=2)
    assert plan.escalation_tps == (1, 2)
    moved = plan.with_layout(1)
    assert (moved.tp, moved.pp, moved.dp, moved.split) == (1, 1, 2, (plan.cfg.model.num_layers,))
    assert (
        moved.cfg.hetero.dp_shares == "measured" and moved.cfg.balance.mode == "static" and moved.cfg.frozen
    )
    assert moved.shares == (2, 2) and moved.home_cfg is plan.cfg and moved.escalation_tps == (1, 2)
    assert plan.with_layout(1, (3, 1)).shares == (3, 1)  # the replicas start from the predicted shares
    with pytest.raises(ValueError, match="not 4 micro-batches over 2 replicas"):
        plan.with_layout(1, (3, 2))
    back = moved.with_layout(2)
    assert back.cfg is plan.cfg and (back.tp, back.dp) == (2, 1)  # the run's own configuration, as it was
    with pytest.raises(ConfigError) as err:  # one micro-batch a step: DP 2 cannot split it
        run_plan.plan_run(load_config([*argv[:-4], "--train.global_batch_size", "2", "--train.micro_batch_size",
                                       "2"]), _Spec(), world_size=2)  # fmt: skip
    one_line(err, "escalate.mode=on", "no other TP x DP layout of 2 ranks")


def test_the_plans_config_is_frozen() -> None:
    plan = run_plan.plan_run(load_config(BASE), _Spec(), world_size=2)
    assert plan.cfg.frozen
    with pytest.raises(AttributeError, match="ParallelConfig.stage_layers cannot change"):
        plan.cfg.parallel.stage_layers = "3,5"
    with pytest.raises(AttributeError, match="frozen after validation"):
        plan.cfg.train = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.split = (3, 5)


def test_bad_inputs_are_one_line_errors_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError, match="hetero.speeds"):
        run_plan.plan_run(
            load_config([*BASE, "--hetero.pp_split", "declared", "--hetero.speeds", "1,x"]), _Spec(), 2
        )
    spec = types.SimpleNamespace(vocab_size=lambda cfg: None, preflight=lambda cfg: (_ for _ in ()).throw(
        ConfigError("data.data_path: missing")))  # fmt: skip
    with pytest.raises(ConfigError, match="data.data_path"):
        run_plan.plan_run(load_config(BASE), spec, 2)


def test_a_run_trains_on_the_plans_frozen_config(world1, tmp_path) -> None:
    vit = _pretrain_vit()
    argv = [
        "--model.num_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.patch_size", "7", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.train_iters", "2", "--train.log_interval", "1", "--train.eval_interval", "2",
        "--train.eval_iters", "1", "--logging.wandb", "false", "--logging.log_dir", str(tmp_path / "runs"),
        "--train.save", str(tmp_path / "ck"), "--train.save_interval", "1",
    ]  # fmt: skip
    trainer = training.setup(load_config(argv, defaults=vit.default_config()), vit.SPEC)
    before = trainer.plan.cfg.to_dict()
    trainer.train()
    assert trainer.cfg is trainer.plan.cfg and trainer.cfg.frozen
    assert trainer.cfg.to_dict() == before
    assert trainer.layout.stage_layers == trainer.plan.split == (1,)

    # Resuming: the plan names the checkpoint; at another DP it reshards it and says so, once.
    resumed = load_config([*argv, "--train.load", str(tmp_path / "ck")], defaults=vit.default_config())
    same = run_plan.plan_run(resumed, vit.SPEC, world_size=1)
    assert same.resume.iteration == 2 and not same.reshard and same.notes == ()
    wider = run_plan.plan_run(resumed, vit.SPEC, world_size=2)
    assert wider.reshard and wider.dp == 2 and wider.resume.iteration == 2
    assert (
        len(wider.notes) == 1
        and "runs TP 1 x PP 1 x DP 2: resharding it with its optimizer state" in wider.notes[0]
    )
