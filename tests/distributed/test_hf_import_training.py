"""Training on from a Hugging Face checkpoint (issue 49 item 17): a small `LlamaForCausalLM` made here by
transformers (grouped-query attention, untied, the test tokenizer's 1024 pieces and its tokenizer.model,
saved with `save_pretrained`; nothing downloaded) is imported with `tools/convert_checkpoint.py import-hf`
at TP=2 x PP=2 and at TP=1, and `pretrain_gpt.py --config OUT/model.json --train.load OUT` trains on:
- the 4-rank run's per-step losses follow the 1-rank run's (the same weights, the same data) within the
  tolerances of the training tests, so the sharded import holds the model;
- its first loss is the imported model's, not a fresh one's (a run without --train.load starts elsewhere),
  and the loss falls.
A GPT-2 with its own byte-level BPE tokenizer.json (trained here; no SentencePiece) imports at TP=2 x PP=2
with the tokenizer; the corpus is tokenized with that tokenizer.json (tools/preprocess_data.py), trains
on through pretrain_gpt.py with it as data.tokenizer_model, and the checkpoint it saves carries it.
(Logits against transformers at TP=1, the bit-exact round trip and the one-line errors:
tests/unit/test_hf_import.py.)

Run: ``python -m pytest tests/distributed/test_hf_import_training.py -q`` (about 1 minute on 2 cores).
"""

from __future__ import annotations

import json
import math
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


def test_a_gpt2_with_its_own_tokenizer_json_trains_on_at_tp2_pp2(gpt_data: list[str], tmp_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    corpus = Path(gpt_data[gpt_data.index("--data.data_path") + 1]).parent / "corpus.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:60]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    folder = tmp_path / "hf_gpt2"
    torch.manual_seed(1)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=32)
    ).save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    _import(folder, tmp_path / "ck", 2, 2)
    carried = tmp_path / "ck" / "iter_0000000" / "tokenizer.json"
    assert carried.is_file() and (carried.parent / "tokenizer_config.json").is_file()
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    from preprocess_data import main as preprocess

    assert preprocess(["--input", str(corpus), "--output-prefix", str(tmp_path / "bpe"),
                       "--tokenizer-model", str(carried), "--append-eod"]) == 0  # fmt: skip
    data = ["--data.data_path", str(tmp_path / "bpe_text_document"), "--data.tokenizer_model", str(carried)]
    run = [
        "--config", str(tmp_path / "ck" / "model.json"), "--train.load", str(tmp_path / "ck"),
        "--parallel.tp", "2", "--parallel.pp", "2", "--train.save", str(tmp_path / "saved"),
    ]  # fmt: skip
    records = _train(tmp_path, "gpt2", 4, run, data)
    losses = [records[s]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    saved = next((tmp_path / "saved").glob("iter_*"))
    assert (saved / "tokenizer.json").read_bytes() == carried.read_bytes()
