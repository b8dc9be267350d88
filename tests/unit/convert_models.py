"""Shared pieces of the conversion tests (tests/unit/test_convert.py, test_hf_export.py): the test GPT's
settings, a synthetic checkpoint writer, a GPT for the test tokenizer, logits and greedy decoding.
Their fixtures (gpt, full_state, corpus_docs, spm_model, lm) are in tests/unit/conftest.py.
"""

from __future__ import annotations

import json
import shutil

import torch

from megahet.checkpointing.convert import (
    ShardLayout,
    shard,
)
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import load_config

MODEL = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_attention_heads", "4",
         "--model.seq_length", "32"]  # fmt: skip
VOCAB = 256
PIECES = 512  # the test tokenizer's vocabulary (the `lm` GPT's)


def write_checkpoint(root, state, tp, pp, iteration=5, tokenizer=None, **meta_extra):
    """A checkpoint folder as megahet writes one (model states only), with `tokenizer` as tokenizer.model."""
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    for p, shards in enumerate(shard(state, tp, pp, layout=ShardLayout.recorded(meta_extra))):
        for t, module in enumerate(shards):
            torch.save({"module": module}, folder / model_states_file(p * tp + t))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / "tokenizer.model")
    layout = {"tp": tp, "pp": pp, "dp": 1, "zero_stage": 1}
    meta = {
        "iteration": iteration,
        "consumed_samples": 4 * iteration,
        "layout": layout,
        "files": {p.name: p.stat().st_size for p in folder.iterdir()},
        **meta_extra,
    }
    (folder / "megahet.json").write_text(json.dumps(meta))
    (root / "latest").write_text(folder.name)
    return folder


def gpt_for_pieces(args):
    """(cfg, eval model, its tensors, its state_dict() as DeepSpeed saves it) of a GPT for PIECES tokens."""
    from megahet.models.gpt import build_gpt

    cfg = load_config(args)
    model = build_gpt(cfg, PIECES).eval()
    full = model.state_dict()
    state = {k: v.detach().clone() for k, v in full.items() if torch.is_tensor(v)}
    return cfg, model, state, {k: state.get(k, v) for k, v in full.items()}


def logits_of(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def greedy(model, prompt, steps):
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, logits_of(model, tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens
