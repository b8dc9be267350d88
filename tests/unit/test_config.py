"""Tests of megahet.config: defaults, YAML + CLI precedence, launcher flags, type coercion, one-line
ConfigErrors (validate()'s consistency checks are in test_config_checks.py).

Run: ``python -m pytest tests/unit/test_config.py -q`` (well under a second; no megatron import).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from one_line import one_line

from megahet.config import (
    ConfigError,
    MegahetConfig,
    apply_overrides,
    load_config,
    load_deepspeed_json,
)
from megahet.config_checks import validate


def _yaml(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- defaults ------------------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config([])
    m, p, t, d, log = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.logging
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 128, 4, 128)
    assert m.ffn_hidden_size is None and m.ffn_size == 4 * 128
    assert (p.tp, p.pp, p.zero_stage) == (1, 1, 1)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (4, 16, 300)
    assert (t.lr, t.min_lr, t.lr_decay_style, t.precision) == (1e-3, 1e-4, "cosine", "fp32")
    assert t.deepspeed_config is None and t.save is None
    assert d.data_path is None and d.tokenizer_model is None and d.split == "90,5,5"
    assert (log.wandb, log.wandb_mode, log.tensorboard_dir, log.log_dir) == (True, "offline", None, "runs")
    # The defaults are a consistent single-rank configuration.
    assert validate(cfg, world_size=1) == 1


def test_defaults_are_not_shared_between_configs() -> None:
    a, b = load_config(["--model.num_layers", "8"]), load_config([])
    assert (a.model.num_layers, b.model.num_layers) == (8, 4)


def test_ffn_size_uses_explicit_value() -> None:
    cfg = load_config(["--model.ffn_hidden_size", "200"])
    assert cfg.model.ffn_hidden_size == 200 and cfg.model.ffn_size == 200


def test_to_dict_has_every_section() -> None:
    d = load_config(["--train.lr", "0.5"]).to_dict()
    assert {"model", "parallel", "train", "data", "logging"} <= set(d)
    assert d["train"]["lr"] == 0.5


# --- YAML + CLI precedence -----------------------------------------------------------------------


def test_yaml_then_cli_precedence(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "model:\n  num_layers: 6\n  hidden_size: 64\n"
        "train:\n  lr: 2.0e-3\n  micro_batch_size: 2\n"
        "parallel:\n  tp: 2\n",
    )
    cfg = load_config(["--config", path, "--train.lr", "3e-4", "--model.num_layers=8"])
    assert cfg.model.num_layers == 8  # CLI (key=value form) beats YAML
    assert cfg.train.lr == 3e-4  # CLI (key value form) beats YAML
    assert cfg.model.hidden_size == 64  # YAML beats the default
    assert cfg.train.micro_batch_size == 2
    assert cfg.parallel.tp == 2
    assert cfg.model.num_attention_heads == 4  # untouched default


def test_cli_before_config_flag_still_wins(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "train:\n  lr: 2.0e-3\n")
    cfg = load_config(["--train.lr", "5e-4", "--config", path])
    assert cfg.train.lr == 5e-4


def test_config_equals_form(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "model:\n  num_layers: 2\n")
    assert load_config([f"--config={path}"]).model.num_layers == 2


def test_given_defaults_are_the_base(tmp_path: Path) -> None:
    base = MegahetConfig()
    base.model.patch_size = 7
    base.train.lr = 3e-3
    path = _yaml(tmp_path, "train:\n  lr: 1.0e-2\n")
    cfg = load_config(["--config", path], defaults=base)
    assert cfg.model.patch_size == 7  # from the given defaults
    assert cfg.train.lr == 1e-2  # the YAML beats the given defaults


def test_example_yaml_loads_and_validates() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "cpu" / "gpt_tp2_pp2.yaml"
    cfg = load_config(["--config", str(path)])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)
    assert validate(cfg, world_size=4) == 1


def test_empty_yaml_is_allowed(tmp_path: Path) -> None:
    cfg = load_config(["--config", _yaml(tmp_path, "# nothing\n")])
    assert cfg.model.num_layers == 4


def test_hyphenated_cli_keys() -> None:
    cfg = load_config(["--train.micro-batch-size", "8"])
    assert cfg.train.micro_batch_size == 8


def test_negative_number_is_a_value_not_a_flag() -> None:
    cfg = load_config(["--train.micro_batch_size", "-2", "--model.num_layers", "2"])
    assert cfg.train.micro_batch_size == -2 and cfg.model.num_layers == 2


# --- DeepSpeed launcher habits -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--deepspeed_config", "ds.json"],
        ["--deepspeed_config=ds.json"],
        ["--deepspeed", "ds.json"],
        ["--deepspeed=ds.json"],
        ["--deepspeed", "--deepspeed_config", "ds.json"],
        ["--deepspeed_config", "ds.json", "--deepspeed"],
    ],
)
def test_deepspeed_config_flags(argv: list[str]) -> None:
    assert load_config(argv).train.deepspeed_config == "ds.json"


def test_bare_deepspeed_flag_alone() -> None:
    cfg = load_config(["--deepspeed", "--train.lr", "0.5"])
    assert cfg.train.deepspeed_config is None and cfg.train.lr == 0.5


@pytest.mark.parametrize(
    "argv",
    [
        ["--local_rank=3", "--train.lr", "0.5"],
        ["--local_rank", "3", "--train.lr", "0.5"],
        ["--local-rank=3", "--train.lr", "0.5"],
        ["--train.lr", "0.5", "--local_rank", "3"],
    ],
)
def test_local_rank_is_accepted_and_ignored(argv: list[str]) -> None:
    # The rank (and its value) is skipped: the result is exactly the config without it.
    assert load_config(argv).to_dict() == load_config(["--train.lr", "0.5"]).to_dict()


# --- type coercion -------------------------------------------------------------------------------


def test_int_coercion() -> None:
    cfg = load_config(["--model.num_layers", "12", "--train.seed=7"])
    assert cfg.model.num_layers == 12 and type(cfg.model.num_layers) is int
    assert cfg.train.seed == 7


@pytest.mark.parametrize("text", ["1e6", "1000000", "1.0e6"])
def test_int_from_a_whole_number_written_as_a_float(text: str) -> None:
    """Issue 49: rope bases are written 1e6; a whole number in any form is an int, a fraction is refused."""
    cfg = load_config(["--model.rotary_base", text])
    assert cfg.model.rotary_base == 1_000_000 and type(cfg.model.rotary_base) is int
    for bad in ("1.5", "1e-3", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"model.rotary_base expects int, got '{bad}'"):
            load_config(["--model.rotary_base", bad])


def test_int_from_integral_yaml_float(tmp_path: Path) -> None:
    cfg = load_config(["--config", _yaml(tmp_path, "model:\n  num_layers: 6.0\n")])
    assert cfg.model.num_layers == 6 and type(cfg.model.num_layers) is int


@pytest.mark.parametrize("text, expected", [("3e-4", 3e-4), ("0.5", 0.5), ("1", 1.0), ("-1.5E2", -150.0)])
def test_float_coercion(text: str, expected: float) -> None:
    cfg = load_config(["--train.lr", text])
    assert cfg.train.lr == expected and type(cfg.train.lr) is float


def test_yaml_exponent_without_dot_is_a_float(tmp_path: Path) -> None:
    # PyYAML reads `3e-4` (no dot) as a string; the coercion still makes it a float.
    cfg = load_config(["--config", _yaml(tmp_path, "train:\n  lr: 3e-4\n")])
    assert cfg.train.lr == 3e-4 and type(cfg.train.lr) is float


@pytest.mark.parametrize(
    "text, expected",
    [
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("false", False),
        ("FALSE", False),
        ("0", False),
        ("no", False),
    ],
)
def test_bool_strings(text: str, expected: bool) -> None:
    default = not expected
    base = MegahetConfig()
    base.logging.wandb = default
    cfg = load_config(["--logging.wandb", text], defaults=base)
    assert cfg.logging.wandb is expected


def test_bool_from_yaml(tmp_path: Path) -> None:
    cfg = load_config(["--config", _yaml(tmp_path, "logging:\n  wandb: false\n")])
    assert cfg.logging.wandb is False


@pytest.mark.parametrize("text", ["none", "None", "null", "NULL"])
def test_optional_none(text: str) -> None:
    base = MegahetConfig()
    base.train.save = "ckpt"
    base.model.ffn_hidden_size = 256
    cfg = load_config(["--train.save", text, "--model.ffn_hidden_size", text], defaults=base)
    assert cfg.train.save is None and cfg.model.ffn_hidden_size is None


def test_optional_value_gets_inner_type(tmp_path: Path) -> None:
    cfg = load_config(["--model.ffn_hidden_size", "256", "--train.save", "ckpt"])
    assert cfg.model.ffn_hidden_size == 256 and type(cfg.model.ffn_hidden_size) is int
    assert cfg.train.save == "ckpt"
    cfg = load_config(["--config", _yaml(tmp_path, "train:\n  save: null\n")])
    assert cfg.train.save is None


def test_str_field_from_yaml_number(tmp_path: Path) -> None:
    cfg = load_config(["--config", _yaml(tmp_path, "data:\n  split: 100\n")])
    assert cfg.data.split == "100"


@pytest.mark.parametrize(
    "key, value",
    [("train.lr_decay_style", "linear"), ("train.precision", "bf16"), ("logging.wandb_mode", "disabled")],
)
def test_literal_accepts_allowed_values(key: str, value: str) -> None:
    cfg = load_config([f"--{key}", value])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


# --- one-line ConfigErrors -----------------------------------------------------------------------


def test_unknown_section() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--optim.lr", "1"])
    one_line(err, "optim.lr", "model", "train")


def test_key_without_section() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--lr", "1"])
    one_line(err, "'lr'")


def test_unknown_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--train.learning_rate", "1"])
    one_line(err, "train.learning_rate", "lr")  # names the key and lists the section's keys


def test_unknown_key_in_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--config", _yaml(tmp_path, "model:\n  layers: 4\n")])
    one_line(err, "model.layers")


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--model.num_layers", "four"], ["model.num_layers", "int", "four"]),
        (["--model.num_layers", "2.5"], ["model.num_layers", "int"]),
        (["--train.lr", "fast"], ["train.lr", "float", "fast"]),
        (["--logging.wandb", "maybe"], ["logging.wandb", "bool", "maybe"]),
        (["--model.ffn_hidden_size", "big"], ["model.ffn_hidden_size", "int"]),
    ],
)
def test_bad_type(argv: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    one_line(err, *needles)


def test_bad_type_in_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--config", _yaml(tmp_path, "train:\n  lr: null\n")])
    one_line(err, "train.lr", "float")
    with pytest.raises(ConfigError) as err:
        load_config(["--config", _yaml(tmp_path, "model:\n  num_layers: 2.5\n")])
    one_line(err, "model.num_layers", "int")


@pytest.mark.parametrize(
    "key, value",
    [("train.lr_decay_style", "step"), ("train.precision", "fp16"), ("logging.wandb_mode", "on")],
)
def test_bad_literal(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([f"--{key}", value])
    one_line(err, key, value)


def test_missing_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(["--config", missing])
    one_line(err, missing, "--config")


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("3\n", "int")])
def test_non_mapping_yaml(tmp_path: Path, text: str, kind: str) -> None:
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(["--config", path])
    one_line(err, path, "mapping", kind)


def test_non_mapping_section(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "model: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(["--config", path])
    one_line(err, "'model'", "mapping")


def test_malformed_yaml_is_a_one_line_config_error(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "model:\n  num_layers: [4\n")
    with pytest.raises(ConfigError) as err:
        load_config(["--config", path])
    one_line(err, path)


def test_flag_without_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["--train.lr"])
    one_line(err, "--train.lr")
    with pytest.raises(ConfigError) as err:
        load_config(["--train.lr", "--model.num_layers", "2"])
    one_line(err, "--train.lr")


def test_positional_argument() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["model.num_layers", "2"])
    one_line(err, "model.num_layers")


def test_apply_overrides_checks_keys_and_types() -> None:
    cfg = apply_overrides(MegahetConfig(), {"parallel.tp": "2", "train.lr": 0.1})
    assert cfg.parallel.tp == 2 and cfg.train.lr == 0.1
    with pytest.raises(ConfigError) as err:
        apply_overrides(MegahetConfig(), {"parallel.dp": 2})
    one_line(err, "parallel.dp")


def test_load_deepspeed_json(tmp_path: Path) -> None:
    good = tmp_path / "ds.json"
    good.write_text('{"zero_optimization": {"stage": 2}}')
    assert load_deepspeed_json(str(good)) == {"zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as err:
        load_deepspeed_json(str(tmp_path / "missing.json"))
    one_line(err, "missing.json", "--deepspeed_config")
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {\n "stage": 2,\n}')
    with pytest.raises(ConfigError) as err:
        load_deepspeed_json(str(bad))
    one_line(err, "bad.json", "JSON")


@pytest.mark.parametrize(
    "mode, plans, resizes, migrates",
    [("static", False, False, False), ("resize", True, True, False), ("migrate", True, False, True),
     ("semi", True, True, True)],
)  # fmt: skip
def test_balance_mode_says_what_it_does(mode: str, plans: bool, resizes: bool, migrates: bool) -> None:
    from megahet.config import BalanceConfig

    b = BalanceConfig(mode=mode)
    assert (b.plans, b.resizes, b.migrates) == (plans, resizes, migrates)
