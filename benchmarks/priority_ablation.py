"""Priority-selection ablation (issue 6): which score, and how much sampling, against random selection,
on the ViT's one-straggler cells of the accuracy study (TP=4, one 4x or 8x straggler) over three seeds.

    python benchmarks/priority_ablation.py                       # every variant (~35 min on 2 cores)
    python benchmarks/priority_ablation.py --variants snr-greedy,uniform

Each variant is `benchmarks/accuracy_study.py --priority-set ...` restricted to those cells, in its own
folder results/priority_ablation/<variant>_runs. The cells' baseline and random-selection runs, and
the shipped policy's priority runs, do not depend on the variant: they are copied from the accuracy
study's runs folder when it has them (`--resume` then reuses them) and launched otherwise.
Writes results/priority_ablation.{md,json}: per variant and cell the mean accuracy of priority and of
random selection over the seeds, the per-seed differences, their mean and its standard error, and
each variant's differences pooled over both cells.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, markdown_table
from benchmarks.selection_stats import SELECTION_COLUMNS, selection_comparison, standard_error, verdict

VARIANTS: dict[str, list[str]] = {
    "shipped": [],  # variance score, sampled at temperature 1
    "variance-greedy": ["resize.priority_temperature=0"],
    "snr-greedy": ["resize.priority_score=snr", "resize.priority_temperature=0"],
    "taylor-greedy": ["resize.priority_score=taylor", "resize.priority_temperature=0"],
    "uniform": ["resize.priority_temperature=1e6"],  # a uniform draw from priority's own random stream
}
CELLS = r"vit_tp4_1x[48]x_(baseline|resize-(priority|random))($|_seed)"
SEEDS = "7,99"


def run_variant(variant: str, out: Path, study_runs: Path) -> Path:
    folder = out / f"{variant}_runs"
    folder.mkdir(parents=True, exist_ok=True)
    if study_runs.is_dir():
        for file in study_runs.glob("vit_tp4_*"):
            wanted = "baseline" in file.name or "resize-random" in file.name
            wanted |= variant == "shipped" and "resize-priority" in file.name
            if wanted and not (folder / file.name).exists():
                shutil.copy2(file, folder / file.name)
    sets = [arg for setting in VARIANTS[variant] for arg in ("--priority-set", setting)]
    command = [sys.executable, str(ROOT / "benchmarks" / "accuracy_study.py"), "--out", str(out)]
    command += ["--name", variant, "--resume", "--selection-seeds", SEEDS, "--only", CELLS, *sets]
    subprocess.run(command, check=True)
    return out / f"{variant}.json"


def summarize(variant: str, result: Path) -> tuple[list[dict], dict]:
    rows = json.loads(result.read_text())["rows"]
    cells = [c for c in selection_comparison(rows) if c["model"] == "vit" and c["tp"] == 4]
    table = [
        {
            "variant": variant,
            "overrides": " ".join(VARIANTS[variant]) or "(defaults)",
            **{k: c[k] for k in ("profile", *SELECTION_COLUMNS)},
        }
        for c in cells
    ]
    diffs = [d for c in cells for d in c["pairs"]]
    pooled = {"variant": variant, "pairs": len(diffs), "difference": statistics.fmean(diffs)}
    pooled.update(se=standard_error(diffs), verdict=verdict("val_acc", diffs))
    return table, pooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "priority_ablation")
    parser.add_argument("--study-runs", type=Path, default=RESULTS / "accuracy_study_runs")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: pick from {', '.join(VARIANTS)}")
    rows, pooled = [], []
    for variant in variants:
        table, total = summarize(variant, run_variant(variant, args.out, args.study_runs))
        rows += table
        pooled.append(total)
    columns = ["variant", "overrides", "profile", *SELECTION_COLUMNS]
    text = "\n".join(
        [
            "**Priority variants against random selection, ViT TP=4, val_acc (priority - random per seed)**",
            "",
            markdown_table(rows, columns),
            "",
            "**Pooled over both cells**",
            "",
            markdown_table(pooled, ["variant", "pairs", "difference", "se", "verdict"]),
            "",
        ]
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "priority_ablation.md").write_text(text)
    (RESULTS / "priority_ablation.json").write_text(json.dumps({"rows": rows, "pooled": pooled}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
