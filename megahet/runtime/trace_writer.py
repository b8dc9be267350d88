"""A JSONL trace that a resumed run continues: one JSON object per step, flushed as it is written.

Role: runtime (reporting: the balancers' per-step traces, `--balance.trace`).

    trace = TraceWriter(trace_path("run.jsonl", "dp"))   # run_dp.jsonl
    trace.resume_from = 11          # a resumed run: keep the saved run's rows of steps < 11
    trace.write({"step": 11, ...})  # opens the file at its first row
    trace.close()                   # -> the path, or None when nothing was written

Rows after the checkpoint's step, from a run that was killed later, are dropped when the first new row
is written; nothing is touched before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def trace_path(path: str, tag: str | None) -> Path:
    """`--balance.trace run.jsonl` -> the trace of one writer: run_<tag>.jsonl (dp, pp, packing, stage1
    ...), or run.jsonl itself when tag is None (the TP balancer's trace without pipeline stages)."""
    path = Path(path).expanduser()
    return path if tag is None else path.with_name(f"{path.stem}_{tag}{path.suffix}")


class TraceWriter:
    def __init__(self, path: Path):
        self.path = path
        self.resume_from = 0
        """The first step this run writes; earlier rows of an existing file are kept."""
        self._file = None

    def write(self, row: dict) -> None:
        trace = self._file or self._open()
        trace.write(json.dumps(row) + "\n")
        trace.flush()

    def _open(self):
        """The file, opened at its first row: new, or on resume the saved run's rows continued."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.resume_from > 0 and self.path.is_file():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] < self.resume_from]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)  # the saved rows survive a crash at any moment
        self._file = self.path.open("a")
        return self._file

    def close(self) -> Path | None:
        """Close the file; its path if this run wrote rows."""
        if self._file is None:
            return None
        self._file.close()
        self._file = None
        return self.path
