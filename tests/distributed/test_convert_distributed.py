"""Conversion of a real TP=2 x PP=2 checkpoint (workers/convert_train.py: 3 pretrain_gpt steps, 4 ranks).

The launch saves the checkpoint and the sharded model's logits on fixed tokens. Here (one process):
`tools/convert_checkpoint.py consolidate` -> a TP=1 GPT must give the same logits; `export-hf` -> a
GPT2LMHeadModel must give them too, and greedy generation equal to megahet's own greedy loop (~40 s).

Run: ``python -m pytest tests/distributed/test_convert_distributed.py -q``
"""

from __future__ import annotations

import sys

import torch
from harness import GPT_MODEL, REPO, compare, torchrun

from megahet.config import load_config
from megahet.models.gpt import build_gpt

RUN = [
    "--parallel.tp", "2", "--parallel.pp", "2",
    "--train.train_iters", "3", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
    "--train.lr_warmup_iters", "1", "--train.eval_interval", "100", "--train.eval_iters", "1",
    "--logging.wandb", "false",
]  # fmt: skip


def test_tp2_pp2_checkpoint_consolidates_and_exports(gpt_data, world1, tmp_path):
    from transformers import GPT2LMHeadModel

    sys.path.insert(0, str(REPO / "tools"))
    from convert_checkpoint import main

    ckpt = tmp_path / "ck"
    torchrun("workers/convert_train.py", 4, ["--out", str(tmp_path), "--", *GPT_MODEL, *gpt_data, *RUN,
             "--train.save", str(ckpt)], cwd=tmp_path)  # fmt: skip
    saved = torch.load(tmp_path / "logits.pt")
    tokens, expected = saved["tokens"], saved["logits"]

    assert main(["consolidate", "--load", str(ckpt), "--out", str(tmp_path / "model.pt")]) == 0
    model = build_gpt(load_config(GPT_MODEL), 1024).eval()
    missing, unexpected = model.load_state_dict(torch.load(tmp_path / "model.pt"), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    compare("convert tp2pp2", "consolidated TP1 logits", logits, expected)

    assert main(["export-hf", "--load", str(ckpt), "--out", str(tmp_path / "hf"), *GPT_MODEL]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    compare("convert tp2pp2", "HF GPT-2 logits", hf_logits, expected)

    prompt = tokens[:, :8]
    ours = prompt
    with torch.no_grad():
        for _ in range(10):
            step = model(ours, torch.arange(ours.shape[1]).expand_as(ours), None)[:, -1].argmax(
                -1, keepdim=True
            )
            ours = torch.cat([ours, step], dim=1)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)  # fmt: skip
    assert torch.equal(theirs, ours)
