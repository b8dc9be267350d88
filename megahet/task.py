"""What a pretraining script plugs into megahet's training loop: a `TaskSpec` (checks before ranks
start, rank-0 data preparation, a builder) whose `build` returns this rank's `Task` (its pipeline stage,
data streams, forward step).

Role: runtime (the interface between a script and the loop).

    spec = TaskSpec(name="gpt", build=build_task, preflight=check_paths, vocab_size=tokenizer_vocab)
    run_cli(spec, sys.argv[1:])        # megahet/training.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from megahet.config import MegahetConfig
from megahet.parallel import ParallelLayout

ForwardStep = Callable[[Iterator[dict], torch.nn.Module], tuple[torch.Tensor, Callable]]


@dataclasses.dataclass
class Task:
    """What a pretraining script plugs into the loop, for this rank."""

    model: torch.nn.Module
    """This rank's pipeline stage (a megatron-core module with `config` and `set_input_tensor`)."""
    seq_length: int
    """Sequence length of the activations passed between pipeline stages: (seq, micro, hidden)."""
    train_data: Iterator[dict]
    """This DP rank's training micro-batches, in order, forever."""
    eval_data: Callable[[], Iterator[dict]]
    """A fresh iterator over this DP rank's validation micro-batches."""
    forward_step: ForwardStep
    """megatron-core forward_step_func: (data iterator, model) -> (output, loss_func)."""
    eval_summary: Callable[[dict[str, float]], dict[str, float]]
    """Summed evaluation metrics (over micro-batches and DP) -> reported metrics."""
    tokens_per_sample: int = 1
    step_hooks: Sequence = ()
    """Step hooks the task brings (megahet/runtime/hooks.py), run after megahet's and before the caller's;
    each is given the Trainer as its `ctx` (e.g. the CP placement's speed measurement)."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary (before padding), recorded in checkpoints for resharding."""
    tokenizer_model: str | None = None
    """The tokenizer's model file (GPT: SentencePiece), copied into checkpoints as tokenizer.model."""

    @property
    def packed(self) -> bool:
        """Whether train_data is a packed-document stream (megahet/data/packed.py): it plans every global
        batch (`begin_step`) and takes replica speeds (`set_speeds`)."""
        return hasattr(self.train_data, "begin_step")


@dataclasses.dataclass
class TaskSpec:
    name: str
    build: Callable[[MegahetConfig, ParallelLayout], Task]
    preflight: Callable[[MegahetConfig], None] = lambda cfg: None
    """Checks that need no process group (paths, data sizes); raise one-line errors."""
    prepare: Callable[[MegahetConfig], None] = lambda cfg: None
    """Run once on global rank 0 before the others build (e.g. tokenizer and data preparation)."""
    vocab_size: Callable[[MegahetConfig], int | None] = lambda cfg: None
    """The vocabulary this run's tokenizer has, known before any rank starts (None: the task has none),
    so that a checkpoint of another vocabulary is refused up front."""
