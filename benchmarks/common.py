"""Shared helpers of the benchmark scripts: result files (Markdown table + JSON) and timing."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

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
    fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median wall time of each fn, measured round-robin so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}
