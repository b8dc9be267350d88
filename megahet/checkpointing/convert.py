"""Checkpoint conversion: megahet (DeepSpeed, any TP x PP) -> one unsharded state dict, or a weights-only
megahet checkpoint at another TP x PP (the Hugging Face and ViT exports are in hf_export.py).

Role: tooling (offline checkpoint conversion, behind tools/convert_checkpoint.py; reshard also runs
inside training for elastic restarts and pipeline re-splits).

    state, meta = consolidate("ckpt")                  # DIR (its `latest`) or DIR/iter_NNNNNNN
    reshard("ckpt", "ckpt_tp4", tp=4, pp=1)            # pretrain_gpt.py --train.load ckpt_tp4 --parallel.tp 4
    python tools/convert_checkpoint.py consolidate --load ckpt --out model.pt
    python tools/convert_checkpoint.py export-hf --load ckpt --out hf_dir [--config run.yaml | --model.* ...]
    python tools/convert_checkpoint.py reshard --load ckpt --out ckpt_tp4 --tp 4 --pp 1

Reads only the per-rank `mp_rank_XX_model_states.pt` files (plain torch.load, no process group).
DeepSpeed's model-parallel rank is pp_rank * tp + tp_rank (megatron-core orders TP fastest). TP shards
merge along each parameter's partition dim (column-parallel weights/biases, the vocab-parallel
embedding: dim 0; row-parallel weights: dim 1; everything else is replicated); a stage's local layer
indexes become global ones; the last stage's tied `output_layer.weight` copy is dropped. The result is
fp32, named as the TP=1 PP=1 model names it (no `_extra_state` entries). A bf16 / fp16 run's model
states hold rounded weights: its fp32 masters are merged from the ZeRO shards by DeepSpeed's
zero_to_fp32, per model-parallel rank.

`reshard` merges the same way, re-pads the GPT vocabulary for the new TP if needed, splits with
`shard` and writes the per-rank module states (megatron-core's `_extra_state` entries kept, so that
DeepSpeed's strict load accepts them) as a weights-only checkpoint: checkpoint.save_weights_only;
the source's tokenizer.model is carried over.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import torch

from megahet.checkpointing.checkpoint import TOKENIZER_FILES, save_weights_only
from megahet.checkpointing.finder import LATEST, META
from megahet.checkpointing.optimizer_state import TENSOR_KEYS, one_adam_step, read_zero_state
from megahet.checkpointing.safe_load import load_file
from megahet.compat.deepspeed_checkpoint import model_states_file, zero_fp32_masters, zero_shard_files
from megahet.config import ConfigError, ModelConfig
from megahet.models.gpt import padded_vocab_size
from megahet.policy.reshard_plan import FIRST_STAGE, LAYER_NAME, TIED_COPY, WORD_EMBEDDING, partition_dim
from megahet.policy.stage_split import check_split


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a model's TP shards are laid out beyond each parameter's partition dim.

    gated: SwiGLU's fc1 holds [gate; up] rows on every rank (megatron-core's layout), so the unsharded
    fc1 is [all gates; all ups], not the ranks' blocks one after the other. tied: the last stage's
    `output_layer.weight` is a copy of the word embedding (dropped on merge, recreated on shard);
    untied, it is a parameter of its own."""

    gated: bool = False
    tied: bool = True

    @classmethod
    def of(cls, m: ModelConfig | None) -> ShardLayout:
        if m is None:
            return cls()
        return cls(gated=m.activation == "swiglu", tied=not m.untie_embeddings_and_output_weights)

    @classmethod
    def recorded(cls, meta: dict) -> ShardLayout:
        """The layout a checkpoint's megahet.json records (older checkpoints: GPT-2's, the only one then)."""
        model = meta.get("model") or {}
        return cls(
            gated=model.get("activation", "gelu") == "swiglu",
            tied=not model.get("untie_embeddings_and_output_weights", False),
        )

    def is_gated(self, name: str) -> bool:
        return self.gated and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"))


def merge_tp_shards(parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    """TP shards -> the unsharded tensor; gated fc1: [gate_0; up_0], [gate_1; up_1] -> [gates; ups]."""
    if not gated:
        return torch.cat(parts, dim=dim)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)


def split_tp_shards(tensor: torch.Tensor, tp: int, dim: int, gated: bool) -> list[torch.Tensor]:
    """The inverse of merge_tp_shards."""
    if not gated:
        return list(torch.chunk(tensor, tp, dim=dim))
    gate, up = (half.chunk(tp, dim=dim) for half in tensor.chunk(2, dim=dim))
    return [torch.cat([g, u], dim=dim) for g, u in zip(gate, up)]


def num_layers_of(state: dict) -> int:
    return 1 + max(int(m.group(1)) for k in state if (m := LAYER_NAME.match(k)))


def find_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """(checkpoint folder, its megahet.json) for DIR (follows DIR/latest) or DIR/iter_NNNNNNN."""
    root = Path(path).expanduser()
    folder = root / (root / LATEST).read_text().strip() if (root / LATEST).is_file() else root
    if not (folder / META).is_file():
        what = (
            "not found"
            if not root.exists()
            else f"is not a complete megahet checkpoint ({folder / META} missing)"
        )
        raise ConfigError(f"--load: {path} {what}: point it at a folder written by --train.save")
    try:
        meta = json.loads((folder / META).read_text())
        tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"--load: {folder / META} is corrupt (not megahet's JSON)") from None
    for rank in range(tp * pp):
        if not (folder / model_states_file(rank)).is_file():
            raise ConfigError(f"--load: checkpoint {folder} is incomplete: {model_states_file(rank)} missing")
    return folder, meta


def _read_module(file: Path) -> dict:
    states = load_file(file, what="--load")
    if not isinstance(states, dict) or "module" not in states:
        raise ConfigError(f"--load: {file} has no module state (not a DeepSpeed model states file)")
    return dict(states["module"])  # tensors, and megatron-core's `_extra_state` entries (None)


def _with_fp32_masters(module: dict, folder: Path, mp_rank: int) -> dict:
    """bf16 / fp16 training keeps the exact weights only as ZeRO's fp32 masters: use those."""
    if all(v.dtype == torch.float32 for v in module.values() if torch.is_tensor(v) and v.is_floating_point()):
        return module
    if not zero_shard_files(folder, mp_rank):
        raise ConfigError(
            f"--load: {folder} has no ZeRO optimizer shards for mp_rank_{mp_rank:02d}: cannot recover fp32 weights"
        )
    masters = zero_fp32_masters(folder, mp_rank, functools.partial(load_file, what="--load"))
    return {k: masters.get(k, v) if torch.is_tensor(v) else v for k, v in module.items()}


def read_stages(folder: Path, meta: dict) -> list[list[dict]]:
    """The checkpoint's module state dicts, [pp_rank][tp_rank], checked to hold the same names per
    stage; a bf16 / fp16 run's weights are its fp32 masters."""
    tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    stages = [
        [
            _with_fp32_masters(_read_module(folder / model_states_file(p * tp + t)), folder, p * tp + t)
            for t in range(tp)
        ]
        for p in range(pp)
    ]
    for p, shards in enumerate(stages):
        if any(set(s) != set(shards[0]) for s in shards):
            raise ConfigError(f"--load: checkpoint {folder}: TP ranks of stage {p} hold different parameters")
    return stages


def merge_shards(stages: list[list[dict]], layout: ShardLayout = ShardLayout()) -> dict:
    """stages[pp_rank][tp_rank]: rank-local state dicts -> the unsharded TP=1 PP=1 state (fp32 tensors;
    non-tensor entries such as megatron-core's `_extra_state` are taken from TP rank 0)."""
    out: dict[str, torch.Tensor] = {}
    first_layer = 0
    for pp_rank, shards in enumerate(stages):
        local_layers = {int(m.group(1)) for k in shards[0] if (m := LAYER_NAME.match(k))}
        for name in shards[0]:
            if name == TIED_COPY and layout.tied and len(stages) > 1 and pp_rank > 0:
                continue  # the last stage's copy of the tied word embedding
            match = LAYER_NAME.match(name)
            full = f"decoder.layers.{first_layer + int(match.group(1))}.{match.group(2)}" if match else name
            if not torch.is_tensor(shards[0][name]):
                out[full] = shards[0][name]
                continue
            parts = [s[name].float() for s in shards]
            dim = partition_dim(full)
            if dim is None:
                if any(not torch.equal(parts[0], p) for p in parts[1:]):
                    raise ConfigError(
                        f"--load: {name} (stage {pp_rank}) differs across TP ranks: cannot merge it"
                    )
                out[full] = parts[0].clone()
            else:
                out[full] = merge_tp_shards(parts, dim, layout.is_gated(full))
        first_layer += len(local_layers)
    return out


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The checkpoint's unsharded fp32 state dict (tensors only) and its megahet.json."""
    folder, meta = find_checkpoint(path)
    merged = merge_shards(read_stages(folder, meta), ShardLayout.recorded(meta))
    return {k: v for k, v in merged.items() if torch.is_tensor(v)}, meta


def shard(
    state: dict,
    tp: int,
    pp: int,
    stage_layers: tuple[int, ...] | None = None,
    layout: ShardLayout = ShardLayout(),
) -> list[list[dict]]:
    """The inverse of merge_shards for a GPT/ViT state: [pp_rank][tp_rank] rank-local state dicts
    (layers split over stages as `stage_layers` says, evenly by default; the tied output copy on the
    last stage of a GPT when PP > 1; non-tensor entries are replicated as they are)."""
    num_layers = num_layers_of(state)
    if stage_layers is None:
        if num_layers % pp:
            raise ConfigError(
                f"{num_layers} layers cannot be split evenly over PP={pp} stages: give the split"
            )
        stage_layers = (num_layers // pp,) * pp
    try:
        check_split(stage_layers, num_layers, pp)
    except ValueError as err:
        raise ConfigError(
            f"stage layers {list(stage_layers)} are not a split of {num_layers} layers over PP={pp}: {err}"
        ) from None
    owner = [(stage, local) for stage, n in enumerate(stage_layers) for local in range(n)]
    stages = [[{} for _ in range(tp)] for _ in range(pp)]
    for name, tensor in state.items():
        match = LAYER_NAME.match(name)
        if match:
            stage, local = owner[int(match.group(1))]
            targets = [(stage, f"decoder.layers.{local}.{match.group(2)}")]
        elif name.startswith(FIRST_STAGE):
            targets = [(0, name)]
            if name == "embedding.word_embeddings.weight" and pp > 1 and layout.tied:
                targets.append((pp - 1, TIED_COPY))
        else:  # final layernorm, ViT head
            targets = [(pp - 1, name)]
        dim = partition_dim(name) if torch.is_tensor(tensor) else None
        if dim is not None and tensor.shape[dim] % tp:
            raise ConfigError(f"{name}: dim {dim} of size {tensor.shape[dim]} cannot be split over TP={tp}")
        parts = split_tp_shards(tensor, tp, dim, layout.is_gated(name)) if dim is not None else [tensor] * tp
        for stage, local in targets:
            for t in range(tp):
                stages[stage][t][local] = parts[t].clone() if torch.is_tensor(parts[t]) else parts[t]
    return stages


# --- resharding into a weights-only megahet checkpoint ------------------------------------------


def model_settings(meta: dict, given: ModelConfig | None, command: str) -> ModelConfig:
    """The model settings megahet.json records (checkpoints saved since they are recorded), else the
    ones given on the command line (--config / --model.*)."""
    recorded = meta.get("model")
    if recorded is not None:
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in recorded.items() if k in known})
    if given is None:
        raise ConfigError(
            f"{command}: the checkpoint does not record its model settings (saved by an older megahet): "
            f"pass the run's --config and/or --model.* settings"
        )
    return given


def check_reshard(m: ModelConfig, tp: int, pp: int, stage_layers: tuple[int, ...] | None = None) -> None:
    """tp must split the model's attention heads and MLP units evenly, and pp its layers (evenly, or
    as `stage_layers` says)."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"reshard: --tp {tp} --pp {pp}: both must be >= 1")
    if stage_layers is not None:
        try:
            check_split(stage_layers, m.num_layers, pp)
        except ValueError as err:
            raise ConfigError(f"reshard: --stage-layers {err}") from None
    checks = [
        ("attention heads", m.num_attention_heads, tp, "--tp"),
        ("key/value heads (model.num_query_groups)", m.query_groups, tp, "--tp"),
        ("MLP hidden units (ffn)", m.ffn_size, tp, "--tp"),
    ]
    if stage_layers is None:
        checks.append(("layers", m.num_layers, pp, "--pp"))
    for what, size, ways, flag in checks:
        if size % ways:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            raise ConfigError(
                f"reshard: {size} {what} cannot be split evenly over {flag} {ways}: choose {flag} from {divisors}"
                + (" or give the layers per stage (--stage-layers)" if flag == "--pp" else "")
            )


def resharded_vocab_rows(rows: int, m: ModelConfig, src_tp: int, tp: int, vocab_size: int | None) -> int:
    """The word embedding's rows at TP=tp: the tokenizer's vocabulary padded as build_gpt pads it.

    The checkpoint holds the vocabulary padded for src_tp (`rows`); the real vocabulary V is one of
    (rows - divisible_by * src_tp, rows]. When those V pad to different sizes at tp, V must be given.
    """
    d = m.make_vocab_size_divisible_by
    if vocab_size is not None:
        if padded_vocab_size(vocab_size, d, src_tp) != rows:
            raise ConfigError(
                f"reshard: --vocab-size {vocab_size} pads to {padded_vocab_size(vocab_size, d, src_tp)} rows at "
                f"TP {src_tp}, the checkpoint has {rows}: pass the tokenizer's vocabulary size"
            )
        return padded_vocab_size(vocab_size, d, tp)
    sizes = sorted({padded_vocab_size(v, d, tp) for v in range(max(1, rows - d * src_tp + 1), rows + 1)})
    if len(sizes) > 1:
        raise ConfigError(
            f"reshard: the checkpoint's {rows} embedding rows are its vocabulary padded for TP {src_tp}; at TP "
            f"{tp} it pads to one of {sizes} rows depending on the tokenizer's vocabulary: pass --vocab-size V "
            f"(the tokenizer's size; data.vocab_size for the shipped corpus)"
        )
    return sizes[0]


def repad_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """(V_padded, h) -> (rows, h): drop padding rows, or add copies of the last row (as Megatron's
    checkpoint converter does); the real tokens' rows, and so their logits, are unchanged."""
    if rows <= weight.shape[0]:
        return weight[:rows].clone()
    return torch.cat([weight, weight[-1:].expand(rows - weight.shape[0], -1)])


def reshard(path: str | Path, out: str | Path, tp: int, pp: int, **options) -> tuple[Path, dict, float]:
    """Write the checkpoint's weights as a weights-only megahet checkpoint for TP=tp x PP=pp into the
    new folder `out` (loadable with --train.load out --parallel.tp tp --parallel.pp pp at any DP).
    `options` are reshard_into's: `model`, settings for checkpoints that do not record theirs;
    `vocab_size`, the tokenizer's vocabulary, needed only when the new TP's padding is ambiguous;
    `optimizer`, also carry the ZeRO optimizer state (fp32 masters, Adam moments and step) and the LR
    schedule, per parameter, so that training continues exactly (up to reduction order).
    Returns (folder, meta, seconds)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out: {out} exists and is not empty: choose a new folder (saved data is never overwritten)"
        )
    folder, meta = find_checkpoint(path)
    return reshard_into(folder, meta, out, tp, pp, **options)


def resharded_stages(
    state: dict,
    m: ModelConfig,
    src_tp: int,
    tp: int,
    pp: int,
    vocab: int | None,
    split: tuple[int, ...] | None,
) -> list[list[dict]]:
    """An unsharded state (TP=1 PP=1 names) -> [pp_rank][tp_rank] state dicts, the GPT vocabulary
    re-padded for the new TP."""
    if WORD_EMBEDDING in state:  # GPT: the vocabulary is padded per TP size
        rows = resharded_vocab_rows(state[WORD_EMBEDDING].shape[0], m, src_tp, tp, vocab)
        state = {**state, WORD_EMBEDDING: repad_vocab(state[WORD_EMBEDDING], rows)}
        if TIED_COPY in state:  # untied: the output layer has the vocabulary's rows too
            state[TIED_COPY] = repad_vocab(state[TIED_COPY], rows)
    return shard(state, tp, pp, split, ShardLayout.of(m))


def _optimizer_stages(
    folder: Path,
    src: dict,
    m: ModelConfig,
    tp: int,
    pp: int,
    vocab: int | None,
    split: tuple[int, ...] | None,
):
    """The ZeRO optimizer state at TP=tp x PP=pp: [pp_rank][tp_rank] -> {key: {name: tensor}, "step", "lr",
    "lr_scheduler", "global_steps"}."""
    src_tp, src_pp = src["tp"], src["pp"]
    per_rank = [[read_zero_state(folder, p * src_tp + t) for t in range(src_tp)] for p in range(src_pp)]
    step = one_adam_step(folder, [rank["step"] for stage in per_rank for rank in stage])
    first = per_rank[0][0]
    shared = {"step": step, **{k: first[k] for k in ("lr", "lr_scheduler", "global_steps")}}
    out = [[dict(shared) for _ in range(tp)] for _ in range(pp)]
    for key in TENSOR_KEYS:
        merged = merge_shards([[rank[key] for rank in stage] for stage in per_rank], ShardLayout.of(m))
        for p, stage in enumerate(resharded_stages(merged, m, src_tp, tp, pp, vocab, split)):
            for t, tensors in enumerate(stage):
                out[p][t][key] = tensors
    return out


def reshard_into(
    folder: Path,
    meta: dict,
    root: Path,
    tp: int,
    pp: int,
    *,
    model: ModelConfig | None = None,
    vocab_size: int | None = None,
    optimizer: bool = False,
    stage_layers: tuple[int, ...] | None = None,
) -> tuple[Path, dict, float]:
    """reshard() of the checkpoint `folder` (its megahet.json `meta`) into a new checkpoint folder
    under `root` (published atomically beside any that are there; `root/latest` names it).
    `stage_layers`: layers per new pipeline stage (default: even)."""
    t0 = time.perf_counter()
    m = model_settings(meta, model, "reshard")
    split = tuple(stage_layers) if stage_layers is not None and pp > 1 else None
    check_reshard(m, tp, pp, split)
    state = merge_shards(read_stages(folder, meta), ShardLayout.of(m))
    if num_layers_of(state) != m.num_layers:
        raise ConfigError(
            f"reshard: the model settings say {m.num_layers} layers, the checkpoint has {num_layers_of(state)}: "
            f"pass the training run's --config"
        )
    src = meta["layout"]
    vocab = vocab_size if vocab_size is not None else meta.get("vocab_size")
    stages = resharded_stages(state, m, src["tp"], tp, pp, vocab, split)
    extra = {
        "model": dataclasses.asdict(m),
        "resharded_from": {"path": str(folder.resolve()), "layout": src},
    }
    if vocab is not None:
        extra["vocab_size"] = vocab
    optimizer_states = None
    if optimizer:
        if meta.get("weights_only"):
            raise ConfigError(f"reshard: {folder} is weights-only: it has no optimizer state to carry")
        optimizer_states = _optimizer_stages(folder, src, m, tp, pp, vocab, split)
    checkpoint = save_weights_only(
        root,
        stages,
        iteration=meta["iteration"],
        consumed_samples=meta["consumed_samples"],
        meta=extra,
        optimizer=optimizer_states,
        stage_layers=split,
        files=carried_files(folder),
    )
    new_meta = json.loads((checkpoint / META).read_text())
    return checkpoint, new_meta, time.perf_counter() - t0


# --- Hugging Face tokenizer -----------------------------------------------------------------------


def carried_files(folder: Path) -> dict[str, Path] | None:
    """The tokenizer files a checkpoint folder carries (TOKENIZER_FILES that are there), for a new one."""
    files = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
    return files or None


def checkpoint_tokenizer(path: str | Path) -> Path | None:
    """The tokenizer a checkpoint carries (DIR or DIR/iter_NNNNNNN): its SentencePiece model or its Hugging
    Face tokenizer.json; None (saved without one)."""
    folder, _ = find_checkpoint(path)
    files = carried_files(folder) or {}
    return files.get(TOKENIZER_FILES[0]) or files.get(TOKENIZER_FILES[1])
