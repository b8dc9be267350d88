"""Tests of megahet.config_checks.validate(): the data-parallel size it returns and the one-line
ConfigErrors of inconsistent configurations (TP / PP / world size, batch sizes, ZeRO, resizing and
selection settings).

Run: ``python -m pytest tests/unit/test_config_checks.py -q`` (well under a second; no megatron import).
"""

from __future__ import annotations

import pytest
from one_line import one_line

from megahet.config import ConfigError, MegahetConfig, apply_overrides, load_config
from megahet.config_checks import parse_doc_cost, validate

# --- validate() ----------------------------------------------------------------------------------


def _cfg(**overrides: object) -> MegahetConfig:
    return apply_overrides(MegahetConfig(), dict(overrides))


@pytest.mark.parametrize(
    "overrides, world, dp",
    [
        ({}, 1, 1),
        ({}, 4, 4),
        ({"parallel.tp": 2}, 4, 2),
        ({"parallel.tp": 2, "parallel.pp": 2}, 8, 2),
        (
            {"parallel.tp": 4, "parallel.pp": 2, "train.global_batch_size": 4, "train.micro_batch_size": 4},
            8,
            1,
        ),
        ({"parallel.pp": 4}, 4, 1),
    ],
)
def test_validate_returns_dp_size(overrides: dict, world: int, dp: int) -> None:
    assert validate(_cfg(**overrides), world) == dp


def _invalid(cfg: MegahetConfig, world: int, *needles: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    return one_line(err, *needles)


def test_tp_must_divide_heads() -> None:
    _invalid(
        _cfg(**{"parallel.tp": 3, "model.hidden_size": 96, "model.num_attention_heads": 4}),
        3,
        "parallel.tp 3",
        "model.num_attention_heads 4",
    )


def test_heads_must_divide_hidden() -> None:
    _invalid(
        _cfg(**{"model.hidden_size": 100, "model.num_attention_heads": 8}),
        1,
        "model.hidden_size 100",
        "model.num_attention_heads 8",
    )


def test_tp_must_divide_ffn_size() -> None:
    # hidden % heads == 0 and heads % tp == 0 already imply hidden % tp == 0: only ffn can break it.
    _invalid(_cfg(**{"parallel.tp": 4, "model.ffn_hidden_size": 130}), 4, "parallel.tp 4", "130")
    assert validate(_cfg(**{"parallel.tp": 4, "model.ffn_hidden_size": 132}), 4) == 1


def test_tp_ffn_message_names_the_ffn_key() -> None:
    _invalid(_cfg(**{"parallel.tp": 4, "model.ffn_hidden_size": 130}), 4, "model.ffn_hidden_size")


def test_world_size_divisible_by_tp_pp() -> None:
    _invalid(_cfg(**{"parallel.tp": 2}), 3, "world size 3", "parallel.tp", "TP*PP")
    _invalid(_cfg(**{"parallel.tp": 2, "parallel.pp": 2}), 6, "world size 6", "4")


def test_zero2_with_pipeline_parallel() -> None:
    _invalid(_cfg(**{"parallel.pp": 2, "parallel.zero_stage": 2}), 2, "pp=2", "parallel.zero_stage")
    assert validate(_cfg(**{"parallel.pp": 2, "parallel.zero_stage": 1}), 2) == 1
    assert validate(_cfg(**{"parallel.tp": 2, "parallel.zero_stage": 2}), 4) == 2


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stage_must_be_1_or_2(stage: int) -> None:
    _invalid(_cfg(**{"parallel.zero_stage": stage}), 1, "parallel.zero_stage", str(stage))


@pytest.mark.parametrize("key", ["train.micro_batch_size", "train.global_batch_size"])
@pytest.mark.parametrize("value", [0, -4])
def test_batch_sizes_must_be_positive(key: str, value: int) -> None:
    _invalid(_cfg(**{key: value}), 1, key, "positive")


def test_global_batch_multiple_of_micro_times_dp() -> None:
    # 16 is a multiple of 4 * 2 but not of 4 * 8 (world 8, dp 8).
    assert validate(_cfg(), 2) == 2
    _invalid(_cfg(), 8, "train.global_batch_size 16", "micro_batch_size", "4 * 8")
    _invalid(_cfg(**{"train.global_batch_size": 10}), 1, "train.global_batch_size 10")


def test_pp_must_divide_layers() -> None:
    _invalid(_cfg(**{"parallel.pp": 3, "model.num_layers": 4}), 3, "parallel.pp 3", "model.num_layers 4")


@pytest.mark.parametrize("key", ["model.num_layers", "model.hidden_size", "model.num_attention_heads"])
def test_model_sizes_must_be_positive(key: str) -> None:
    _invalid(_cfg(**{key: 0}), 1, key)


def test_tp_pp_must_be_at_least_one() -> None:
    _invalid(_cfg(**{"parallel.tp": 0}), 1, "parallel.tp")


@pytest.mark.parametrize(
    "key", ["train.train_iters", "train.log_interval", "train.eval_interval", "train.eval_iters"]
)
def test_iteration_counts_must_be_positive(key: str) -> None:
    _invalid(_cfg(**{key: 0}), 1, key)


def test_lr_must_be_positive() -> None:
    _invalid(_cfg(**{"train.lr": 0.0}), 1, "train.lr")
    _invalid(_cfg(**{"train.min_lr": -1e-5}), 1, "train.min_lr")


def test_min_lr_above_lr_is_rejected() -> None:
    _invalid(_cfg(**{"train.lr": 1e-5}), 1, "train.min_lr")


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("resize.reselect_interval", 0, "must be positive"),
        ("resize.unit_multiple", 0, "must be >= 1"),
        ("resize.max_drop_steps", -1, "must be positive"),
        ("resize.score_decay", 1.0, "must be in [0, 1)"),
        ("resize.score_samples", -5, "0 = every element"),
        ("resize.priority_temperature", -0.5, "0 = lowest scores first"),
    ],
)
def test_resize_selection_settings_are_checked(key: str, value: float, needle: str) -> None:
    _invalid(_cfg(**{key: value}), 1, key, str(value), needle)


def test_priority_score_must_be_a_known_score() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--resize.priority_score", "l1"])
    one_line(err, "resize.priority_score", "l1", "taylor")


# --- Llama-family options -----------------------------------------------------------------------------


def test_llama_options_validate() -> None:
    llama = {
        "model.position_embedding_type": "rope", "model.normalization": "RMSNorm", "model.activation": "swiglu",
        "model.num_query_groups": 2, "model.untie_embeddings_and_output_weights": True,
        "model.add_bias_linear": False, "model.rotary_base": 500000, "parallel.tp": 2,
    }  # fmt: skip
    assert validate(_cfg(**llama), 2) == 1
    assert _cfg(**llama).model.query_groups == 2 and _cfg().model.query_groups == 4


@pytest.mark.parametrize(
    "overrides, world, needles",
    [
        ({"model.num_query_groups": 3}, 1, ("model.num_query_groups 3", "model.num_attention_heads 4")),
        ({"model.num_query_groups": 0}, 1, ("model.num_query_groups", "positive")),
        ({"model.num_query_groups": 2, "parallel.tp": 4}, 4, ("parallel.tp 4", "model.num_query_groups 2")),
        ({"model.position_embedding_type": "rope", "model.rotary_base": 0}, 1, ("model.rotary_base",)),
        ({"model.rotary_base": 500000}, 1, ("model.rotary_base applies to rotary positions only",)),
        ({"model.rotary_interleaved": True}, 1, ("model.rotary_interleaved", "position_embedding_type=rope")),
        ({"data.max_tokens": 64}, 1, ("data.max_tokens applies to packed documents only",)),
        ({"data.doc_cost": "1e-9,1e-5,0"}, 1, ("data.doc_cost", "data.packing=documents")),
        (
            {
                "model.position_embedding_type": "rope",
                "model.hidden_size": 12,
                "model.num_attention_heads": 4,
            },
            1,
            ("head dim 3", "even"),
        ),
    ],
)
def test_bad_llama_combinations_are_one_line_errors(overrides: dict, world: int, needles: tuple) -> None:
    _invalid(_cfg(**overrides), world, *needles)


def test_unknown_architecture_values_are_config_errors() -> None:
    for key, value in [
        ("model.attention", "flash"),
        ("model.activation", "relu"),
        ("model.normalization", "BN"),
    ]:
        with pytest.raises(ConfigError, match=key):
            _cfg(**{key: value})


@pytest.mark.parametrize(
    "text", ["nan,0,0", "inf,0,0", "1e-9,inf,0", "1e-9,1e-5,nan", "-1e-9,1e-5,0", "0,0,1"]
)
def test_doc_cost_must_be_finite_and_positive_before_ranks_start(text):
    """Issue 49: nan and inf passed validation and failed after the ranks had started."""
    with pytest.raises(ConfigError, match="data.doc_cost .* three finite numbers >= 0"):
        parse_doc_cost(text)
    assert parse_doc_cost("2e-9,1e-5,1e-3") == (2e-9, 1e-5, 1e-3)


# --- context parallelism (issue 45) ---------------------------------------------------------------


def test_cp_counts_in_the_world_and_not_in_dp() -> None:
    """TP x CP x DP: the CP ranks share their replica's samples, so DP (and the batch check) excludes them."""
    assert validate(_cfg(**{"parallel.cp": 2}), 4) == 2
    assert validate(_cfg(**{"parallel.cp": 2, "parallel.tp": 2}), 4) == 1
    _invalid(_cfg(**{"parallel.cp": 2, "parallel.tp": 2}), 6, "TP*PP*CP", "--parallel.cp")


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ({"model.seq_length": 30}, ("model.seq_length 30", "multiple of 4")),
        ({"model.attention": "local"}, ("model.attention sdpa",)),
    ],
)
def test_what_cp_does_not_run_with_yet_gets_a_one_line_error(overrides: dict, needles: tuple) -> None:
    cfg = _cfg(**{"parallel.cp": 2, "model.seq_length": 32, **overrides})
    _invalid(cfg, 4, "parallel.cp 2", *needles)


def test_cp_runs_with_the_tp_balancer_resizing_and_virtual_devices() -> None:
    for overrides in (
        {"balance.mode": "semi"},
        {"resize.gamma": "0:0.5"},
        {"device.profile": "static:1,1,0.5,0.5"},
    ):
        assert validate(_cfg(**{"parallel.cp": 2, "model.seq_length": 32, **overrides}), 4) == 2


def test_cp_runs_with_data_parallel_shares() -> None:
    """Replicas of CP ranks get shares of the batch by declared or measured speed (issue 28's first stage)."""
    for shares in ("declared", "measured"):
        cfg = _cfg(**{"parallel.cp": 2, "model.seq_length": 32, "hetero.dp_shares": shares,
                      "hetero.speeds": "1,1,0.5,0.5"})  # fmt: skip
        assert validate(cfg, 4) == 2


def test_cp_runs_with_the_pipeline_balancer() -> None:
    """Layers per stage by declared or measured speed (a position at its slowest CP rank)."""
    for split, speeds in (("declared", {"hetero.speeds": "1,1,0.5,0.5"}), ("measured", {})):
        cfg = _cfg(**{"parallel.cp": 2, "parallel.pp": 2, "model.seq_length": 32, "hetero.pp_split": split,
                      **speeds})  # fmt: skip
        assert validate(cfg, 4) == 1


def test_cp_saves_and_resumes_checkpoints() -> None:
    assert validate(_cfg(**{"parallel.cp": 2, "model.seq_length": 32, "train.save": "/tmp/ck"}), 4) == 2


PLACED = {
    "parallel.cp": 2,
    "model.seq_length": 32,
    "data.packing": "documents",
    "train.micro_batch_size": 1,
    "parallel.cp_placement": "dynamic",
}


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ({"data.packing": "none"}, ("parallel.cp_placement dynamic", "data.packing documents")),
        ({"parallel.cp": 1}, ("parallel.cp > 1",)),
        (
            {"parallel.cp_placement": "static", "parallel.cp_speeds": "1,0.5"},
            ("parallel.cp_placement dynamic",),
        ),
        ({"parallel.cp_speeds": "1,0.5,1"}, ("parallel.cp_speeds", "2 positive speeds")),
        ({"parallel.cp_speeds": "1,-1"}, ("parallel.cp_speeds", "2 positive speeds")),
        ({"parallel.cp_speeds": "fast,slow"}, ("parallel.cp_speeds", "e.g. 1,0.5")),
        ({"parallel.cp_block": 0}, ("parallel.cp_block", "positive")),
    ],
)
def test_a_bad_dynamic_cp_placement_gets_a_one_line_error(overrides: dict, needles: tuple) -> None:
    _invalid(_cfg(**{**PLACED, **overrides}), 8, *needles)


@pytest.mark.parametrize("speeds", ["1,0.5", "measured"])
def test_a_dynamic_cp_placement_by_declared_or_measured_speeds_validates(speeds: str) -> None:
    assert validate(_cfg(**{**PLACED, "parallel.cp_speeds": speeds}), 4) == 2
    assert validate(_cfg(**{**PLACED, "parallel.cp_speeds": speeds, "parallel.pp": 2}), 8) == 2


@pytest.mark.parametrize(
    "key, value",
    [("escalate.patience", 0), ("escalate.horizon", 0), ("escalate.window", 0), ("escalate.min_gain", 1.0),
     ("escalate.delay_floor_ms", -1.0)],
)  # fmt: skip
def test_bad_escalation_settings_are_one_line_errors(key: str, value: float) -> None:
    _invalid(_cfg(**{key: value}), 1, key, str(value))


def test_escalation_needs_ranks_and_a_layout_it_can_move() -> None:
    on = {"escalate.mode": "on"}
    _invalid(_cfg(**on), 1, "escalate.mode=on", "2 or more")
    _invalid(_cfg(**on, **{"parallel.pp": 2}), 2, "escalate.mode=on", "parallel.pp=1")
    _invalid(_cfg(**on, **{"parallel.zero_stage": 2}), 2, "escalate.mode=on", "parallel.zero_stage=1")
    assert validate(_cfg(**on, **{"parallel.tp": 2}), 2) == 1
