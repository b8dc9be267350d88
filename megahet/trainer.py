"""The Trainer: one training step (and evaluation) over megatron-core's schedule and the DeepSpeed engine.

Role: runtime (the training loop).

A step: zero grads -> megatron-core's forward/backward schedule (1F1B when PP > 1) over this DP
rank's micro-batches, calling the DeepSpeed engine as the model -> finalize gradients (tied
embeddings across pipeline stages) -> `engine.step()` (ZeRO reduction, clipping, AdamW, LR).
Evaluation runs the same schedule forward-only. The step hooks (megahet/runtime/hooks.py) run around
it; set-up and the CLI are megahet/training.py.

    trainer = setup(cfg, spec)          # megahet/training.py
    history = trainer.train()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megahet.checkpointing import checkpoint
from megahet.config import ConfigError, MegahetConfig
from megahet.logging import TrainingLogger
from megahet.parallel import ParallelLayout
from megahet.policy.dp_shares import even_shares, replica_loss_scale
from megahet.runtime.hooks import StepHook
from megahet.runtime.timing import CommClock, ComputeTimers, StepTimes
from megahet.task import Task


class ScheduledEngine:
    """The DeepSpeed engine as megatron-core's schedule expects a model to look.

    The schedule must call the engine (its forward registers DeepSpeed's backward hooks on the
    outputs), but it reads `model.config` as megatron-core's TransformerConfig, which on the
    engine is DeepSpeed's own config. Attributes it unwraps (`set_input_tensor`, `model_type`) are
    found through `.module`, as with megatron-core's DDP wrapper.
    """

    def __init__(self, engine):
        self.module = engine
        self.config = engine.module.config

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def finalize_grads(model: torch.nn.Module) -> None:
    """All-reduce the tied word-embedding gradient between the first and last pipeline stage."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    weight = model.shared_embedding_or_output_weight()
    if weight is not None and weight.grad is not None:
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


class Trainer:
    def __init__(
        self,
        cfg: MegahetConfig,
        task: Task,
        engine,
        layout: ParallelLayout,
        logger: TrainingLogger,
        step_hooks: list | None = None,
    ):
        self.cfg, self.task, self.engine, self.layout, self.logger = cfg, task, engine, layout, logger
        self.step_hooks = step_hooks or []
        """Objects with before_forward_backward(step), before_step(engine), after_step(engine)."""
        self.extra_hooks: tuple[StepHook, ...] = ()
        """The caller's own hooks among step_hooks (pretrain's extra_hooks): a rebuild adds them again."""
        t = cfg.train
        self.shares = even_shares(t.global_batch_size // t.micro_batch_size, layout.dp_size)
        """Micro-batches of every global batch per DP replica (megahet/policy/dp_shares.py; even by default)."""
        self.num_microbatches = self.shares[layout.dp_rank]
        """This replica's share: the micro-batches the schedule runs per step."""
        self.loss_scale = 1.0
        """Factor on this replica's training losses so that every sample weighs the same (1 when even)."""
        self.step_plan = None
        """With packed documents: the current global batch's plan (megahet/data/packed.py StepPlan); the
        losses are token sums, scaled by DP / the global batch's tokens so every token weighs the same."""
        self.clock = CommClock()
        self.timers = ComputeTimers(self.clock)
        self.times = StepTimes(0.0, 0.0, 0.0)
        """The last step's own compute, collective waits, own compute inside the transformer layers, own
        time in the optimizer step and reading data (megahet/runtime/timing.py)."""
        model_config = task.model.config
        model_config.timers = self.timers
        model_config.finalize_model_grads_func = lambda *args, **kwargs: finalize_grads(task.model)
        self.schedule = get_forward_backward_func()
        self.scheduled = ScheduledEngine(engine)
        self.iteration = 0
        self.step_t0 = time.perf_counter()
        """When the current step began (hooks time whole steps with it)."""
        self.hooks_s = 0.0
        """Wall time of this step spent in the step hooks (balancer, resizer, virtual device)."""
        self.start_iteration, self.start_sample = 0, 0
        """Where this run started (a resumed checkpoint's iteration and consumed samples)."""
        self.pending_split: tuple[int, ...] | None = None
        """Layers per pipeline stage a hook asked for (`request_split`): training stops after the step
        and `pretrain()` re-splits (megahet/runtime/resplit.py)."""
        self.pending_layout: tuple[int, tuple[int, ...], bool] | None = None
        """The TP size, DP shares and placement (strided TP groups) an escalation asked for (`request_layout`):
        training stops after the step and `pretrain()` moves to TP x DP in place (megahet/runtime/relayout.py)."""
        self.last_saved = -1
        """The step of this trainer's last checkpoint in train.save."""
        self.build_s = 0.0
        """Seconds the stage model and engine took to build (set by megahet.training.build_trainer)."""
        self.rebuild_s = 0.0
        """Seconds of setup() a move to another layout does again, the slowest rank's: megatron-core's groups,
        and the model's and engine's build (set by megahet.training.setup; 0 on a Trainer a move built)."""
        self.last_resplit = None
        """The re-split that built this Trainer, measured (megahet/runtime/resplit.py ResplitCost), if any."""
        self.plan = None
        """The run plan this Trainer executes (megahet/run_plan.py: set by build_trainer)."""

    def request_split(self, split: tuple[int, ...]) -> None:
        """Stop training after this step so that the stages are re-split to `split` (every rank asks for
        the same split at the same step: the pipeline balancer decides on numbers gathered over all)."""
        self.pending_split = tuple(split)

    def request_layout(self, tp: int, shares: tuple[int, ...], strided: bool = False) -> None:
        """Stop training after this step and move to TP `tp` x DP (world / TP) in place, its replicas starting
        from these micro-batch shares, its TP groups strided over the ranks or not (every rank asks at the
        same step: the escalation decides on numbers gathered over all)."""
        self.pending_layout = (tp, tuple(shares), strided)

    @property
    def pending_move(self) -> bool:
        """A hook asked for a re-split or another layout: training stops after the step."""
        return self.pending_split is not None or self.pending_layout is not None

    def set_shares(self, shares: tuple[int, ...]) -> None:
        """Give replica r shares[r] micro-batches of every global batch from the next step on: this
        replica's data stream, schedule, loss scale and the hooks that count micro-batches follow."""
        data = self.task.train_data
        if tuple(shares) != self.shares and not hasattr(data, "set_shares"):
            raise ConfigError(
                "uneven data-parallel shares need the task's train_data to be a megahet.data.sampling "
                "stream (micro_batches(...)): build it with micro_batches or use hetero.dp_shares=even"
            )
        if hasattr(data, "set_shares"):
            data.set_shares(shares)
        self.shares = tuple(shares)
        self.num_microbatches = self.shares[self.layout.dp_rank]
        self.loss_scale = replica_loss_scale(self.num_microbatches, sum(self.shares), self.layout.dp_size)
        for hook in self.step_hooks:
            hook.set_shares(self.shares)

    def set_replica_speeds(self, speeds: tuple[float, ...]) -> None:
        """Packed documents: plan the next global batches for replicas of these speeds (fastest = 1)."""
        self.task.train_data.set_speeds(speeds)

    def replica_work(self) -> float:
        """What this replica's step held, in the units its speed is measured in: the predicted cost at speed 1
        of its packed micro-batches, else its micro-batch count."""
        if self.step_plan is None:
            return float(self.shares[self.layout.dp_rank])
        return self.step_plan.replica_work(self.layout.pp_size)[self.layout.dp_rank]

    def _begin_packed_step(self) -> None:
        """Plan the next global batch of packed documents (the same plan on every rank) and follow it: this
        replica's micro-batch count, the hooks that count micro-batches, the per-token loss scale."""
        plan = self.task.train_data.begin_step()
        self.step_plan = plan
        counts = plan.counts
        if counts != self.shares:
            self.shares = counts
            for hook in self.step_hooks:
                hook.set_shares(counts)
        self.num_microbatches = counts[self.layout.dp_rank]
        # Each micro-batch's loss is its token sum; DeepSpeed averages the replicas' gradients (/ DP).
        self.loss_scale = self.layout.dp_size / plan.tokens

    def _scaled_forward_step(self, data: Iterator[dict], model) -> tuple[torch.Tensor, Callable]:
        """The task's forward step with its loss times `loss_scale` (megatron-core divides it by this
        replica's micro-batch count, and DeepSpeed averages over replicas; the product is 1 / M per
        micro-batch whatever the split). The reported loss values are left as they are."""
        output, loss_func = self.task.forward_step(data, model)
        scale = self.loss_scale
        if scale == 1.0:
            return output, loss_func

        def scaled_loss(*args, **kwargs):
            loss, *rest = loss_func(*args, **kwargs)
            return (loss * scale, *rest)

        return output, scaled_loss

    def _run_schedule(self, data: Iterator[dict], num_microbatches: int, forward_only: bool) -> list[dict]:
        return self.schedule(
            forward_step_func=self.task.forward_step if forward_only else self._scaled_forward_step,
            data_iterator=data,
            model=self.scheduled,
            num_microbatches=num_microbatches,
            seq_length=self.task.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size,
            forward_only=forward_only,
        )

    def forward_backward(self) -> list[dict]:
        """Zero the gradients and run the schedule over one global batch; gradients are then final
        (tied embeddings reduced) but not yet reduced over DP. Returns the last stage's loss dicts."""
        t0 = time.perf_counter()
        for hook in self.step_hooks:
            hook.before_forward_backward(self.iteration)
        if self.task.packed:
            self._begin_packed_step()
        self.hooks_s += time.perf_counter() - t0
        self.engine.zero_grad()
        data = _TimedData(self.task.train_data, self.clock)
        return self._run_schedule(data, self.num_microbatches, forward_only=False)

    def train_step(self, sync: bool = True) -> dict[str, float]:
        """One optimizer step; returns {loss, lr, grad_norm, step_time_s, compute_s, wait_s, hooks_s}
        (loss on the last stage). With sync=False the loss and grad norm stay device tensors, so that the
        host does not wait for the GPU every step: train() reads them only when it logs (`as_floats`)."""
        t0 = self.step_t0 = time.perf_counter()
        self.hooks_s = 0.0
        self.clock.read()  # drop what evaluation measured
        with self.clock.installed():  # torch.distributed's collectives are timed within the step only
            outputs = self.forward_backward()
            t1 = time.perf_counter()
            for hook in self.step_hooks:
                hook.before_step(self.engine)
            t2 = time.perf_counter()
            with self.clock.phase("optimizer"):  # its own time: the fixed work no plan moves
                self.engine.step()
        t3 = time.perf_counter()
        self.times = self.clock.read()  # on a GPU: CUDA events, read once per step
        for hook in self.step_hooks:
            hook.after_step(self.engine)
        self.hooks_s += t2 - t1 + time.perf_counter() - t3
        self.iteration += 1
        # Packed: every micro-batch reports its token sum, averaged over the global batch's tokens.
        denominator = self.step_plan.tokens if self.step_plan is not None else sum(self.shares)
        loss = _mean_over_dp([out["loss"] for out in outputs], denominator) if outputs else float("nan")
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            "loss": loss,
            "lr": self.engine.get_lr()[0],
            "grad_norm": grad_norm if grad_norm is not None else float("nan"),
            "step_time_s": time.perf_counter() - t0,
            "compute_s": self.times.compute_s,
            "wait_s": self.times.wait_s,
            "optimizer_s": self.times.optimizer_s,
            "hooks_s": self.hooks_s,
        }
        if self.step_plan is not None:
            record["tokens"] = self.step_plan.tokens
        return as_floats(record) if sync else record

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Forward-only pass over eval_iters micro-batches per DP rank; summed metrics -> summary."""
        self.engine.eval()
        with contextlib.ExitStack() as stack:
            for hook in self.step_hooks:
                stack.enter_context(hook.evaluation())
            outputs = self._run_schedule(self.task.eval_data(), self.cfg.train.eval_iters, forward_only=True)
        self.engine.train()
        if not self.layout.is_last_stage:
            return {}
        keys = sorted(outputs[0])
        sums = torch.tensor([sum(float(out[k]) for out in outputs) for k in keys], dtype=torch.float64)
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        return self.task.eval_summary(dict(zip(keys, sums.tolist())))

    def train(self) -> list[dict[str, float]]:
        """Run train_iters steps with logging and evaluation; returns the per-step records. Returns early,
        after the step, when a re-split or another layout is asked for (`pending_move`)."""
        t = self.cfg.train
        history, window = [], []
        while self.iteration < t.train_iters and not self.pending_move:
            record = self.train_step(sync=False)
            history.append(record)
            window.append(record)
            last = self.iteration == t.train_iters or self.pending_move
            if self.iteration % t.log_interval == 0 or last:
                for item in window:  # the only host reads of the loss and grad norm, once per log line
                    as_floats(item)
                self.logger.log(self.iteration, self._interval_metrics(window))
                window = []
            if self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters:
                summary = self.evaluate()
                if summary:
                    self.logger.log(self.iteration, summary)
                    history[-1].update(summary)
            if t.save and (
                self.iteration == t.train_iters or (t.save_interval and self.iteration % t.save_interval == 0)
            ):
                self.save()
        return history

    def save(self) -> None:
        """Save a checkpoint of this step into train.save (every rank calls it)."""
        path, seconds = checkpoint.save(self.checkpoint_parts(), self.progress())
        self.last_saved = self.iteration
        self.logger.print(f"megahet: saved checkpoint {path} (step {self.iteration}) in {seconds:.2f} s")

    def checkpoint_parts(self) -> checkpoint.CheckpointParts:
        """What a checkpoint of this Trainer saves and restores (megahet/checkpointing/checkpoint.py)."""
        return checkpoint.CheckpointParts(
            self.cfg, self.layout, self.engine, tuple(self.step_hooks), self.task.vocab_size,
            self.task.tokenizer_model, self.logger.print,
        )  # fmt: skip

    def progress(self) -> checkpoint.Progress:
        """The step done and the samples consumed up to it (from where this run started)."""
        start = checkpoint.Progress(self.start_iteration, self.start_sample)
        return start.advanced(self.iteration - self.start_iteration, self.cfg.train.global_batch_size)

    def resume_at(self, progress: checkpoint.Progress) -> None:
        """Go on from a loaded checkpoint's progress."""
        self.iteration = self.start_iteration = progress.iteration
        self.start_sample = progress.consumed_samples

    def _interval_metrics(self, window: list[dict[str, float]]) -> dict[str, float]:
        step_time = sum(r["step_time_s"] for r in window) / len(window)
        samples_per_s = self.cfg.train.global_batch_size / step_time
        last = window[-1]
        metrics = {"loss": sum(r["loss"] for r in window) / len(window), "lr": last["lr"]}
        if "tokens" in last:  # packed documents: the steps' own token counts
            metrics["tokens_per_s"] = sum(r["tokens"] for r in window) / (step_time * len(window))
        elif self.task.tokens_per_sample > 1:
            metrics["tokens_per_s"] = samples_per_s * self.task.tokens_per_sample
        else:
            metrics["samples_per_s"] = samples_per_s
        mine = {
            key: sum(r[f"{key}_s"] for r in window) / len(window) for key in ("compute", "wait", "optimizer")
        }
        hooks = {k: v for hook in self.step_hooks for k, v in hook.metrics().items()}
        spread = min_max_over_ranks({**mine, **hooks})  # one all-reduce for all of them
        metrics.update(grad_norm=last["grad_norm"], step_time_s=step_time)
        for key in mine:
            metrics[f"{key}_min_s"], metrics[f"{key}_max_s"] = spread[key]
        if self.step_hooks:  # the balancer's and resizer's own cost, this rank
            metrics["hooks_s"] = sum(r["hooks_s"] for r in window) / len(window)
        for key in hooks:
            metrics[f"{key}_min"], metrics[f"{key}_max"] = spread[key]
        for hook in self.step_hooks:
            metrics.update(hook.report())  # this rank's view, e.g. its TP group's plan, not reduced
        return metrics


class _TimedData:
    """The training data as the schedule reads it: every micro-batch read is timed as the clock's `data`
    phase (a part of the fixed work, megahet/runtime/timing.py)."""

    def __init__(self, data: Iterator[dict], clock: CommClock):
        self.data, self.clock = data, clock

    def __iter__(self) -> _TimedData:
        return self

    def __next__(self) -> dict:
        with self.clock.phase("data"):
            return next(self.data)


def min_max_over_ranks(values: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(min, max) over all ranks of each of this rank's values, by one MAX all-reduce of (-v, v)."""
    both = torch.tensor([x for v in values.values() for x in (-v, v)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return {key: (-float(both[2 * i]), float(both[2 * i + 1])) for i, key in enumerate(values)}


def _mean_over_dp(values: list[torch.Tensor], denominator: int) -> torch.Tensor:
    """The sum of every replica's micro-batch values over `denominator` (the global batch's micro-batches, or
    its tokens when the values are token sums; replicas may hold different numbers of micro-batches): a
    0-dim tensor, not read back to the host."""
    total = torch.stack([v.detach().float() for v in values]).sum()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return total / denominator


def as_floats(record: dict) -> dict:
    """A step record's tensors (loss, grad norm) as Python floats, in place; returns the record."""
    for key, value in record.items():
        if torch.is_tensor(value):
            record[key] = float(value)
    return record
