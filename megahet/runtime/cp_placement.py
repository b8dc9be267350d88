"""Context-parallel placement at run time (issue 45): each packed micro-batch's documents placed over the
CP ranks by predicted cost and CP rank speed, and those speeds measured.

Role: runtime (the placer pretrain_gpt's forward step calls, and its step hook; the planner is
megahet/policy/cp_placement.py, the layout and attention megahet/models/cp_placed.py).

- **Placement.** `placer(lengths)` plans one micro-batch with the packing's cost model as it stands (the
  stream's: profiled at start-up and refined, the same on every rank) and the current speeds, so every rank
  computes the same plan with no collective. It counts what the plan gives this rank: the predicted seconds
  of its slices (at speed 1) and the key / value tokens it receives.
- **Speeds.** Declared (`parallel.cp_speeds S0,S1,...`, fixed), or measured (`parallel.cp_speeds
  measured`): after every training step each rank's compute seconds (the Trainer's clock: collectives
  and the optimizer excluded) and its predicted seconds are gathered over its TP x CP group
  (asynchronously, folded in at the next step). A CP rank's time is its slowest TP rank's (they compute the
  same tokens), its speed the median over the last `balance.window` steps of predicted / measured, the
  fastest 1; every rank of the TP x CP group folds in the same gathered numbers, so the speeds, and the
  plans, stay the same on every rank that must agree. With pipeline stages the numbers are gathered over
  every rank: each stage's CP ranks are compared with each other, and a CP rank runs at its slowest
  stage's relative speed, so every stage places alike. A slow rank (another tenant on its core, an older
  GPU) is then given less of the next steps' work whatever made it slow.
- **Report.** `speed_cp<r>` per CP rank and `cp_kv_tokens` (the key / value tokens this rank received
  per layer in the last step) with every log line.
- **Checkpoints** carry the speeds and the window's samples, so a resumed run places its next step as the
  uninterrupted run would; a run resumed with other parallel settings (`cfg`, but for `cp_block`) measures
  anew.

    runtime = CPPlacement(cost_of=lambda: stream.cost, speeds=(1.0, 1.0), measured=True, cp_rank=0,
                          group=tp_and_cp_group, block=2048, kv_cost=0.1, window=3)
    plan = runtime.placer([512, 37, 4096])    # in the forward step; the hook's after_step measures
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from megahet.policy.cp_placement import CPPlan, dynamic_cp_plan, slice_cost
from megahet.policy.detector import MedianWindow
from megahet.policy.packing import DocCost
from megahet.runtime.hooks import MeasuringHook


class CPPlacement(MeasuringHook):
    """The dynamic placement of this run's packed micro-batches, and the CP ranks' speeds it plans with;
    `group`: the ranks whose plans must agree, over which the measurements are gathered (TP x CP; with
    pipeline stages, every rank: a stage's CP rank must hold the slices its neighbour stage sends it);
    `stage`, `stages`: this rank's pipeline stage and their number; `cfg`: the run's parallel settings, which
    the checkpointed speeds belong to."""

    checkpointed = True
    settings_free = ("cp_block",)  # the blocks change the plans, not the ranks' speeds

    def __init__(
        self,
        cost_of: Callable[[], DocCost],
        speeds: Sequence[float],
        measured: bool,
        cp_rank: int,
        group,
        block: int,
        kv_cost: float,
        window: int,
        cfg=None,
        stage: int = 0,
        stages: int = 1,
    ):
        self.cfg = cfg
        self.cost_of, self.measured, self.cp_rank, self.group = cost_of, measured, cp_rank, group
        self.stage, self.stages = stage, stages
        self.speeds = tuple(float(v) for v in speeds)
        self.block, self.kv_cost = block, kv_cost
        self.window = MedianWindow(len(self.speeds) * stages, window)
        """Per (stage, CP rank): speed-1 seconds per measured second."""
        self.predicted_s = 0.0  # this rank's slices this step, seconds at speed 1
        self.kv_tokens = self.last_kv_tokens = 0
        self.counting = True

    def placer(self, lengths: Sequence[int]) -> CPPlan:
        """The plan of one micro-batch of documents of these lengths (the same on every CP rank)."""
        cost = self.cost_of()
        plan = dynamic_cp_plan(lengths, cost, self.speeds, block=self.block, kv_seconds=self.kv_cost * cost.b)
        if self.counting:
            self.predicted_s += sum(slice_cost(cost, s.start, s.stop) for s in plan.slices_of(self.cp_rank))
            self.kv_tokens += plan.kv_tokens()[self.cp_rank]
        return plan

    def before_forward_backward(self, step: int) -> None:
        self._collect()
        self.step = step

    def after_step(self, engine) -> None:
        times = [self.ctx.times.compute_s, self.predicted_s, self.cp_rank, self.stage]
        mine = torch.tensor(times, dtype=torch.float64)
        self.last_kv_tokens, self.kv_tokens, self.predicted_s = self.kv_tokens, 0, 0.0
        if self.measured:
            self._gather(mine, self.group)

    def _collect(self) -> None:
        taken = self._take()
        if taken is None:
            return
        rows, _, _ = taken
        # Per (stage, CP rank), the slowest of its TP ranks (they compute the same tokens): speed-1 seconds
        # per measured second; a CP rank that measured nothing gives no sample.
        cps = len(self.speeds)
        slowest = [[0.0, 0.0] for _ in range(cps * self.stages)]  # (measured, predicted) seconds
        for measured, predicted, cp, stage in rows:
            slot = slowest[int(stage) * cps + int(cp)]
            slot[0], slot[1] = max(slot[0], measured), max(slot[1], predicted)
        self.window.update([p / m if m > 0 and p > 0 else -1.0 for m, p in slowest])
        if self.window.ready:
            # A stage's rates compare its own CP ranks (its layers' share of the work is the same for
            # each); a CP rank runs one plan on every stage, at its slowest stage's relative speed.
            rates = self.window.medians()
            per_stage = [rates[s * cps : (s + 1) * cps] for s in range(self.stages)]
            relative = [[r / max(stage) for r in stage] for stage in per_stage]
            speeds = [min(stage[c] for stage in relative) for c in range(cps)]
            self.speeds = tuple(v / max(speeds) for v in speeds)

    @contextlib.contextmanager
    def evaluation(self):
        """Evaluation's micro-batches are placed the same way, but not counted as the step's work."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def state_dict(self) -> dict:
        self._collect()  # the last step's measurement, folded in as the next step would
        return {"speeds": list(self.speeds), "samples": [list(s) for s in self.window.samples]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["speeds"]) != len(self.speeds):  # the settings (parallel.cp) are checked before
            raise ValueError(
                f"saved speeds are for {len(state['speeds'])} CP ranks, this run has {len(self.speeds)}"
            )
        self.speeds = tuple(float(v) for v in state["speeds"])
        for samples, saved in zip(self.window.samples, state["samples"]):
            samples.clear()
            samples.extend(saved)

    def report(self) -> dict[str, float]:
        out = {f"speed_cp{r}": v for r, v in enumerate(self.speeds)}
        out["cp_kv_tokens"] = float(self.last_kv_tokens)
        return out
