"""Shared helpers of the benchmark scripts: result files (Markdown table + JSON), timing, launches."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from megahet.launch import free_port, launch_env, torchrun_cmd

RESULTS = Path(__file__).resolve().parent / "results"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_results(name: str, rows: list[dict], columns: list[str], meta: dict) -> Path:
    """Write results/<name>.json and results/<name>.md; print the table; return the folder."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown_table(rows, columns)
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)
    return RESULTS


def interleaved_medians(
    fns: dict[str, Callable[[], None]],
    repeats: int,
    warmup: int = 1,
    synchronize: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median wall time of each fn, measured round-robin so machine noise hits all alike; `synchronize`
    (e.g. megahet.platform.synchronize) waits for queued GPU work before each clock read."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            synchronize()
            t0 = time.perf_counter()
            fn()
            synchronize()
            samples[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


ROOT = RESULTS.parents[1]


def torchrun(script: str, nproc: int, args: list[str], log: Path) -> float:
    """Launch ROOT/script on `nproc` local ranks (gloo, OMP_NUM_THREADS=1, no W&B), its output streamed
    into `log` (readable while it runs, kept if it is killed); return the launch's wall time in seconds.
    A failed launch raises with the output's tail; a port taken between probe and bind (other jobs on
    the machine) is retried."""
    env = launch_env()
    log.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        cmd = [*torchrun_cmd(nproc, free_port()), script, *args]
        with log.open("w") as out:
            out.write(" ".join(cmd) + "\n")
            out.flush()
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            wall = time.perf_counter() - t0
        if proc.returncode == 0:
            return wall
        output = log.read_text()
        if "EADDRINUSE" not in output or attempt == 2:
            break
    raise RuntimeError(
        f"{script} with {nproc} ranks exited with {proc.returncode} (log {log}):\n{output[-3000:]}"
    )


def settings_to_args(
    settings: list[str], flag: str, reserved: tuple[str, ...] = (), why: str = ""
) -> list[str]:
    """KEY=VALUE settings (e.g. resize.selection=random) as megahet command-line overrides; a key in
    `reserved` (or under a reserved 'section.') is refused with `why`."""
    out = []
    for setting in settings:
        key, sep, value = (part.strip() for part in setting.partition("="))
        if not sep or not key:
            raise SystemExit(f"{flag} {setting!r}: expected KEY=VALUE, e.g. resize.priority_score=snr")
        if any(key == k or (k.endswith(".") and key.startswith(k)) for k in reserved):
            raise SystemExit(f"{flag} {key}: {why}")
        out += [f"--{key}", value]
    return out
