"""Tests of elastic resume's policy and its building blocks on one process (no process group):

- megahet.checkpointing.elastic: `needs_reshard` (same layout, another DP, ZeRO stage, TP x PP; weights-only and
  per-parameter checkpoints), `fit_layout` (the run's own TP x PP when it fits the world, else the
  largest TP' x PP' that passes every configuration check, ties to the larger TP; a one-line
  ConfigError naming train.load when none does) and `plan_resume` (the fitted configuration and the
  note naming the saved and the new layout);
- megahet.checkpointing.finder.check_model: a checkpoint of another model (shaping settings) or vocabulary is a
  one-line ConfigError, dropout / init settings may change, old checkpoints without "model" pass;
- (reading DeepSpeed's ZeRO shards per parameter: tests/unit/test_zero_state.py).

Run: ``python -m pytest tests/unit/test_elastic.py -q`` (a few seconds, mostly imports).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from one_line import one_line

from megahet.checkpointing.elastic import fit_layout, layout_note, needs_reshard, with_layout
from megahet.checkpointing.finder import MODEL_SETTINGS_FREE, Resume, check_model
from megahet.config import ConfigError, MegahetConfig, load_config
from megahet.config_checks import validate


def _cfg(*argv: str) -> MegahetConfig:
    return load_config(list(argv))


def _resume(layout: dict, path: str = "/ck/iter_0000020", **meta: object) -> Resume:
    return Resume(Path(path), {"iteration": 20, "consumed_samples": 320, "layout": layout, **meta})


def _full(tp: int, pp: int, dp: int, zero_stage: int = 1) -> dict:
    return {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero_stage}


def plan_resume(cfg, resume, world):
    """(the fitted configuration, the layout note, whether to reshard) with the split from cfg: how
    megahet/run_plan.py composes elastic's parts."""
    if resume is None or resume.meta.get("weights_only"):
        return cfg, None, False
    fitted = with_layout(cfg, *fit_layout(cfg, world))
    reshard = needs_reshard(resume, fitted, world)
    return fitted, layout_note(resume, cfg, fitted, world, reshard), reshard


# --- needs_reshard ---------------------------------------------------------------------------------


def test_no_checkpoint_never_reshards() -> None:
    assert not needs_reshard(None, _cfg(), 4)
    assert plan_resume(_cfg(), None, 4)[1] is None


@pytest.mark.parametrize(
    "argv, world, layout",
    [
        ((), 1, _full(1, 1, 1)),
        (("--parallel.tp", "2"), 4, _full(2, 1, 2)),
        (("--parallel.tp", "2", "--parallel.pp", "2"), 8, _full(2, 2, 2)),
        (("--parallel.zero_stage", "2"), 4, _full(1, 1, 4, zero_stage=2)),
    ],
)
def test_same_layout_does_not_reshard(argv: tuple, world: int, layout: dict) -> None:
    cfg = _cfg(*argv)
    resume = _resume(layout)
    assert not needs_reshard(resume, cfg, world)
    fitted, note, _ = plan_resume(cfg, resume, world)
    assert fitted is cfg and note is None


def test_a_checkpoint_saved_on_strided_tp_groups_reshards_and_reads_by_its_placement() -> None:
    """An escalation's placement (megahet/policy/mesh.py) is in the layout a checkpoint records: the same
    TP x PP x DP on megatron-core's consecutive groups holds other shards on each rank, so it reshards, and the
    reader maps ranks to shards as they were saved."""
    from megahet.checkpointing.sharded_state import saved_layout

    cfg, strided = _cfg("--parallel.tp", "2"), {**_full(2, 1, 2), "strided": True}
    assert needs_reshard(_resume(strided), cfg, 4)
    meta = {"layout": strided, "model": dataclasses.asdict(cfg.model)}
    layout = saved_layout(meta)
    assert layout.strided and [layout.coords(r) for r in range(4)] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 0, 1),
        (1, 0, 1),
    ]
    assert not saved_layout({"layout": _full(2, 1, 2), "model": meta["model"]}).strided


def test_other_dp_reshards_keeping_tp_pp() -> None:
    """4 -> 2 ranks at TP 2: TP 2 x PP 1 still fits, only DP changes (2 -> 1)."""
    cfg, resume = _cfg("--parallel.tp", "2"), _resume(_full(2, 1, 2))
    assert needs_reshard(resume, cfg, 2)
    assert fit_layout(cfg, 2) == (2, 1)
    fitted, note, _ = plan_resume(cfg, resume, 2)
    assert (fitted.parallel.tp, fitted.parallel.pp) == (2, 1)
    assert validate(fitted, 2) == 1
    assert note is not None and "\n" not in note
    assert "/ck/iter_0000020 was saved at TP 2 x PP 1 x DP 2" in note
    assert "runs TP 2 x PP 1 x DP 1" in note
    assert "does not fit" not in note  # the run's own TP x PP is kept


def test_more_ranks_reshard_to_larger_dp() -> None:
    cfg, resume = _cfg("--parallel.tp", "2"), _resume(_full(2, 1, 1))
    assert needs_reshard(resume, cfg, 8)
    fitted, note, _ = plan_resume(cfg, resume, 8)
    assert (fitted.parallel.tp, fitted.parallel.pp) == (2, 1)
    assert "runs TP 2 x PP 1 x DP 4" in note


def test_zero_stage_change_alone_reshards() -> None:
    cfg = _cfg("--parallel.zero_stage", "2")
    resume = _resume(_full(1, 1, 2, zero_stage=1))
    assert needs_reshard(resume, cfg, 2)
    fitted, note, _ = plan_resume(cfg, resume, 2)
    assert fitted.parallel == cfg.parallel  # same TP x PP, same ZeRO stage as configured
    assert note is not None and "TP 1 x PP 1 x DP 2" in note


def test_tp_change_reshards() -> None:
    cfg, resume = _cfg("--parallel.tp", "2"), _resume(_full(1, 1, 4))
    assert needs_reshard(resume, cfg, 4)


@pytest.mark.parametrize("cfg_tp, world", [(4, 2), (2, 2), (1, 3), (2, 8)])
def test_weights_only_never_reshards(cfg_tp: int, world: int) -> None:
    """Weights-only checkpoints load at any DP with their own TP x PP: never resharded here, even
    when the run's TP x PP does not fit the world (check_compatible then names the reshard command)."""
    cfg = _cfg("--parallel.tp", str(cfg_tp))
    resume = _resume({"tp": 4, "pp": 1}, weights_only=True)
    assert not needs_reshard(resume, cfg, world)
    fitted, note, _ = plan_resume(cfg, resume, world)
    assert fitted is cfg and note is None


def test_per_parameter_reshards_only_for_other_tp_pp() -> None:
    resume = _resume({"tp": 2, "pp": 1}, optimizer="per_parameter")
    for world in (2, 4, 8):  # any DP, any ZeRO stage
        assert not needs_reshard(resume, _cfg("--parallel.tp", "2"), world)
        assert not needs_reshard(resume, _cfg("--parallel.tp", "2", "--parallel.zero_stage", "2"), world)
    assert needs_reshard(resume, _cfg(), 2)  # TP 1
    assert needs_reshard(resume, _cfg("--parallel.tp", "2", "--parallel.pp", "2"), 4)
    fitted, note, _ = plan_resume(_cfg(), resume, 2)
    assert (fitted.parallel.tp, fitted.parallel.pp) == (1, 1)
    assert "saved at TP 2 x PP 1;" in note  # a per-parameter layout has no DP
    assert "runs TP 1 x PP 1 x DP 2" in note


# --- fit_layout ------------------------------------------------------------------------------------


def test_own_layout_kept_when_it_fits() -> None:
    cfg = _cfg("--parallel.tp", "2", "--parallel.pp", "2")
    assert fit_layout(cfg, 4) == (2, 2)
    assert fit_layout(cfg, 8) == (2, 2)


def test_tp_pp_that_does_not_fit_prefers_larger_tp_on_a_tie() -> None:
    """TP 2 x PP 2 on 2 ranks: TP 2 x PP 1 and TP 1 x PP 2 both fit (product 2); TP wins the tie."""
    cfg = _cfg("--parallel.tp", "2", "--parallel.pp", "2")
    resume = _resume(_full(2, 2, 1))
    assert needs_reshard(resume, cfg, 2)
    assert fit_layout(cfg, 2) == (2, 1)
    fitted, note, _ = plan_resume(cfg, resume, 2)
    assert (fitted.parallel.tp, fitted.parallel.pp) == (2, 1)
    assert dataclasses.replace(fitted, parallel=cfg.parallel) == cfg  # nothing else changed
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)  # the run's configuration is not mutated
    assert note is not None and "\n" not in note
    assert "saved at TP 2 x PP 2 x DP 1" in note
    assert "runs TP 2 x PP 1 x DP 1" in note
    assert "(TP 2 x PP 2 does not fit 2 ranks)" in note


def test_tp4_on_two_ranks_takes_tp2() -> None:
    cfg = _cfg("--parallel.tp", "4")
    resume = _resume(_full(4, 1, 1))
    assert needs_reshard(resume, cfg, 2)
    fitted, note, _ = plan_resume(cfg, resume, 2)
    assert (fitted.parallel.tp, fitted.parallel.pp) == (2, 1)
    assert "runs TP 2 x PP 1 x DP 1" in note and "(TP 4 x PP 1 does not fit 2 ranks)" in note


def _fits(cfg: MegahetConfig, tp: int, pp: int, world: int) -> bool:
    try:
        validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp, pp=pp)), world)
    except ConfigError:
        return False
    return True


_HEADS_12 = ("--model.hidden_size", "96", "--model.num_attention_heads", "12")


def test_largest_product_wins_over_larger_tp() -> None:
    """TP 4 x PP 2 on 12 ranks (8 does not divide 12), 12 heads, 2 layers: TP 4 x PP 1 (product 4)
    fits, but TP 3 x PP 2 (product 6) is larger, and wins although its TP is smaller."""
    cfg = _cfg(
        "--parallel.tp", "4", "--parallel.pp", "2", "--model.num_layers", "2",
        "--model.hidden_size", "96", "--model.num_attention_heads", "12", "--model.ffn_hidden_size", "384",
        "--train.global_batch_size", "24", "--train.micro_batch_size", "4",
    )  # fmt: skip
    assert _fits(cfg, 4, 1, 12)
    assert fit_layout(cfg, 12) == (3, 2)


@pytest.mark.parametrize(
    "argv, world, expected",
    [
        # TP 3 divides 12 heads and the MLP (4 * 96): taken on 3 ranks
        (_HEADS_12, 3, (3, 1)),
        # TP 3 does not divide 4 heads: TP 1 x DP 3
        (("--model.hidden_size", "96", "--model.num_attention_heads", "4"), 3, (1, 1)),
        # TP 3 divides 12 heads but not the MLP size 100: TP 1 x DP 3
        ((*_HEADS_12, "--model.ffn_hidden_size", "100"), 3, (1, 1)),
        # TP 4 would fit 4 ranks but does not divide the MLP size 130: TP 2 x DP 2
        (("--model.ffn_hidden_size", "130", "--train.global_batch_size", "24"), 4, (2, 1)),
    ],
)
def test_fit_respects_heads_and_mlp_divisibility(argv: tuple, world: int, expected: tuple) -> None:
    cfg = _cfg(
        "--parallel.tp", "4", "--train.global_batch_size", "12", "--train.micro_batch_size", "4", *argv
    )
    tp, pp = fit_layout(cfg, world)
    assert (tp, pp) == expected
    assert _fits(cfg, tp, pp, world)


@pytest.mark.parametrize("layers, expected", [(12, (1, 3)), (8, (1, 1))])
def test_fit_respects_layer_divisibility(layers: int, expected: tuple) -> None:
    """PP 4 on 3 ranks: PP 3 only when it divides the layers."""
    cfg = _cfg(
        "--parallel.pp", "4", "--model.num_layers", str(layers),
        "--train.global_batch_size", "12", "--train.micro_batch_size", "4",
    )  # fmt: skip
    assert fit_layout(cfg, 3) == expected


@pytest.mark.parametrize("global_batch, expected", [(24, (2, 1)), (48, (3, 1))])
def test_fit_respects_the_global_batch(global_batch: int, expected: tuple) -> None:
    """TP 4 on 12 ranks with an MLP (390) TP 4 does not divide: TP 3 means DP 4, and global batch 24 at
    micro-batch 4 is not a multiple of 4 * 4, so TP 3 must not be chosen (TP 2 x DP 6: 24 = 4 * 6);
    at global batch 48 TP 3 x DP 4 is."""
    cfg = _cfg(
        "--parallel.tp", "4", "--model.hidden_size", "96", "--model.num_attention_heads", "12",
        "--model.ffn_hidden_size", "390", "--train.micro_batch_size", "4",
        "--train.global_batch_size", str(global_batch),
    )  # fmt: skip
    assert fit_layout(cfg, 12) == expected


def test_no_layout_when_the_batch_allows_none() -> None:
    """TP 4 on 4 ranks with an MLP (129) only TP 1 divides: TP 1 means DP 4, which global batch 8 at
    micro-batch 4 does not allow (8 % 16): no layout, and TP 1's own error says why; at global batch 16
    TP 1 x DP 4 is chosen."""
    argv = ("--parallel.tp", "4", "--model.ffn_hidden_size", "129", "--train.micro_batch_size", "4")
    with pytest.raises(ConfigError) as excinfo:
        fit_layout(_cfg(*argv, "--train.global_batch_size", "8"), 4)
    assert one_line(excinfo).startswith("train.global_batch_size 8 is not a multiple")
    assert fit_layout(_cfg(*argv, "--train.global_batch_size", "16"), 4) == (1, 1)


def test_no_layout_fits_is_the_configurations_own_one_line_error() -> None:
    """TP 4 on 3 ranks, 4 heads: TP 3 does not divide the heads, TP 2 not the world, TP 1 is DP 3 and
    global batch 16 is not a multiple of 4 * 3: the error no layout can avoid, not a layout error."""
    cfg = _cfg("--parallel.tp", "4")
    resume = _resume(_full(4, 1, 1))
    with pytest.raises(ConfigError) as excinfo:
        plan_resume(cfg, resume, 3)
    message = one_line(excinfo)
    assert message.startswith("train.global_batch_size 16 is not a multiple") and "* 3" in message


def test_a_non_layout_error_is_not_hidden_behind_the_layout() -> None:
    """A configuration wrong beyond its layout (min_lr above lr) says so, even when a reshard is due."""
    cfg = _cfg("--parallel.tp", "2", "--train.min_lr", "1", "--train.lr", "0.1")
    with pytest.raises(ConfigError) as excinfo:
        plan_resume(cfg, _resume(_full(2, 1, 2)), 2)
    assert "min_lr" in one_line(excinfo)


def test_a_checkpoint_resharded_for_this_world_is_not_resharded_again() -> None:
    """TP 4 configured, 2 ranks: a checkpoint saved at TP 2 x DP 1 (after an earlier shrink) resumes
    as it is, at TP 2, without a reshard."""
    cfg = _cfg("--parallel.tp", "4")
    for resume in (_resume(_full(2, 1, 1)), _resume({"tp": 2, "pp": 1}, optimizer="per_parameter")):
        fitted, note, reshard = plan_resume(cfg, resume, 2)
        assert (fitted.parallel.tp, fitted.parallel.pp, reshard) == (2, 1, False)
        assert "as it was saved" in note


# --- check_model -----------------------------------------------------------------------------------


def _saved_model(cfg: MegahetConfig, vocab_size: int | None = 8192, **meta: object) -> Resume:
    extra = {"model": dataclasses.asdict(cfg.model), **meta}
    if vocab_size is not None:
        extra["vocab_size"] = vocab_size
    return _resume(_full(1, 1, 1), **extra)


def test_check_model_same_model_passes() -> None:
    cfg = _cfg("--model.hidden_size", "64", "--model.num_layers", "2")
    check_model(_saved_model(cfg), cfg, 8192)
    check_model(_saved_model(cfg, vocab_size=None), cfg, None)  # a task without vocabulary (ViT)


@pytest.mark.parametrize(
    "key, saved, now",
    [("hidden_size", 128, 64), ("num_layers", 4, 2), ("seq_length", 128, 256), ("num_attention_heads", 4, 8)],
)
def test_check_model_refuses_another_shape(key: str, saved: int, now: int) -> None:
    before = _cfg(f"--model.{key}", str(saved))
    resume = _saved_model(before)
    with pytest.raises(ConfigError) as excinfo:
        check_model(resume, _cfg(f"--model.{key}", str(now)), 8192)
    message = one_line(excinfo)
    assert message.startswith("train.load:")
    assert f"model.{key} {saved}" in message and f"this run has {now}" in message
    assert str(resume.path) in message


@pytest.mark.parametrize(
    "key, value", [("hidden_dropout", "0.1"), ("attention_dropout", "0.2"), ("init_method_std", "0.01")]
)
def test_check_model_allows_free_settings(key: str, value: str) -> None:
    assert key in MODEL_SETTINGS_FREE
    resume = _saved_model(_cfg())
    check_model(resume, _cfg(f"--model.{key}", value), 8192)


def test_check_model_lets_a_rotary_model_train_at_another_length() -> None:
    """No position table: an imported Llama (max_position_embeddings 4096) trains on at 1024; a learned
    table's length stays a shaping setting (above)."""
    rope = ("--model.position_embedding_type", "rope")
    check_model(
        _saved_model(_cfg(*rope, "--model.seq_length", "4096")),
        _cfg(*rope, "--model.seq_length", "1024"),
        8192,
    )


def test_check_model_old_checkpoint_without_model_passes() -> None:
    check_model(_resume(_full(1, 1, 1)), _cfg("--model.hidden_size", "64"), 8192)


def test_check_model_refuses_another_vocabulary() -> None:
    cfg = _cfg()
    with pytest.raises(ConfigError) as excinfo:
        check_model(_saved_model(cfg, vocab_size=8192), cfg, 4096)
    message = one_line(excinfo)
    assert message.startswith("train.load:") and "8192" in message and "4096" in message


def test_check_model_refuses_gpt_into_a_task_without_vocabulary_and_back() -> None:
    cfg = _cfg()
    with pytest.raises(ConfigError) as excinfo:
        check_model(_saved_model(cfg, vocab_size=8192), cfg, None)  # GPT checkpoint, ViT run
    assert "with a vocabulary" in one_line(excinfo)
    with pytest.raises(ConfigError) as excinfo:
        check_model(_saved_model(cfg, vocab_size=None), cfg, 8192)  # ViT checkpoint, GPT run
    assert "without one" in one_line(excinfo)


def test_check_model_compares_the_mlp_size_not_how_it_was_given() -> None:
    """An unset ffn_hidden_size is 4 x hidden: the same weights as giving it (and another size is not)."""
    resume = _saved_model(_cfg("--model.hidden_size", "128"))
    check_model(resume, _cfg("--model.hidden_size", "128", "--model.ffn_hidden_size", "512"), 8192)
    with pytest.raises(ConfigError, match="model.ffn_hidden_size 512"):
        check_model(resume, _cfg("--model.hidden_size", "128", "--model.ffn_hidden_size", "256"), 8192)


def test_check_model_checks_the_vocabulary_of_a_checkpoint_without_model_settings() -> None:
    resume = _resume(_full(1, 1, 1), vocab_size=8192)
    with pytest.raises(ConfigError, match="vocabulary of 8192 tokens"):
        check_model(resume, _cfg(), 1024)
