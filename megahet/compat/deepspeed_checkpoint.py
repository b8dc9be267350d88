"""DeepSpeed's checkpoint files, read without running code from them.

DeepSpeed reads its files with `torch.load(..., weights_only=False)`: through the engine's
`checkpoint_engine.load` (model and ZeRO optimizer states) and through `deepspeed.utils.zero_to_fp32`
(fp32 masters of a bf16 / fp16 run). Both are routed here through megahet's loader
(`megahet/checkpointing/safe_load.py`: `weights_only=True` and an allow-list), for the length of one
load only; nothing stays replaced.

It also names DeepSpeed's checkpoint files (its layout, which megahet's resharding and conversion
read directly): `mp_rank_MM_model_states.pt` per TP x PP rank and `[bf16_]zero_pp_rank_D_mp_rank_MM_
optim_states.pt` per DP rank of it.

Private API used (checked by tests/unit/test_compat.py):
- the file names above, and the model states file's keys `module`, `param_shapes`, `lr_scheduler`
  and `global_steps`;
- `DeepSpeedEngine.checkpoint_engine.load(path, map_location)`;
- `deepspeed.utils.zero_to_fp32` calling `torch.load` (module global `torch`);
- the classes ZeRO-1/2 pickles into `*_optim_states.pt`: `LossScaler` / `DynamicLossScaler`,
  `ZeroStageEnum`, `fragment_address`.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

SAVED_TYPES: tuple[type, ...] = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
"""The classes DeepSpeed's ZeRO-1/2 optimizer pickles into its checkpoint files (plain data)."""

Loader = Callable[..., object]  # (path, map_location=...) -> the file's object

ZERO_MARK = "zero_pp_rank_"


def model_states_file(mp_rank: int) -> str:
    """DeepSpeed's per TP x PP rank file (mp_rank = pp_rank * tp + tp_rank): module weights, client state."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_shard_files(folder: Path, mp_rank: int) -> list[Path]:
    """The ZeRO optimizer files of one model-parallel rank in `folder` (any DP rank, any prefix), in DP order."""
    return sorted(folder.glob(f"*{ZERO_MARK}*_mp_rank_{mp_rank:02d}_optim_states.pt"), key=zero_dp_rank)


def zero_dp_rank(file: Path) -> int:
    """The DP rank of a ZeRO optimizer file."""
    return int(file.name.split(ZERO_MARK)[1].split("_")[0])


def zero_file_kind(file: Path) -> str:
    """A ZeRO optimizer file's prefix: "" (ZeRO-1/2) or "bf16_" (BF16_Optimizer)."""
    return file.name.split(ZERO_MARK)[0]


@contextlib.contextmanager
def engine_loads_with(engine, load: Loader) -> Iterator[None]:
    """Within the block, the engine reads every checkpoint file with `load(path, map_location=...)`."""
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.load

    def through(path, map_location=None, *args, **kwargs):
        return load(path, map_location=map_location)

    ckpt_engine.load = through
    try:
        yield
    finally:
        ckpt_engine.load = original


def zero_fp32_masters(folder: Path, mp_rank: int, load: Loader) -> dict[str, torch.Tensor]:
    """The fp32 master weights of one model-parallel rank, merged from its ZeRO shards over DP by
    DeepSpeed's own zero_to_fp32, which reads model-parallel rank 00 only: it is shown this rank's files
    under that name, through links in a temporary folder. Its reads go through `load`."""
    suffix = f"mp_rank_{mp_rank:02d}"
    with tempfile.TemporaryDirectory() as tmp:
        tag = Path(tmp) / "tag"
        tag.mkdir()
        (tag / model_states_file(0)).symlink_to(folder / model_states_file(mp_rank))
        for shard_file in zero_shard_files(folder, mp_rank):
            (tag / shard_file.name.replace(suffix, "mp_rank_00")).symlink_to(shard_file)
        return zero_fp32_state_dict(Path(tmp), "tag", load)


def zero_fp32_state_dict(folder: Path, tag: str, load: Loader) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 merge of the ZeRO shards in folder/tag into fp32 weights, its reads
    made with `load(path, map_location=..., mmap=...)` (zero_to_fp32 calls the module's `torch.load`)."""
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.torch

    class _Torch:  # zero_to_fp32's view of torch: torch itself, but for load
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def load(path, map_location=None, mmap=False, weights_only=None, **kwargs):
            return load(path, map_location=map_location, mmap=mmap)

    zero_to_fp32.torch = _Torch()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its progress
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    finally:
        zero_to_fp32.torch = original
