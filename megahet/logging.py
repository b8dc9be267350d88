"""Training telemetry: one console line per log interval, Weights & Biases (offline by default), TensorBoard.

Role: runtime (reporting). The console line carries what a person reads at a glance: step, loss, lr,
grad norm, throughput, step time, the per-TP-rank plan (speed, gamma, moved) and the balancer's
efficiency E, the data-parallel shares (each replica's speed and micro-batches), the pipeline stages (each stage's
speed per layer and layers), and evaluation results. Every metric (per-rank compute and wait spreads, hook time,
estimated speeds, plan changes, block FLOPs, migration traffic, virtual-device charges) goes to W&B,
TensorBoard and the metrics file.

Only the logging rank (TP rank 0 of DP replica 0 on the last pipeline stage, where the loss is)
writes; every other rank gets a logger whose calls do nothing.

    logger = TrainingLogger(cfg, layout, run_name="gpt")
    logger.log(step, {"loss": 2.3, "lr": 1e-3, ...})
    records = read_metrics_file(path)      # a --logging.metrics_file by step (tests, benchmarks)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout


def read_metrics_file(path: Path) -> dict[int, dict[str, Any]]:
    """A --logging.metrics_file by step: every record of a step merged (a step logged twice, as by a resumed
    run: its last values)."""
    records: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record.pop("step"), {}).update(record)
    return records


# The metrics the console line prints, and how; evaluation results (val_*, test_*) print with 4
# significant digits; every other metric goes only to W&B, TensorBoard and the metrics file.
_CONSOLE_FORMAT = {
    "loss": "loss {:.4f}",
    "lr": "lr {:.3e}",
    "grad_norm": "grad norm {:.3f}",
    "tokens_per_s": "{:.0f} tokens/s",
    "samples_per_s": "{:.1f} samples/s",
    "step_time_s": "step {:.3f} s",
    "balance_eff": "E {:.3f}",
    "cp_kv_tokens": "cp kv {:.0f}",
}
# The plans, one value per TP rank (speed_tp0, ...), per DP replica (speed_dp0, share_dp0, ...) or per
# pipeline stage (speed_pp0, layers_pp0, ...); packed documents: each replica's predicted and measured
# seconds of the last step (pred_s_dp0, meas_s_dp0, ...); a dynamic CP placement's speed per CP rank (speed_cp0, ...)
_PER_RANK = re.compile(r"^(speed|gamma|moved|share|layers|pred_s|meas_s)_(tp|dp|pp|cp)\d+$")
_COUNTS = ("share", "layers")
_EVALUATION = ("val_", "test_")


def format_console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One line; per-rank plan metrics print as one field: speed_tp0, speed_tp1, ... as 'speed v0 v1',
    speed_dp0, ... as 'dp speed v0 v1', share_dp0, ... (micro-batches) as 'dp share n0 n1', speed_pp0 and
    layers_pp0, ... as 'pp speed v0 v1' and 'pp layers n0 n1'."""
    parts, per_rank = [f"step {step:>6}/{total}"], {}
    for key, value in metrics.items():
        match = _PER_RANK.match(key)
        if key not in _CONSOLE_FORMAT and not key.startswith(_EVALUATION) and not match:
            continue
        if match:
            field = match[1] if match[2] == "tp" else f"{match[2]} {match[1]}"
            if field not in per_rank:
                per_rank[field] = len(parts)
                parts.append(field)
            parts[per_rank[field]] += f" {value:.0f}" if match[1] in _COUNTS else f" {value:.2f}"
        else:
            parts.append(_CONSOLE_FORMAT.get(key, key + " {:.4g}").format(value))
    return " | ".join(parts)


class TrainingLogger:
    def __init__(self, cfg: MegahetConfig, layout: ParallelLayout, run_name: str):
        self.active = layout.is_logging_rank
        self.total = cfg.train.train_iters
        self._wandb = None
        self._tb = None
        self._metrics_file = None
        if not self.active:
            return
        log = cfg.logging
        run = log.wandb_run_name or run_name
        run_dir = Path(log.log_dir).expanduser() / run
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        if log.wandb and log.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(
                project=log.wandb_project,
                name=run,
                mode=log.wandb_mode,
                dir=str(run_dir),
                config=cfg.to_dict(),
                reinit="finish_previous",
            )
        if log.metrics_file:
            path = Path(log.metrics_file).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = path.open("a")
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(log.tensorboard_dir).expanduser() / run))

    def print(self, message: str) -> None:
        if self.active:
            print(message, flush=True)

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        if not self.active:
            return
        if console:
            print(format_console_line(step, self.total, metrics), flush=True)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
            self._metrics_file.flush()

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        if self._metrics_file is not None:
            self._metrics_file.close()
