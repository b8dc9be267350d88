"""Training on from a Hugging Face checkpoint (issue 49 item 17): a small `LlamaForCausalLM` made here by
transformers (grouped-query attention, untied, the test tokenizer's 1024 pieces and its tokenizer.model,
saved with `save_pretrained`; nothing downloaded) is imported with `tools/convert_checkpoint.py import-hf`
at TP=2 x PP=2 and at TP=1, and `pretrain_gpt.py --config OUT/model.json --train.load OUT` trains on:
- the 4-rank run's per-step losses follow the 1-rank run's (the same weights, the same data) within the
  tolerances of the training tests, so the sharded import holds the model;
- its first loss is the imported model's, not a fresh one's (a run without --train.load starts elsewhere),
  and the loss falls.
(Logits against transformers at TP=1, the bit-exact round trip and the one-line errors:
tests/unit/test_hf_import.py.)

Run: ``python -m pytest tests/distributed/test_hf_import_training.py -q`` (about 1 minute on 2 cores).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from harness import REPO, read_records, torchrun

STEPS = 6


def _import(folder: Path, out: Path, tp: int, pp: int) -> None:
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    from convert_checkpoint import main

    assert main(["import-hf", "--hf", str(folder), "--out", str(out), "--tp", str(tp), "--pp", str(pp)]) == 0


def _train(tmp_path: Path, name: str, nproc: int, extra: list[str], gpt_data: list[str]) -> dict[int, dict]:
    metrics = tmp_path / f"{name}.jsonl"
    args = [
        *("--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--model.seq_length", "32"),
        *("--train.train_iters", str(STEPS), "--train.log_interval", "1", "--train.lr", "1e-3"),
        *("--train.lr_warmup_iters", "2", "--train.eval_interval", str(STEPS), "--train.eval_iters", "1"),
        *("--logging.wandb", "false", "--logging.metrics_file", str(metrics)),
        *("--logging.log_dir", str(tmp_path / name)),
        *extra,
        *gpt_data,
    ]
    torchrun("../../pretrain_gpt.py", nproc, args, cwd=tmp_path, timeout=300)
    return {step: r for step, r in read_records(metrics).items() if "loss" in r}


def test_a_llama_imported_at_tp2_pp2_trains_on_as_at_tp1(gpt_data: list[str], tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    hf = LlamaForCausalLM(config)
    with torch.no_grad():
        hf.lm_head.weight.mul_(25.0)  # confident logits: its first loss is far from a fresh model's ln(1024)
    folder = tmp_path / "hf_llama"
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer = gpt_data[gpt_data.index("--data.tokenizer_model") + 1]
    shutil.copyfile(tokenizer, folder / "tokenizer.model")
    _import(folder, tmp_path / "ck22", 2, 2)
    _import(folder, tmp_path / "ck11", 1, 1)
    settings = ["--config", str(tmp_path / "ck22" / "model.json")]
    sharded = _train(
        tmp_path, "tp2pp2", 4,
        [*settings, "--train.load", str(tmp_path / "ck22"), "--parallel.tp", "2", "--parallel.pp", "2"], gpt_data,
    )  # fmt: skip
    whole = _train(tmp_path, "tp1", 1, [*settings, "--train.load", str(tmp_path / "ck11")], gpt_data)
    fresh = _train(tmp_path, "fresh", 1, settings, gpt_data)
    losses = [sharded[s]["loss"] for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        assert abs(sharded[step]["loss"] - whole[step]["loss"]) < 1e-4 * whole[step]["loss"], (
            step,
            sharded,
            whole,
        )
    assert abs(whole[1]["loss"] - fresh[1]["loss"]) > 0.5, (whole[1], fresh[1])  # the weights were loaded
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "ck22" / "iter_0000000" / "tokenizer.model").is_file()
