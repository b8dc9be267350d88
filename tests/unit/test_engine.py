"""Tests of megahet.engine: the ds_config megahet builds (checked by DeepSpeed's own config parser),
user ds_config merging and folding, weight-decay parameter groups (on hand-made and real megatron-core
GPT / ViT stages) and the LR schedule.

The `world1` fixture starts a one-rank gloo group through megahet.parallel.initialize_parallel (which
applies the CPU shims to this process, as every training process does) and tears it down after
the module.

Run: ``python -m pytest tests/unit/test_engine.py -q`` (about 15 s, mostly imports).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from one_line import one_line

from megahet.config import ConfigError, MegahetConfig, apply_overrides
from megahet.config_checks import validate
from megahet.engine import (
    LRSchedule,
    build_engine,
    deepspeed_config,
    fold_deepspeed_json,
    mark_pipeline_copies,
    param_groups,
)

REPO = Path(__file__).resolve().parents[2]
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _cfg(**overrides: object) -> MegahetConfig:
    return apply_overrides(MegahetConfig(), dict(overrides))


# --- deepspeed_config() --------------------------------------------------------------------------


@pytest.mark.parametrize("G, M, dp", [(16, 4, 1), (16, 4, 2), (16, 2, 4), (32, 8, 4), (12, 3, 2)])
def test_batch_keys_consistent_with_dp(G: int, M: int, dp: int) -> None:
    ds = deepspeed_config(_cfg(**{"train.global_batch_size": G, "train.micro_batch_size": M}), dp, {})
    assert ds["train_batch_size"] == G
    # DeepSpeed sees one "micro-batch" per step: the rank's whole share; megatron-core schedules
    # the real micro-batches.
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["train_micro_batch_size_per_gpu"] == G // dp
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp == G
    assert ds["managed_gradient_accumulation"] is False


def test_settings_come_from_the_megahet_config() -> None:
    cfg = _cfg(
        **{
            "train.lr": 3e-4,
            "train.adam_beta1": 0.8,
            "train.adam_beta2": 0.99,
            "train.adam_eps": 1e-6,
            "train.weight_decay": 0.1,
            "train.clip_grad": 0.5,
            "train.precision": "bf16",
            "parallel.zero_stage": 2,
        }
    )
    ds = deepspeed_config(cfg, 1, {})
    opt = ds["optimizer"]
    assert opt["type"] == "AdamW"
    assert opt["params"]["lr"] == 3e-4 and opt["params"]["betas"] == [0.8, 0.99]
    assert opt["params"]["eps"] == 1e-6 and opt["params"]["weight_decay"] == 0.1
    assert opt["params"]["torch_adam"] is True
    assert opt["params"].get("fused", False) is torch.cuda.is_available()
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True}
    assert deepspeed_config(_cfg(), 1, {})["bf16"] == {"enabled": False}


def test_gpu_optimizer_is_torchs_fused_adamw_needing_no_op_build(world1, monkeypatch) -> None:
    """On a GPU DeepSpeed gets torch's fused AdamW, not its JIT-built FusedAdam: that build needs nvcc and
    fails on TORCH_CUDA_ARCH_LIST entries like "9.0a" (seen on an H200). DeepSpeed's own optimizer
    factory is asked which class and arguments that config gives."""
    import megahet.engine

    monkeypatch.setattr(megahet.engine, "cuda_available", lambda: True)
    params = dict(deepspeed_config(_cfg(), 1, {})["optimizer"]["params"])
    assert params["torch_adam"] is True and params["fused"] is True
    from deepspeed.runtime.engine import DeepSpeedEngine

    cls, extra = DeepSpeedEngine.get_optimizer_configuration(None, params, True)  # pops torch_adam
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = cls([weight], **params, **extra)  # torch supports the fused kernel on CPU tensors too
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_deepspeed_accepts_the_batch_keys(world1, dp: int) -> None:
    """DeepSpeed's own config parser, with an mpu reporting `dp` data-parallel ranks."""

    class Mpu:
        @staticmethod
        def get_data_parallel_world_size() -> int:
            return dp

    ds = deepspeed_config(_cfg(**{"train.global_batch_size": 16, "train.micro_batch_size": 2}), dp, {})
    parsed = DeepSpeedConfig(copy.deepcopy(ds), mpu=Mpu())
    assert parsed.world_size == dp
    assert parsed.train_batch_size == 16 and parsed.gradient_accumulation_steps == 1
    assert parsed.train_micro_batch_size_per_gpu == 16 // dp
    assert parsed.zero_optimization_stage == 1
    # The check is live: a config built for another DP size is rejected.
    wrong = deepspeed_config(_cfg(**{"train.global_batch_size": 16, "train.micro_batch_size": 2}), dp * 2, {})
    with pytest.raises(AssertionError, match="train_batch_size"):
        DeepSpeedConfig(wrong, mpu=Mpu())


def test_user_ds_config_deep_merges() -> None:
    user = {
        "zero_optimization": {"reduce_bucket_size": 1000, "overlap_comm": True},
        "optimizer": {"params": {"lr": 0.5}},
        "gradient_clipping": 2.0,
        "activation_checkpointing": {"partition_activations": False},
    }
    user_before = copy.deepcopy(user)
    cfg = _cfg(**{"parallel.zero_stage": 2})
    base = deepspeed_config(cfg, 2, {})
    ds = deepspeed_config(cfg, 2, user)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "overlap_comm": True}
    assert ds["optimizer"]["type"] == "AdamW"  # kept from megahet's
    assert ds["optimizer"]["params"]["lr"] == 0.5  # user's
    assert ds["optimizer"]["params"]["betas"] == base["optimizer"]["params"]["betas"]  # kept
    assert ds["gradient_clipping"] == 2.0
    assert ds["activation_checkpointing"] == {"partition_activations": False}
    assert ds["train_batch_size"] == base["train_batch_size"]
    assert user == user_before  # inputs untouched
    assert deepspeed_config(cfg, 2, {}) == base  # no state leaks between calls
    # Merging builds a new tree: editing the result does not reach megahet's nor the user's dicts.
    ds["zero_optimization"]["stage"] = 99
    ds["optimizer"]["params"]["lr"] = 9.0
    assert deepspeed_config(cfg, 2, user)["zero_optimization"]["stage"] == 2
    assert user["optimizer"]["params"]["lr"] == 0.5


def test_matching_batch_keys_are_accepted() -> None:
    cfg = _cfg()
    ours = deepspeed_config(cfg, 2, {})
    user = {key: ours[key] for key in _BATCH_KEYS}
    assert deepspeed_config(cfg, 2, user) == ours


@pytest.mark.parametrize("key, value", [(_BATCH_KEYS[0], 32), (_BATCH_KEYS[1], 4), (_BATCH_KEYS[2], 2)])
def test_conflicting_batch_keys_are_rejected(key: str, value: int) -> None:
    with pytest.raises(ConfigError) as err:
        deepspeed_config(_cfg(), 2, {key: value})
    one_line(err, key, str(value), "train.global_batch_size")


# --- fold_deepspeed_json() -----------------------------------------------------------------------


def _ds_file(tmp_path: Path, content: object, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return str(path)


def test_fold_without_ds_config_changes_nothing() -> None:
    cfg = _cfg()
    before = cfg.to_dict()
    assert fold_deepspeed_json(cfg) == (cfg, {})
    assert cfg.to_dict() == before


def test_fold_carries_stage_bf16_and_clipping(tmp_path: Path) -> None:
    user = {
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "bf16": {"enabled": True},
        "gradient_clipping": 0.3,
    }
    given = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, user)})
    cfg, folded = fold_deepspeed_json(given)
    assert folded == user
    assert given.parallel.zero_stage == 1 and given.train.precision == "fp32"  # the input is left alone
    assert cfg.parallel.zero_stage == 2 and type(cfg.parallel.zero_stage) is int
    assert cfg.train.precision == "bf16"
    assert cfg.train.clip_grad == 0.3
    # ... and the built ds_config agrees with the user's.
    ds = deepspeed_config(cfg, 1, user)
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.3


def test_fold_leaves_unset_values_alone(tmp_path: Path) -> None:
    cfg = _cfg(
        **{
            "parallel.zero_stage": 2,
            "train.clip_grad": 0.7,
            "train.deepspeed_config": _ds_file(tmp_path, {"bf16": {"enabled": False}, "steps_per_print": 5}),
        }
    )
    cfg, _ = fold_deepspeed_json(cfg)
    assert (cfg.parallel.zero_stage, cfg.train.precision, cfg.train.clip_grad) == (2, "fp32", 0.7)


def test_fold_shipped_example(tmp_path: Path) -> None:
    cfg = _cfg(**{"train.deepspeed_config": str(REPO / "examples" / "ds_config_zero2_bf16.json")})
    cfg, _ = fold_deepspeed_json(cfg)
    assert (cfg.parallel.zero_stage, cfg.train.precision) == (2, "bf16")


def test_fold_then_validate_rejects_zero2_with_pp(tmp_path: Path) -> None:
    cfg = _cfg(
        **{
            "parallel.pp": 2,
            "train.deepspeed_config": _ds_file(tmp_path, {"zero_optimization": {"stage": 2}}),
        }
    )
    cfg, _ = fold_deepspeed_json(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 2)
    one_line(err, "parallel.zero_stage")


def test_fold_rejects_fp16(tmp_path: Path) -> None:
    cfg = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, {"fp16": {"enabled": True}})})
    with pytest.raises(ConfigError) as err:
        fold_deepspeed_json(cfg)
    one_line(err, "fp16", "bf16")
    # A disabled fp16 section is fine.
    cfg = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, {"fp16": {"enabled": False}}, "off.json")})
    assert fold_deepspeed_json(cfg)[1] == {"fp16": {"enabled": False}}


def test_fold_refuses_deepspeeds_unsafe_checkpoint_loading(tmp_path: Path) -> None:
    """checkpoint.load_universal sends DeepSpeed through torch.load(weights_only=False) (issue 49, item 4)."""
    unsafe = {"checkpoint": {"load_universal": True}}
    cfg = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, unsafe)})
    with pytest.raises(ConfigError) as err:
        fold_deepspeed_json(cfg)
    one_line(err, "checkpoint.load_universal", "weights_only=False", "remove it")
    off = {"checkpoint": {"load_universal": False}}
    cfg = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, off, "off.json")})
    assert fold_deepspeed_json(cfg)[1] == off


def test_fold_missing_file(tmp_path: Path) -> None:
    cfg = _cfg(**{"train.deepspeed_config": str(tmp_path / "none.json")})
    with pytest.raises(ConfigError) as err:
        fold_deepspeed_json(cfg)
    one_line(err, "none.json")


def test_fold_non_object_json_is_a_config_error(tmp_path: Path) -> None:
    cfg = _cfg(**{"train.deepspeed_config": _ds_file(tmp_path, [{"zero_optimization": {"stage": 1}}])})
    with pytest.raises(ConfigError) as err:
        fold_deepspeed_json(cfg)
    one_line(err, "ds.json")


# --- param_groups() ------------------------------------------------------------------------------


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(10, 4)
        self.embedding.position_embeddings = torch.nn.Embedding(6, 4)
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 4))
        self.norm = torch.nn.LayerNorm(4)
        self.proj = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def _names(model: torch.nn.Module, groups: list[dict]) -> tuple[set[str], set[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in groups[0]["params"]}, {by_id[id(p)] for p in groups[1]["params"]}


def test_param_groups_on_a_toy_model() -> None:
    model = _Toy()
    groups = param_groups(model, 0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    decay, no_decay = _names(model, groups)
    assert decay == {"embedding.word_embeddings.weight", "proj.weight"}
    assert no_decay == {
        "embedding.position_embeddings.weight",
        "cls_token",
        "norm.weight",
        "norm.bias",
        "proj.bias",
    }


@pytest.mark.parametrize("kind", ["gpt", "vit"])
def test_param_groups_on_real_models(world1, kind: str) -> None:
    from megahet.models.gpt import build_gpt
    from megahet.models.vit import build_vit

    cfg = _cfg(
        **{
            "model.num_layers": 2,
            "model.hidden_size": 32,
            "model.num_attention_heads": 4,
            "model.seq_length": 16,
            "model.patch_size": 7,
        }
    )
    model = build_gpt(cfg, vocab_size=100) if kind == "gpt" else build_vit(cfg)
    groups = param_groups(model, 0.1)
    decay, no_decay = _names(model, groups)
    params = dict(model.named_parameters())
    assert decay | no_decay == set(params) and not decay & no_decay
    for name in no_decay:  # biases, norms, and the position / [CLS] tables
        assert params[name].ndim == 1 or name.endswith(
            ("position_embeddings.weight", "position_embeddings", "cls_token")
        )
    for name in decay:
        assert params[name].ndim == 2 and "norm" not in name and not name.endswith("bias")
    assert any("layernorm" in n for n in no_decay) and any(n.endswith("bias") for n in no_decay)
    if kind == "gpt":
        assert "embedding.position_embeddings.weight" in no_decay
        assert "embedding.word_embeddings.weight" in decay
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in decay
        assert "decoder.final_layernorm.weight" in no_decay
    else:
        assert {"position_embeddings", "cls_token", "head.bias"} <= no_decay
        assert {"patch_embedding.weight", "head.weight"} <= decay


def test_mark_pipeline_copies() -> None:
    model = _Toy()
    model.proj.weight.shared = True
    assert mark_pipeline_copies(model) == 1
    assert model.proj.weight.ds_pipe_replicated is True
    assert not hasattr(model.proj.bias, "ds_pipe_replicated")


def test_build_engine_uses_groups_and_schedule(world1) -> None:
    cfg = _cfg(
        **{
            "train.global_batch_size": 4,
            "train.micro_batch_size": 2,
            "train.lr": 1e-2,
            "train.lr_warmup_iters": 4,
            "train.train_iters": 10,
            "train.weight_decay": 0.2,
        }
    )
    model = _Toy()
    engine = build_engine(cfg, model, 1, {})
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.2, 0.0]
    assert isinstance(engine.lr_scheduler, OptimizerParamScheduler)
    lrs = []
    for _ in range(11):
        lrs.append(engine.get_lr())
        engine.lr_scheduler.step()
    floor = cfg.train.min_lr
    cosine = [floor + (1e-2 - floor) * 0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(1, 7)]
    # written out: step k at (k + 1) / 4 of the peak over the warmup, then cosine to min_lr at the last step
    assert [lr[0] for lr in lrs] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, *cosine, floor])
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.2, 0.0]  # after its steps too


def test_checkpoints_of_the_torch_lambda_schedule_load_at_the_same_learning_rate(world1) -> None:
    """A model states file written before megatron-core's scheduler holds torch's LambdaLR state, whose
    step k ran at (k + 1) / warmup: it loads as the schedule at k + 1, the same learning rate."""
    cfg = apply_overrides(
        MegahetConfig(),
        {"train.lr": 1e-2, "train.lr_warmup_iters": 4, "train.train_iters": 10, "train.global_batch_size": 2,
         "train.micro_batch_size": 2},
    )  # fmt: skip
    engine = build_engine(cfg, _Toy(), 1, {})
    engine.lr_scheduler.load_state_dict({"last_epoch": 2, "base_lrs": [1e-2, 1e-2], "_step_count": 3})
    assert engine.get_lr() == pytest.approx([7.5e-3, 7.5e-3])  # (2 + 1) / 4 of 1e-2
    saved = engine.lr_scheduler.state_dict()
    engine.lr_scheduler.step()
    engine.lr_scheduler.load_state_dict(saved)
    assert engine.lr_scheduler.num_steps == 3


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_registers_no_per_parameter_gradient_hooks(world1, stage: int) -> None:
    """ZeRO-1 leaves gradients in param.grad until the step (no hook, no bucket copy per parameter per
    micro-batch: host time on a GPU); ZeRO-2 partitions them as they come, through its hooks."""
    cfg = _cfg(**{"train.global_batch_size": 4, "train.micro_batch_size": 2, "parallel.zero_stage": stage})
    model = _Toy()
    engine = build_engine(cfg, model, 1, {})
    hooks = engine.optimizer._grad_acc_hooks
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(hooks) == (0 if stage == 1 else len(trained)), len(hooks)


# --- LRSchedule: megatron-core's OptimizerParamScheduler ------------------------------------------


def _factors(cfg: MegahetConfig, steps: int) -> list[float]:
    """The learning rate of each optimizer step over train.lr."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [param], "wd_mult": 1.0}], lr=cfg.train.lr)
    schedule = LRSchedule(optimizer, cfg)
    factors = []
    for _ in range(steps):
        factors.append(optimizer.param_groups[0]["lr"] / cfg.train.lr)
        schedule.step()
    return factors


def _schedule(style: str, **overrides: object) -> list[float]:
    settings = {
        "train.lr": 1.0,
        "train.min_lr": 0.1,
        "train.lr_warmup_iters": 10,
        "train.train_iters": 110,
        "train.lr_decay_style": style,
        **overrides,
    }
    return _factors(_cfg(**settings), 130)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_warmup_is_linear_to_peak(style: str) -> None:
    """Step k (from 0) runs at (k + 1) / warmup of the peak: the first step learns too."""
    f = _schedule(style)
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # the peak at step 9


def test_cosine_decay_to_min_lr() -> None:
    f = _schedule("cosine")  # the decay starts after the peak at step 9
    floor = 0.1
    assert f[9 + 25] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f[9 + 50] == pytest.approx((1 + floor) / 2)
    assert f[109] == pytest.approx(floor)  # the last of train_iters 110
    assert f[109:] == pytest.approx([floor] * 21)  # stays at min_lr past train_iters
    decay = f[9:110]
    assert all(a >= b for a, b in itertools.pairwise(decay))


def test_linear_decay_to_min_lr() -> None:
    f = _schedule("linear")
    floor = 0.1
    for k in (0, 25, 50, 75, 100):
        assert f[9 + k] == pytest.approx(floor + (1 - floor) * (1 - k / 100)), k
    assert f[125] == pytest.approx(floor)
    assert _schedule("cosine")[9 + 25] > f[9 + 25]  # the two shapes differ


def test_constant_after_warmup() -> None:
    assert _schedule("constant")[9:] == pytest.approx([1.0] * 121)


def test_no_warmup_starts_at_peak() -> None:
    f = _schedule("cosine", **{"train.lr_warmup_iters": 0, "train.train_iters": 100})
    assert f[0] == pytest.approx(1.0) and f[100] == pytest.approx(0.1)


def test_min_lr_is_relative_to_lr() -> None:
    f = _factors(_cfg(**{"train.lr": 2e-3, "train.min_lr": 2e-4, "train.train_iters": 50}), 51)
    assert f[50] == pytest.approx(0.1)
