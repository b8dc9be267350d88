"""Convert a megahet checkpoint (any TP x PP): consolidate it, or export it to Hugging Face GPT-2.

    python tools/convert_checkpoint.py consolidate --load ckpt --out model.pt
    python tools/convert_checkpoint.py export-hf --load ckpt --out hf_gpt2 --config run.yaml
    python tools/convert_checkpoint.py export-vit --load vit_ckpt --out vit_dir --config run.yaml

`--load` is a --train.save folder (its `latest`) or one DIR/iter_NNNNNNN. `consolidate` writes one
unsharded fp32 state dict (TP=1 PP=1 names; torch.load it). `export-hf` also needs the run's model
settings the weights do not carry (attention heads, LayerNorm epsilon): pass the training run's
`--config` and/or `--model.*` overrides. See megahet/convert.py and docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megahet.config import ConfigError, load_config
from megahet.convert import consolidate, export_hf, export_vit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["consolidate", "export-hf", "export-vit"])
    parser.add_argument("--load", required=True, help="checkpoint folder (DIR or DIR/iter_NNNNNNN)")
    parser.add_argument("--out", required=True, type=Path)
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest)
        state, meta = consolidate(args.load)
        if args.command == "consolidate":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.out)
        elif args.command == "export-hf":
            export_hf(state, cfg.model, args.out)
        else:
            export_vit(state, cfg.model, args.out)
    except ConfigError as err:
        print(f"convert_checkpoint: error: {err}", file=sys.stderr)
        return 2
    layout = meta["layout"]
    print(f"{args.command}: step {meta['iteration']}, TP {layout['tp']} x PP {layout['pp']} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
