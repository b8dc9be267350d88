"""Command line of the multi-job test workers: `--out DIR --job NAME=FIELD:...:"overrides" ... -- common`.

Each `--job` names one run and carries `fields` colon-separated fields (task, mode, ...) before its own
config overrides; everything after `--` is given to every job. The workers run as scripts, so this
file, beside them, is importable as `jobargs`.

    args, jobs = parse_jobs(sys.argv[1:], ["task"])   # --job vit=vit:"--resize.selection priority"
    for name, (task,), overrides in jobs: ...
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path


def parse_jobs(
    argv: list[str], fields: list[str], parser: argparse.ArgumentParser | None = None
) -> tuple[argparse.Namespace, list[tuple[str, tuple[str, ...], list[str]]]]:
    """(options, [(name, field values, common + the job's own overrides)]) in the order given.
    `parser`: a worker's own options beside --out and --job."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    shape = ":".join([*(f.upper() for f in fields), '"extra overrides"'])
    parser.add_argument("--job", action="append", required=True, help=f"NAME={shape}")
    args = parser.parse_args(argv[:split])
    common, jobs = argv[split + 1 :], []
    for spec in args.job:
        name, sep, rest = spec.partition("=")
        values = []
        for _ in fields:
            value, colon, rest = rest.partition(":")
            values.append(value)
            sep = sep and colon
        if not (sep and name):
            parser.error(f"--job {spec!r}: expected NAME={shape}")
        jobs.append((name, tuple(values), common + shlex.split(rest)))
    return args, jobs
