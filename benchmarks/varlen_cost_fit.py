"""How well the document cost model predicts packed micro-batches it was never fitted on (issue 28).

    python benchmarks/varlen_cost_fit.py                 # ~2 min on one core
    python benchmarks/varlen_cost_fit.py --mix web --max-tokens 1024 --packs 40

One process (TP = PP = DP = 1, gloo, pinned to one core), the GPT of benchmarks/varlen_efficiency.py:
1. the start-up profile exactly as training runs it (megahet/runtime/packing.py: forward only on the
   probe packs, x3 for the backward), and, for comparison, the same probes timed forward + backward and
   fitted directly;
2. `--packs` packed micro-batches of real documents (the corpus re-cut at the `--mix` lengths, packed in
   random order up to the cap), each timed forward + backward (median of `--repeats`);
3. the first `--refine` of them play the measured steps the trainer refits on (`refit_doc_cost`), the
   others are held out.
Reported: each model's a, b, c and its mean absolute % error (MAPE) on the held-out packs; goal <= 10 %
on CPU for the model training uses (profile refined by measured steps).

Writes benchmarks/results/varlen_cost_fit.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import save_results
from megahet.launch import free_port

COLUMNS = ["model", "a", "b", "c", "mape_held_out"]


def _time_pack(model, lengths: list[int], repeats: int) -> float:
    """Median seconds of forward + backward of one pack of synthetic documents of these lengths."""
    from megahet.runtime.packing import synthetic_pack

    g = torch.Generator().manual_seed(sum(lengths))
    tokens, positions, params = synthetic_pack(lengths, 1000, torch.device("cpu"), g)
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(tokens, positions, None, labels=tokens, packed_seq_params=params).sum().backward()
        if i > 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def held_out_packs(pieces, cap: int, count: int, seed: int) -> list[list[int]]:
    """`count` packs of real document lengths: documents in a random order, a new pack when the next does not fit."""
    order = np.random.default_rng(seed).permutation(len(pieces))
    packs, pack, used = [], [], 0
    for i in order:
        s = int(pieces.lengths[i])
        if used + s > cap:
            packs.append(pack)
            pack, used = [], 0
            if len(packs) == count:
                break
        pack.append(s)
        used += s
    return packs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mix", default="code", choices=("documents", "web", "code"))
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--packs", type=int, default=32)
    parser.add_argument("--refine", type=int, default=8, help="packs that play the measured steps")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)

    import pretrain_gpt
    from megahet.config import MegahetConfig, apply_overrides
    from megahet.data.documents import DocumentPieces
    from megahet.data.tokenizer import SentencePieceTokenizer
    from megahet.models.gpt import build_gpt
    from megahet.parallel import initialize_parallel
    from megahet.policy.cost_fit import (
        CostSample,
        fit_doc_cost,
        mean_abs_pct_error,
        probe_lengths,
        refit_doc_cost,
    )
    from megahet.runtime.packing import profile_doc_cost

    cfg = apply_overrides(
        MegahetConfig(),
        {
            "model.seq_length": args.max_tokens,
            "data.packing": "documents",
            "data.max_tokens": args.max_tokens,
            "data.length_mix": args.mix,
            "train.micro_batch_size": 1,
        },
    )
    initialize_parallel(1, 1, cfg.train.seed)
    pretrain_gpt.prepare(cfg)
    prefix, tokenizer_model = pretrain_gpt.data_paths(cfg)
    vocab = SentencePieceTokenizer(tokenizer_model).vocab_size
    model = build_gpt(cfg, vocab)
    profile, probes, seconds = profile_doc_cost(model, cfg, vocab)
    full_probes = [
        CostSample.of(p, _time_pack(model, p, args.repeats)) for p in probe_lengths(args.max_tokens)
    ]
    pieces = DocumentPieces.from_split(
        prefix, split=cfg.data.split, name="train", max_tokens=args.max_tokens, mix=args.mix
    )
    packs = held_out_packs(pieces, args.max_tokens, args.packs, seed=7)
    timed = [CostSample.of(p, _time_pack(model, p, args.repeats)) for p in packs]
    measured, held_out = timed[: args.refine], timed[args.refine :]
    models = {
        "profile (forward x3, as at start-up)": profile,
        "profile refined by measured packs (as in training)": refit_doc_cost(profile, probes, measured),
        "probes timed forward + backward": fit_doc_cost(full_probes),
    }
    rows = [
        {"model": name, "a": c.a, "b": c.b, "c": c.c, "mape_held_out": mean_abs_pct_error(c, held_out)}
        for name, c in models.items()
    ]
    meta = {
        **vars(args),
        "profile_s": seconds,
        "held_out_packs": len(held_out),
        "held_out_tokens_mean": statistics.fmean(s.tokens for s in held_out),
        "goal": "MAPE <= 10 % on CPU for the refined model",
    }
    save_results("varlen_cost_fit", rows, COLUMNS, meta)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
