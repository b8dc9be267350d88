"""Loading a checkpoint file runs no code from it.

`torch.load` with `weights_only=True` unpickles only tensors, containers and plain values, plus the
classes allowed here: what megahet's own files hold (nothing more: RNG states are saved as lists and
tensors; NumPy's array types are allowed so that files written before that still load) and what
DeepSpeed pickles into its optimizer files (megahet/compat/deepspeed_checkpoint.py). A file that holds
anything else is refused with one line naming the file and the type, before any of it is built.

Every read of a checkpoint goes through `load_file`: megahet's rank files and per-parameter optimizer
files, DeepSpeed's model and ZeRO files (through the engine's checkpoint engine), zero_to_fp32's reads
and the conversion tools'.
"""

from __future__ import annotations

import itertools
import pickle
import pickletools
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

try:  # the name NumPy's pickles use: numpy._core from NumPy 2 on
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - NumPy 1
    from numpy.core.multiarray import _reconstruct

from megahet.compat.deepspeed_checkpoint import SAVED_TYPES
from megahet.config import ConfigError

_NUMPY_TYPES = (np.ndarray, np.dtype, np.dtypes.UInt32DType, _reconstruct)
ALLOWED: tuple = (*SAVED_TYPES, *_NUMPY_TYPES)
"""The classes and functions a checkpoint file may name, beyond torch's own weights-only set."""

# What torch.load raises for a truncated or corrupt file (zip reader, pickle, short reads).
BAD_FILE = (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError)


def _refused(path: Path, what: str, err: Exception) -> ConfigError | None:
    """The one-line error for a file that names a type outside the allow-list (None: another error)."""
    found = re.search(r"GLOBAL (\S+)", str(err)) or re.search(r"Unsupported (?:global|class) (\S+)", str(err))
    if found is None:
        return None
    return ConfigError(
        f"{what}: checkpoint file {path} holds a {found.group(1).rstrip(':,.')} object, which megahet does not "
        f"load (unpickling it could run code): use a checkpoint that megahet or DeepSpeed wrote"
    )


def _plain_pickle(path: Path, what: str) -> ConfigError | None:
    """The one-line error for a plain pickle (not torch's zip format), naming the first global it would
    import, read from its opcodes without running any (None: not a plain pickle)."""
    try:
        if zipfile.is_zipfile(path):
            return None
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":  # pickle's PROTO opcode (protocols 2-5)
                return None
            f.seek(0)
            strings, named = [], None
            for op, arg, _ in itertools.islice(pickletools.genops(f), 100_000):
                if op.name == "GLOBAL":
                    named = str(arg).replace(" ", ".")
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    named = f"{strings[-2]}.{strings[-1]}"
                elif isinstance(arg, str):
                    strings.append(arg)
                if named:
                    break
    except (OSError, ValueError, pickle.UnpicklingError):
        return None
    holds = f"names {named}" if named else "holds no torch data"
    return ConfigError(
        f"{what}: checkpoint file {path} is a plain pickle, not a torch checkpoint, and {holds}, which megahet "
        f"does not load (unpickling it could run code): use a checkpoint that megahet or DeepSpeed wrote"
    )


def unreadable(path, what: str, err: Exception) -> ConfigError:
    """The one-line error for a truncated or corrupt file."""
    lines = str(err).strip().splitlines()
    detail = lines[0][:160] if lines else type(err).__name__
    return ConfigError(
        f"{what}: checkpoint file {path} cannot be read ({detail}): it is truncated or corrupt"
    )


def load_file(path, *, what: str = "train.load", map_location="cpu", mmap: bool = False):
    """The object saved in `path`, loaded with weights_only=True and megahet's allow-list."""
    try:
        with torch.serialization.safe_globals(list(ALLOWED)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except BAD_FILE as err:
        refused = _refused(Path(path), what, err) if isinstance(err, pickle.UnpicklingError) else None
        refused = refused or _plain_pickle(Path(path), what)
        raise (refused or unreadable(path, what, err)) from None
