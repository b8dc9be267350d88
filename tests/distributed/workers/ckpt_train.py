"""Worker: pretrain_gpt runs for the checkpoint tests, one or more per launch (same processes, regrouped).

    torchrun --nproc_per_node 2 ckpt_train.py --out DIR --job plain="--parallel.tp 1 ..." \
        [--job resized="..."] [--slow 0.3] [--fault resized:6:1 ...] -- <common config overrides>

Each run is `setup(cfg, pretrain_gpt.SPEC, extra_hooks)` then `train_to_end`, as `pretrain()` does
(re-splitting the stages when the pipeline balancer asks). With
--slow S every step sleeps S seconds after the optimizer step (a stateless step hook), so that a test
can SIGKILL the launch between two checkpoints. With --fault NAME:WHEN:RANK (one per torchrun restart
k: the k-th applies in attempt k) that rank SIGKILLs itself in the middle of step WHEN of run NAME, or,
with WHEN "move", when the first re-split's state move starts (megahet/runtime/resplit.py). With
--return-at S an escalated job is sent back to its own layout by the escalation's decision on step S (the
ladder's way back, forced once: on this host TP 1 x DP 2 is faster than TP 2 even calm, so the real ladder
never takes it). After each run every rank saves its model's tensors
(local names, after loading and training) as DIR/<run>_rank<R>.pt and {"iteration", "start", "initialized"}
with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from jobargs import parse_jobs
from megatron.core import parallel_state as ps

import pretrain_gpt
from megahet.config import load_config
from megahet.models.common import initializes
from megahet.policy.escalation import Decision, EscalationLadder
from megahet.runtime import resplit
from megahet.runtime.hooks import StepHook
from megahet.training import setup, train_to_end


class KillAt(StepHook):
    """A step hook that SIGKILLs this rank in the middle of `step` (after its forward and backward,
    before the optimizer step): a real crash, mid-collective for its peers."""

    def __init__(self, step: int):
        self.kill_step, self.step = step, 0

    def before_forward_backward(self, step: int) -> None:
        self.step = step

    def before_step(self, engine) -> None:
        if self.step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


class Sleep(StepHook):
    """A step hook that only slows training down."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def after_step(self, engine) -> None:
        time.sleep(self.seconds)


def fault_now(faults: list[str], name: str) -> str | None:
    """When this rank dies in run `name` (a step, or "move"): the fault of this torchrun attempt (the k-th
    --fault NAME:WHEN:RANK for restart k), if it is this run's and this rank's."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults):
        return None
    job, when, rank = faults[attempt].split(":")
    return when if job == name and int(rank) == int(os.environ["RANK"]) else None


def die_in_the_move() -> None:
    """SIGKILL this rank when a re-split's state move starts, while its peers are in theirs: it never
    sends what they wait for, nor receives what they send."""

    def exchange(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    resplit.exchange = exchange


def return_at(step: int) -> None:
    """Once the escalation has moved, its decision on step `step` or later is the way back (once), taken by
    the runtime as the ladder's own: the move back to the run's own layout."""
    decide, sent = EscalationLadder.decide, []

    def forced(ladder: EscalationLadder, obs) -> Decision:
        if ladder.moved and obs.step >= step and not sent:
            sent.append(obs.step)
            ladder.switch()
            return Decision(obs.step, "return", "the test sends it back", 0.0, obs.move_s, 0.0)
        return decide(ladder, obs)

    EscalationLadder.decide = forced


def run(name: str, argv: list[str], out: Path, slow: float, faults: list[str] = ()) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    hooks = [Sleep(slow)] if slow else []
    kill = fault_now(list(faults), name)
    if kill == "move":
        die_in_the_move()
    elif kill is not None:
        hooks.append(KillAt(int(kill)))
    trainer = setup(load_config(argv), pretrain_gpt.SPEC, extra_hooks=hooks)
    start = trainer.iteration
    trainer, _ = train_to_end(trainer, pretrain_gpt.SPEC)  # re-splits the stages when asked, as pretrain()
    trainer.logger.close()
    tensors = {
        k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items() if torch.is_tensor(v)
    }
    # whether the last stage built (at the start, a resume or a re-split) initialized its weights
    initialized = initializes(trainer.task.model.config)
    record = {"iteration": trainer.iteration, "start": start, "tensors": tensors, "initialized": initialized}
    torch.save(record, out / f"{name}_rank{dist.get_rank()}.pt")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--fault", action="append", default=[], help="NAME:STEP:RANK, one per restart")
    parser.add_argument("--return-at", type=int, default=None, help="force the escalation's way back")
    args, jobs = parse_jobs(argv, [], parser)
    if args.return_at is not None:
        return_at(args.return_at)
    for name, _, overrides in jobs:
        run(name, overrides, args.out, args.slow, args.fault)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
