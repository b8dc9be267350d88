"""Worker: real pretrain_gpt runs in which one rank's optimizer step does extra real work (issue 31).

    torchrun --nproc_per_node 2 fixed_work_train.py --out DIR --slow-rank 1 --matmuls 60 \
        --job whole=gpt:"--balance.whole_step true" --job movable=gpt:"--balance.whole_step false" \
        -- <common config overrides>

On `--slow-rank`, a step pre-hook on the torch optimizer (the one DeepSpeed's ZeRO optimizer steps on
this rank's partition) multiplies two 256 x 256 matrices `--matmuls` times before every optimizer step:
real compute inside `engine.step()`, which megahet times as the rank's fixed work. Each job (in order,
regrouping the same processes) is one `pretrain()` with the common overrides plus its own; its
--logging.metrics_file is DIR/<name>.jsonl (the logging rank writes it), global rank 0 writes the
wall time of every step, from one step's start to the next one's (logging included), to
DIR/<name>_wall.json, and the slow rank the mean seconds its extra work took per step to
DIR/<name>_extra.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from jobargs import parse_jobs
from megatron.core import parallel_state as ps

import pretrain_gpt
from megahet.config import load_config
from megahet.runtime.hooks import StepHook
from megahet.training import pretrain


class SlowOptimizerStep(StepHook):
    """Registers, once, a pre-hook on the torch optimizer that does `matmuls` real matrix products; writes
    the mean wall seconds they took per training step to `path` (JSON) at the end of training."""

    def __init__(self, matmuls: int, path: Path):
        self.matmuls, self.registered, self.path = matmuls, False, path
        self.a = torch.randn(256, 256)
        self.seconds: list[float] = []

    def before_step(self, engine) -> None:
        self.seconds.append(0.0)  # this step's products (ZeRO may step the torch optimizer more than once)
        if self.registered:
            return
        optimizer = engine.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
        optimizer.register_step_pre_hook(lambda *args: self._work())
        self.registered = True

    def _work(self) -> None:
        start, x = time.perf_counter(), self.a
        for _ in range(self.matmuls):
            x = torch.tanh(x @ self.a)
        self.seconds[-1] += time.perf_counter() - start

    def close(self, final: bool = True) -> None:
        self.path.write_text(json.dumps(sum(self.seconds) / max(len(self.seconds), 1)))


class StepWallClock(StepHook):
    """Wall seconds from each step's start to the next one's; written as JSON at the end of training."""

    def __init__(self, path: Path):
        self.path, self.starts = path, []

    def before_forward_backward(self, step: int) -> None:
        self.starts.append(time.perf_counter())

    def close(self, final: bool = True) -> None:
        self.starts.append(time.perf_counter())
        self.path.write_text(json.dumps([b - a for a, b in zip(self.starts, self.starts[1:])]))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-rank", type=int, required=True)
    parser.add_argument("--matmuls", type=int, required=True)
    args, jobs = parse_jobs(argv, ["task"], parser)
    for name, _task, overrides in jobs:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        cfg = load_config([*overrides, "--logging.metrics_file", str(args.out / f"{name}.jsonl")])
        rank = int(os.environ["RANK"])  # torchrun's global rank
        slow = SlowOptimizerStep(args.matmuls, args.out / f"{name}_extra.json")
        hooks = [slow] if rank == args.slow_rank else []
        hooks += [StepWallClock(args.out / f"{name}_wall.json")] if rank == 0 else []
        pretrain(cfg, pretrain_gpt.SPEC, extra_hooks=hooks)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
