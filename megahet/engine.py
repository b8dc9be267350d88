"""The DeepSpeed engine for a megatron-core model: ds_config, parameter groups and LR schedule
(megatron-core's `OptimizerParamScheduler`).

Role: runtime (the DeepSpeed engine).

megatron-core's pipeline schedule runs the forward and backward passes itself (`torch.autograd.
backward` per micro-batch), so the engine runs with `managed_gradient_accumulation: false`:
DeepSpeed's torch-style backward hooks accumulate gradients locally, and `engine.step()` is the
accumulation boundary that reduces them over the data-parallel group (ZeRO-1) or finalizes the
per-backward reduce-scatters (ZeRO-2), clips, and steps AdamW.

    engine = build_engine(cfg, model, dp_size)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import deepspeed
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megahet.compat.deepspeed_norm import install_fused_grad_norm
from megahet.compat.deepspeed_zero import mark_pipe_replicated
from megahet.config import ConfigError, MegahetConfig, load_deepspeed_json
from megahet.parallel import ContextParallelMpu, MegatronMpu
from megahet.platform import cuda_available
from megahet.policy.reshard_plan import decays

# Keys megahet owns, because the pipeline schedule and data sampler depend on them.
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def fold_deepspeed_json(cfg: MegahetConfig) -> tuple[MegahetConfig, dict[str, Any]]:
    """Read --deepspeed_config (if any): (cfg with the settings that shape the model carried over from
    it, the user's DeepSpeed dict). cfg itself is left as it is."""
    if not cfg.train.deepspeed_config:
        return cfg, {}
    user = load_deepspeed_json(cfg.train.deepspeed_config)
    if user.get("fp16", {}).get("enabled"):
        raise ConfigError("fp16 is not supported (no loss scaling in megahet): use bf16 or fp32")
    if user.get("checkpoint", {}).get("load_universal"):
        raise ConfigError(
            "ds_config checkpoint.load_universal makes DeepSpeed read checkpoints with "
            "torch.load(weights_only=False), which runs any code pickled in them: remove it (megahet "
            "loads and reshards checkpoints itself with the safe loader: --train.load, tools/convert.py)"
        )
    parallel, train = {}, {}
    stage = user.get("zero_optimization", {}).get("stage")
    if stage is not None:
        parallel["zero_stage"] = int(stage)
    if user.get("bf16", {}).get("enabled"):
        train["precision"] = "bf16"
    if "gradient_clipping" in user:
        train["clip_grad"] = float(user["gradient_clipping"])
    folded = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **parallel),
        train=dataclasses.replace(cfg.train, **train),
    )
    return folded, user


def zero_settings(stage: int) -> dict[str, Any]:
    """DeepSpeed's zero_optimization section. ZeRO-1 without contiguous gradients: each gradient stays in
    param.grad until the step's reduction (as megatron-core's DDP without overlap), so DeepSpeed registers
    no per-parameter backward hook that copies every gradient into its bucket buffer (a Python call and a
    copy kernel per parameter per micro-batch; on an H200 the GPT step was host-bound). ZeRO-2 keeps them:
    it partitions gradients as they are produced. A ds_config can set either back."""
    return {"stage": stage, **({"contiguous_gradients": False} if stage == 1 else {})}


def deepspeed_config(cfg: MegahetConfig, dp_size: int, user: dict[str, Any]) -> dict[str, Any]:
    t = cfg.train
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.global_batch_size // dp_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_eps,
                "weight_decay": t.weight_decay,
                # torch's AdamW on every device: fused on a GPU (one multi-tensor kernel, nothing to
                # compile), so a GPU node needs no nvcc and no DeepSpeed op build (DeepSpeed's JIT
                # FusedAdam fails on TORCH_CUDA_ARCH_LIST entries such as "9.0a").
                "torch_adam": True,
                **({"fused": True} if cuda_available() else {}),
            },
        },
        "zero_optimization": zero_settings(cfg.parallel.zero_stage),
        "gradient_clipping": t.clip_grad,
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    for key in _BATCH_KEYS:
        if key in user and user[key] != ds[key]:
            raise ConfigError(
                f"ds_config {key}={user[key]} disagrees with megahet's {ds[key]} (megahet gives DeepSpeed one "
                f"micro-step of global batch / DP samples per optimizer step; megatron-core's schedule splits it "
                f"into train.micro_batch_size micro-batches): drop {key} from the ds_config and set "
                f"train.global_batch_size / train.micro_batch_size instead"
            )
    return _merge(ds, user)


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases, norms, [CLS] and position tables are not decayed."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if decays(name, param.ndim) else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},  # wd_mult: megatron-core's scheduler
    ]


class LRSchedule(OptimizerParamScheduler):
    """megatron-core's `OptimizerParamScheduler` as DeepSpeed's `lr_scheduler`: linear warmup over
    `train.lr_warmup_iters`, then cosine / linear decay (or constant) to `train.min_lr` at
    `train.train_iters`, Megatron-LM's `--lr-warmup-iters` / `--lr-decay-style` curves; weight decay
    constant, 0 on the no-decay group (`wd_mult`). With a warmup its count starts at 1, so that step k
    (from 0) runs at (k + 1) / warmup of the peak, as torchtitan's warmup does, and no step runs at lr 0
    (Megatron-LM's first step does: a weights-only restart's first step would change nothing); the decay
    then reaches min_lr at the last step. DeepSpeed calls `step()`
    once per optimizer step, without megatron-core's `increment`. The current settings win over a
    checkpoint's (`override_opt_param_scheduler`): a resumed run may train longer or decay to another
    floor; the step count comes from the checkpoint."""

    def __init__(self, optimizer, cfg: MegahetConfig):
        t = cfg.train
        decay_steps = max(t.train_iters, t.lr_warmup_iters + 1)  # a run may end inside its warmup
        super().__init__(
            optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
            lr_decay_steps=decay_steps, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
        )  # fmt: skip
        self.offset = 1 if t.lr_warmup_iters > 0 else 0
        self.step(self.offset)  # the first step runs at 1 / warmup

    def step(self, increment: int = 1) -> None:
        super().step(increment)

    def load_state_dict(self, state: dict) -> None:
        """A saved schedule; from checkpoints written before it (torch's LambdaLR, whose `last_epoch` k ran
        at (k + 1) / warmup), the same count (the same learning rate from there)."""
        self.num_steps = 0  # megatron-core's load steps on by the saved count
        if "last_epoch" in state:
            self.step(int(state["last_epoch"]) + self.offset)
            return
        super().load_state_dict(state)


def mark_pipeline_copies(model: torch.nn.Module) -> int:
    """Flag the parameters that duplicate another stage's (megatron-core's `shared`: the last stage's
    tied word embedding when PP > 1) as `ds_pipe_replicated`, so that DeepSpeed's gradient norm, summed
    over the TP x PP group, counts them once (megatron-core's own clipping skips `shared` the same way).
    Without it the tied embedding's gradient is counted twice and gradient clipping under PP differs
    from PP=1. Returns the number of parameters flagged."""
    flagged = 0
    for param in model.parameters():
        if getattr(param, "shared", False):
            mark_pipe_replicated(param)
            flagged += 1
    return flagged


def build_engine(cfg: MegahetConfig, model: torch.nn.Module, dp_size: int, user_ds: dict[str, Any]):
    """deepspeed.initialize with megatron-core's process groups (the mpu adapter) and our schedule; ZeRO's
    gradient norm fused (megahet/compat/deepspeed_norm.py)."""
    ds_config = deepspeed_config(cfg, dp_size, user_ds)
    mark_pipeline_copies(model)
    scheduler = None
    if "scheduler" not in ds_config:

        def scheduler(optimizer):
            return LRSchedule(optimizer, cfg)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.train.weight_decay),
        config=ds_config,
        mpu=ContextParallelMpu() if cfg.parallel.cp > 1 else MegatronMpu(),
        lr_scheduler=scheduler,
    )
    install_fused_grad_norm(engine.optimizer)  # one fused norm, not a float64 norm per parameter
    return engine
