"""The packed-document runtime: profile the document cost at start-up, refine it as training runs, report it.

Role: runtime (the step hook of data.packing=documents; the planner is megahet/policy/packing.py, the fit
megahet/policy/cost_fit.py, the stream megahet/data/packed.py).

- **Profile.** Before the first step (unless `data.doc_cost` fixes a, b, c or a checkpoint carries them)
  every rank times its own pipeline stage's forward, without gradients, on the packs of
  `probe_lengths(cap)` (the smallest replica token cap): one document of the cap, two of half, ... Stages feed themselves
  synthetic activations, so no stage waits for another; TP ranks run the same probes in step. A probe's
  time is summed over the stages and the fastest replica's is kept (one all-reduce each); a, b, c are
  fitted to 3x those forwards (forward + backward) and handed to the planner, the same on every rank.
- **Refine.** After every step each rank contributes its replica's features (sum of s^2, tokens and
  micro-batches of its step) and its compute time (an asynchronous all-gather, folded in at the next
  step). A replica's time is its stages' compute summed (the slowest TP rank of each), times its speed.
  Every `hetero.interval` steps the current model's mean absolute % error on the samples it never saw
  is recorded (`cost_mape`) and the model is refitted: step samples alone hardly tell a, b and c apart
  (every step holds a similar mix), so the profile's probes anchor the shape, rescaled by the median
  measured / predicted ratio of the last `data.cost_window` samples, and the measured samples join them
  in the fit; the refit is kept when it predicts the measured samples better than the rescaled profile.
- **Telemetry** (`report()`): per replica its tokens, sum of s^2, micro-batches, predicted and measured
  seconds of the last step; the step's slowest / mean predicted micro-batch (`mb_max_mean`; `mb_bound`: the least any
  packing could reach, the costliest single document over the mean) and the
  padding a static shape would need (`padding`); the model's a, b, c and held-out error. They go to the
  console, W&B and the metrics file like every report; with `--balance.trace run.jsonl` global rank 0
  also writes run_packing.jsonl, one row per step, and draws run_packing.png at the end (predicted and
  measured seconds, tokens and sum of s^2 per replica).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megahet.config import MegahetConfig
from megahet.config_checks import replica_caps
from megahet.models.attention import packed_documents
from megahet.models.context_parallel import packed_on_this_cp_rank
from megahet.parallel import ParallelLayout
from megahet.platform import cuda_available
from megahet.platform import device as process_device
from megahet.policy.cost_fit import (
    CostSample,
    fit_doc_cost,
    mean_abs_pct_error,
    probe_lengths,
    refit_doc_cost,
)
from megahet.policy.packing import DocCost
from megahet.runtime.hooks import MeasuringHook, StepContext
from megahet.runtime.trace_writer import TraceWriter, trace_path

BACKWARD_FACTOR = 3.0
"""Forward + backward over forward, for the start-up profile (refined from measured steps)."""


def _sync() -> None:
    if cuda_available():
        torch.cuda.synchronize()


def synthetic_pack(lengths: list[int], vocab: int, device: torch.device, generator: torch.Generator):
    """(tokens, position_ids, packed params) of one pack of random documents of these lengths, on `device`,
    as this rank holds it (with context parallelism: its chunks of every document): tokens and positions
    (1, t), positions restarting per document."""
    tokens = torch.randint(0, vocab, (1, int(sum(lengths))), generator=generator).to(device)  # (1, t)
    batch = {
        "tokens": tokens,
        "labels": tokens,
        "loss_mask": torch.ones(tokens.shape, device=device),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),  # (1, t)
        "cu_seqlens": torch.tensor(
            np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device
        ),
        "doc_lengths": list(lengths),
    }
    batch = packed_on_this_cp_rank(batch)
    return batch["tokens"], batch["position_ids"], packed_documents(batch["cu_seqlens"], batch["doc_lengths"])


@torch.no_grad()
def time_stage_forward(model, lengths: list[int], hidden_size: int, vocab: int, repeats: int = 2) -> float:
    """Seconds of this rank's stage forward on one pack of documents of these lengths (min of `repeats`
    after a warm-up); a stage that is not the first gets synthetic activations."""
    device = process_device()
    g = torch.Generator().manual_seed(int(sum(lengths)))
    tokens, positions, params = synthetic_pack(lengths, vocab, device, g)
    t = tokens.shape[1]  # this rank's tokens
    dtype = next(model.parameters()).dtype
    best = float("inf")
    for i in range(repeats + 1):
        if not ps.is_pipeline_first_stage():
            model.set_input_tensor(torch.randn(t, 1, hidden_size, generator=g).to(device, dtype))  # (t, 1, h)
        _sync()
        t0 = time.perf_counter()
        model(tokens, positions, None, labels=tokens, packed_seq_params=params)
        _sync()
        if i > 0:  # the first call warms up kernels and allocations
            best = min(best, time.perf_counter() - t0)
    if not ps.is_pipeline_first_stage():
        model.set_input_tensor(None)
    return best


def profile_doc_cost(model, cfg: MegahetConfig, vocab: int) -> tuple[DocCost, list[CostSample], float]:
    """The start-up profile (module docstring): (fitted cost, its samples, seconds it took); every rank
    gets the same cost."""
    t0 = time.perf_counter()
    packs = probe_lengths(
        min(replica_caps(cfg, ps.get_data_parallel_world_size()))
    )  # every replica holds them
    was_training = model.training
    model.eval()
    try:
        times = torch.tensor(
            [time_stage_forward(model, pack, cfg.model.hidden_size, vocab) for pack in packs],
            dtype=torch.float64,
        )
    finally:
        model.train(was_training)
    dist.all_reduce(times, group=ps.get_pipeline_model_parallel_group())  # the whole model: stages add up
    dist.all_reduce(times, op=dist.ReduceOp.MIN)  # the fastest replica's (speeds scale the others)
    samples = [CostSample.of(pack, BACKWARD_FACTOR * float(s)) for pack, s in zip(packs, times)]
    return fit_doc_cost(samples), samples, time.perf_counter() - t0


class PackingController(MeasuringHook):
    checkpointed = True
    split_free = True  # the cost model does not depend on the layers per stage
    # Settings that do not change what a document costs: a resume with other values keeps the saved model.
    settings_free = ("packing_strategy", "packing_tries", "cost_window", "length_mix", "split", "data_dir")

    def __init__(self, cfg: MegahetConfig, ctx: StepContext, layout: ParallelLayout, task, logger):
        self.cfg = cfg.data
        self.ctx, self.layout, self.task, self.logger = ctx, layout, task, logger
        self.stream = task.train_data
        self.interval, self.window = cfg.hetero.interval, cfg.data.cost_window
        self.fixed = cfg.data.doc_cost is not None
        self.run_cfg = cfg
        self.needs_profile = not self.fixed
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=self.window)
        """(sum s^2, tokens, micro-batches, seconds at speed 1) per replica and step, for the refit."""
        self.unseen: list[CostSample] = []
        """Samples since the last fit: the held-out error is measured on them."""
        self.mape = float("nan")
        self.profile_cost: DocCost | None = None
        self.probes: list[CostSample] = []
        """The start-up profile's fit and samples (they anchor every refit)."""
        self.last: dict[str, float] = {}
        self.plan_stats: dict[str, float] = {}
        """The last step's plan: slowest / mean predicted micro-batch, padding fraction at the token cap."""
        self.trace = (
            TraceWriter(trace_path(cfg.balance.trace, "packing"))
            if cfg.balance.trace and layout.rank == 0
            else None
        )

    @property
    def cost(self) -> DocCost:
        return self.stream.cost

    def before_forward_backward(self, step: int) -> None:
        self.step = step
        if self.needs_profile:
            self.needs_profile = False
            cost, samples, seconds = profile_doc_cost(
                self.task.model, self.run_cfg, self.task.vocab_size or 1
            )
            self.stream.set_cost(cost)
            self.profile_cost, self.probes = cost, samples
            self.logger.print(
                f"megahet: document cost a={cost.a:.3e} s/token^2, b={cost.b:.3e} s/token, c={cost.c:.3e} "
                f"s/micro-batch from {len(samples)} probes in {seconds:.2f} s (fit error "
                f"{100 * mean_abs_pct_error(cost, samples):.1f} %)"
            )
        self._collect()
        if (
            not self.fixed
            and step > 0
            and step % self.interval == 0
            and len(self.samples) >= 3 * self.interval
        ):
            self._refit()

    def after_step(self, engine) -> None:
        plan = self.ctx.step_plan
        if plan is None:
            return
        self.plan_stats = {
            "mb_max_mean": plan.micro_batch_spread(),
            "mb_bound": plan.micro_batch_bound(),
            "padding": plan.padding_fraction(self.stream.caps),
        }
        stats = plan.replica_stats()[self.layout.dp_rank]
        t = self.ctx.times
        mine = torch.tensor(
            [
                float(self.layout.dp_rank), float(self.layout.pp_rank), stats["sum_sq"], stats["tokens"],
                stats["micro_batches"], t.compute_s, t.compute_s + t.wait_s,
                self.stream.speeds[self.layout.dp_rank], plan.replica_work(self.layout.pp_size)[self.layout.dp_rank],
            ],
            dtype=torch.float64,
        )  # fmt: skip
        self._gather(mine)

    def _collect(self) -> None:
        gathered = self._take()
        if gathered is None:
            return
        rows, step, step_s = gathered
        compute: dict[tuple[int, int], float] = {}  # (dp, pp) -> slowest TP rank's compute
        region: dict[int, float] = {}
        features: dict[int, tuple[float, ...]] = {}
        for row in rows:
            dp, pp, sum_sq, tokens, micro, compute_s, region_s, speed, work = row
            dp, pp = int(dp), int(pp)
            compute[(dp, pp)] = max(compute.get((dp, pp), 0.0), compute_s)
            region[dp] = max(region.get(dp, 0.0), region_s)
            features[dp] = (sum_sq, tokens, micro, speed, work)
        last = {}
        for dp, (sum_sq, tokens, micro, speed, work) in sorted(features.items()):
            seconds = sum(v for (d, _), v in compute.items() if d == dp)  # the whole model's compute
            sample = CostSample(sum_sq, tokens, micro, seconds * speed)
            if seconds > 0:
                self.samples.append((sum_sq, tokens, micro, seconds * speed))
                self.unseen.append(sample)
            last.update(
                {
                    f"tokens_dp{dp}": tokens,
                    f"sum_sq_dp{dp}": sum_sq,
                    f"micro_batches_dp{dp}": micro,
                    f"pred_s_dp{dp}": work / speed,
                    f"meas_s_dp{dp}": region[dp],
                }
            )
        self.last = last
        if self.trace is not None:
            replicas = sorted(features)
            self.trace.write(
                {
                    "step": step,
                    "step_s": step_s,
                    "tokens": [features[r][1] for r in replicas],
                    "sum_sq": [features[r][0] for r in replicas],
                    "micro_batches": [features[r][2] for r in replicas],
                    "predicted_s": [last[f"pred_s_dp{r}"] for r in replicas],
                    "measured_s": [last[f"meas_s_dp{r}"] for r in replicas],
                    "cost": [self.cost.a, self.cost.b, self.cost.c],
                }
            )

    def _refit(self) -> None:
        if self.unseen:
            self.mape = mean_abs_pct_error(self.cost, self.unseen)
        best = refit_doc_cost(
            self.profile_cost or self.cost, self.probes, [CostSample(*s) for s in self.samples]
        )
        self.unseen = []
        self.stream.set_cost(best)

    def report(self) -> dict[str, float]:
        self._collect()
        c = self.cost
        return {
            **self.last,
            **self.plan_stats,
            "cost_a": c.a,
            "cost_b": c.b,
            "cost_c": c.c,
            "cost_mape": self.mape,
        }

    def state_dict(self) -> dict:
        self._collect()
        c = self.cost
        return {
            "cost": [c.a, c.b, c.c],
            "samples": [list(s) for s in self.samples],
            "unseen": [[s.sum_sq, s.tokens, s.micro_batches, s.seconds] for s in self.unseen],
            "mape": self.mape,
            "profile": None
            if self.profile_cost is None
            else [self.profile_cost.a, self.profile_cost.b, self.profile_cost.c],
            "probes": [[s.sum_sq, s.tokens, s.micro_batches, s.seconds] for s in self.probes],
        }

    def _plot(self, written: Path) -> None:
        from megahet.runtime.trace_plot import (
            plot_packing_trace,  # lazy: matplotlib, only when a trace is drawn
        )

        plot_packing_trace(written, written.with_suffix(".png"))

    def load_state_dict(self, state: dict) -> None:
        """The saved cost model and samples: a resumed run plans its next global batches as the killed one would."""
        self.stream.set_cost(DocCost(*state["cost"]))
        self.samples.clear()
        self.samples.extend(tuple(s) for s in state["samples"])
        self.unseen = [CostSample(*s) for s in state["unseen"]]
        self.mape = state["mape"]
        self.profile_cost = DocCost(*state["profile"]) if state["profile"] is not None else None
        self.probes = [CostSample(*s) for s in state["probes"]]
        self.needs_profile = False
