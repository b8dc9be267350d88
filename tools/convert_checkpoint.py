"""Convert a megahet checkpoint (any TP x PP): consolidate it, export it, or reshard it to another TP x PP.

    python tools/convert_checkpoint.py consolidate --load ckpt --out model.pt
    python tools/convert_checkpoint.py export-hf --load ckpt --out hf_gpt2 [--tokenizer spm.model]
    python tools/convert_checkpoint.py export-vit --load vit_ckpt --out vit_dir
    python tools/convert_checkpoint.py reshard --load ckpt --out ckpt_tp4 --tp 4 --pp 1 [--vocab-size V] [--with-optimizer]
    python tools/convert_checkpoint.py reshard --load ckpt --out ckpt_35 --tp 1 --pp 2 --stage-layers 3,5
    python tools/convert_checkpoint.py import-hf --hf hf_llama --out ckpt --tp 2 --pp 2 [--stage-layers 3,5]

`--load` is a --train.save folder (its `latest`) or one DIR/iter_NNNNNNN. `consolidate` writes one
unsharded fp32 state dict (TP=1 PP=1 names; torch.load it). `export-hf` writes a GPT2LMHeadModel with
the run's tokenizer (AutoTokenizer loads it): the checkpoint's tokenizer.model, or `--tokenizer` for
checkpoints saved without one. The exports and `reshard` need the run's model settings (attention
heads, LayerNorm epsilon, ...): checkpoints record them in megahet.json;
for older ones pass the training run's `--config` and/or `--model.*` overrides. `reshard` writes a new
weights-only checkpoint folder for `pretrain_*.py --train.load OUT --parallel.tp N --parallel.pp M`
(any DP): weights, step and data position carry over, the optimizer and LR schedule restart; with
`--with-optimizer` the ZeRO optimizer state (fp32 masters, Adam moments and step) and the LR schedule
carry over too, per parameter (what a resumed run does by itself when its layout changed).
`--vocab-size` (the tokenizer's vocabulary) is needed only when the GPT vocabulary's padding at the
new TP is ambiguous (the error says so). `import-hf` reads a transformers `LlamaForCausalLM` or
`GPT2LMHeadModel` folder (config.json, safetensors) into a weights-only checkpoint for TP x PP, and writes
the model settings it found to OUT/model.json: `pretrain_gpt.py --config OUT/model.json --train.load OUT
--parallel.tp T --parallel.pp P` trains on from it (megahet/checkpointing/hf_import.py). See
megahet/checkpointing/convert.py and docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megahet.checkpointing.convert import (
    checkpoint_tokenizer,
    consolidate,
    find_checkpoint,
    model_settings,
    reshard,
)
from megahet.checkpointing.finder import describe_layout
from megahet.checkpointing.hf_export import export_hf, export_vit
from megahet.checkpointing.hf_import import import_hf
from megahet.config import ConfigError, load_config


def _stage_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ConfigError(
            f"reshard: --stage-layers {text!r} is not comma-separated layer counts (e.g. 3,5)"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["consolidate", "export-hf", "export-vit", "reshard", "import-hf"])
    parser.add_argument("--load", help="checkpoint folder (DIR or DIR/iter_NNNNNNN); all but import-hf")
    parser.add_argument("--hf", type=Path, help="import-hf: a transformers save_pretrained folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--tp", type=int, help="reshard / import-hf: tensor-parallel size of the new checkpoint"
    )
    parser.add_argument(
        "--pp", type=int, help="reshard / import-hf: pipeline-parallel size of the new checkpoint"
    )
    parser.add_argument(
        "--stage-layers", help="reshard / import-hf: layers per new pipeline stage, L0,L1,... (default: even)"
    )
    parser.add_argument("--vocab-size", type=int, help="reshard: the tokenizer's vocabulary (GPT), if asked")
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="reshard: carry the ZeRO optimizer state and LR schedule",
    )
    parser.add_argument(
        "--tokenizer", type=Path, help="export-hf: the run's SentencePiece model, if the checkpoint has none"
    )
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "import-hf":
            return _import_hf(args)
        if args.load is None:
            raise ConfigError(f"{args.command} needs the checkpoint to read: pass --load DIR")
        given = load_config(rest).model if rest else None
        if given is not None and "model" in find_checkpoint(args.load)[1]:
            print(
                "convert_checkpoint: note: using the model settings the checkpoint records", file=sys.stderr
            )
        if args.command == "reshard":
            if args.tp is None or args.pp is None:
                raise ConfigError("reshard needs the new layout: pass --tp N --pp M")
            split = _stage_layers(args.stage_layers)
            folder, meta, seconds = reshard(
                args.load,
                args.out,
                args.tp,
                args.pp,
                model=given,
                vocab_size=args.vocab_size,
                optimizer=args.with_optimizer,
                stage_layers=split,
            )
            src = meta["resharded_from"]["layout"]
            what = (
                "with the optimizer state and LR schedule"
                if args.with_optimizer
                else "weights only (loading it restarts the optimizer)"
            )
            print(
                f"reshard: step {meta['iteration']}, {describe_layout(src)} -> {describe_layout(meta['layout'])}, "
                f"{what} -> {folder} in {seconds:.2f} s"
            )
            return 0
        state, meta = consolidate(args.load)
        if args.command == "consolidate":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.out)
        elif args.command == "export-hf":
            tokenizer = args.tokenizer or checkpoint_tokenizer(args.load)
            settings = model_settings(meta, given, "export-hf")
            export_hf(state, settings, args.out, tokenizer, vocab_size=meta.get("vocab_size"))
        else:
            export_vit(state, model_settings(meta, given, "export-vit"), args.out)
    except ConfigError as err:
        print(f"convert_checkpoint: error: {err}", file=sys.stderr)
        return 2
    layout = meta["layout"]
    print(f"{args.command}: step {meta['iteration']}, TP {layout['tp']} x PP {layout['pp']} -> {args.out}")
    return 0


def _import_hf(args) -> int:
    """import-hf: the checkpoint, and OUT/model.json with the model settings a run needs to load it."""
    if args.hf is None or args.tp is None or args.pp is None:
        raise ConfigError("import-hf needs the model and the layout: pass --hf DIR --tp N --pp M")
    checkpoint, meta, seconds = import_hf(
        args.hf, args.out, args.tp, args.pp, _stage_layers(args.stage_layers)
    )
    config = args.out / "model.json"
    config.write_text(json.dumps({"model": meta["model"]}, indent=1))
    layout = describe_layout(meta["layout"])
    print(
        f"import-hf: {meta['imported_from']['architecture']} from {args.hf} -> {layout} weights-only "
        f"checkpoint {checkpoint} in {seconds:.2f} s; train on with: pretrain_gpt.py --config {config} "
        f"--train.load {args.out} --parallel.tp {args.tp} --parallel.pp {args.pp}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
