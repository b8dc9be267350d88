"""The layout planner's calibration: what one short profiling run measured, so that the cost model
(megahet/policy/layout_cost.py) predicts from this machine's own times, not from datasheets alone.

Role: policy (pure; megahet/layout_plan.py reads the profiling run's trace into a `Profile`).

The profiling run is the model on a node of the cluster's reference devices at PP 1 and TP 2 (TP 1 on
one-GPU nodes), the other ranks replicas, with the layers timed as the balancers time them
(`--balance.trace`, static):

    python pretrain_gpt.py --config model.yaml --parallel.tp 2 --parallel.pp 1 --train.train_iters 8 \\
        --balance.trace profile.jsonl
    python tools/plan.py --cluster cluster.yaml --config model.yaml --plan.profile profile.jsonl

    profile = Profile.from_trace_rows(rows, layers=8, global_batch=64, skip=2)
    cal = fit_calibration(profile, shape, reference_tflops=312, precision="bf16", link_gbps=300)
    cal.layer_efficiency      # the layers' measured FLOP rate over the reference node's tflops
    cal.extra_seconds(micro_batch=4, tflops=150)

From its trace (per rank and step: own compute inside the transformer layers, all own compute, the
time blocked in collectives, the step's wall time) it takes medians over the steps after start-up:
- `layer_efficiency`: the FLOPs the cost model counts for the layers over their measured time, per the
  reference device's `tflops` (it replaces `plan.efficiency`);
- `extra_s_per_sample`: the other compute per sample of a micro-batch (embedding, output layer, loss,
  and the framework's own work between the layers), on the reference device;
- `latency_s`: each TP all-reduce's time beyond its bytes over the link (the profile runs 4 per layer
  and micro-batch; none at TP 1), which the cost model also charges each pipeline send and DP reduction;
- `step_s`: per step, what is left of the step's wall time after the micro-batches' compute and the
  modeled DP gradient reduction (the optimizer step, data, logging).
A slower device runs the extra compute and the per-step work slower in proportion to its rate
(`extra_follows_rate`; virtual devices slow only the layers, so benchmarks/plan_accuracy.py turns it off).

Several profiles of one layout at different micro-batch sizes give the efficiency and the extra compute
per size (a larger GEMM runs at a higher rate), interpolated in log tokens between them:

    cal = fit_calibration([profile_mb1, profile_mb4], shape, reference_tflops=312, ...)
    cal.efficiency(tokens=4 * 2048)

A profile across the whole cluster gives each node's measured layer rate, for nodes whose speed no
datasheet gives (a shared or throttled one): `node_tflops(profile, shape, gpus_per_node)`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence

from megahet.policy.layout_cost import ELEMENT_BYTES, ModelShape, all_reduce_seconds, gradient_sync_seconds


@dataclasses.dataclass(frozen=True)
class Profile:
    """A profiling run's measurements (PP 1), after its start-up steps."""

    layers: int
    micro_batch: int
    microbatches: int
    """Micro-batches per replica per step."""
    dp: int
    tp: int
    layers_s: tuple[float, ...]
    """Per rank and step: own compute inside the transformer layers."""
    compute_s: tuple[float, ...]
    """Per rank and step: all own compute (the layers, embedding, output layer, loss)."""
    wait_s: tuple[float, ...]
    """Per rank and step: time blocked in collectives inside the compute (the TP all-reduces)."""
    step_s: tuple[float, ...]
    """Per step: its wall time."""

    @property
    def ranks(self) -> int:
        return self.dp * self.tp

    def rank_layers_s(self, rank: int) -> float:
        """Rank `rank`'s median time in the layers per step (ranks as launched: TP fastest, then DP)."""
        return statistics.median(self.layers_s[rank :: self.ranks])

    @classmethod
    def from_trace_rows(cls, rows: list[dict], layers: int, global_batch: int, skip: int) -> Profile:
        """From `--balance.trace` rows of a PP 1 run (each with `busy_s`, `compute_s`, `wait_s` [dp][tp],
        `step_s` and `microbatches`), the first `skip` steps left out (start-up)."""
        kept = [r for r in rows if r["step"] > skip]
        if not kept:
            raise ValueError(f"it has no step after the first {skip}: profile more steps")
        first = kept[0]
        if "microbatches" not in first:
            raise ValueError("it has no micro-batch counts: profile with this version of megahet")
        shares = first["microbatches"]
        if len(set(shares)) != 1:
            raise ValueError(f"its replicas ran uneven micro-batch shares {shares}: profile with even ones")
        return cls(
            layers=layers, micro_batch=global_batch // sum(shares), microbatches=shares[0], dp=len(shares),
            tp=len(first["busy_s"][0]), layers_s=_each(kept, "busy_s"), compute_s=_each(kept, "compute_s"),
            wait_s=_each(kept, "wait_s"), step_s=tuple(r["step_s"] for r in kept),
        )  # fmt: skip


def node_tflops(profile: Profile, shape: ModelShape, gpus_per_node: int) -> list[float]:
    """Each node's measured layer rate (TFLOP/s: the FLOPs the cost model counts for the layers over their
    time) in a profiling run that spans the cluster: PP 1, even shares, `gpus_per_node` ranks per node
    launched node by node (rank r on node r // gpus_per_node). A node's rate is its ranks' median: the
    speed it actually ran at, whatever its datasheet says (a tenant sharing it, a throttled card)."""
    if profile.ranks % gpus_per_node:
        raise ValueError(f"{profile.ranks} ranks do not fill nodes of {gpus_per_node}: profile whole nodes")
    flops = 3 * shape.layer_flops(shape.seq * profile.micro_batch) / profile.tp * profile.layers
    per_rank = [flops * profile.microbatches / profile.rank_layers_s(r) / 1e12 for r in range(profile.ranks)]
    return [
        statistics.median(per_rank[n : n + gpus_per_node]) for n in range(0, profile.ranks, gpus_per_node)
    ]


def _each(rows: list[dict], key: str) -> tuple[float, ...]:
    """Every rank's value of `key` ([dp][tp] per row) over the rows."""
    return tuple(v for r in rows for replica in r[key] for v in replica)


@dataclasses.dataclass(frozen=True)
class SizePoint:
    """What a profile at one micro-batch size measured: a GEMM's efficiency grows with its size (on a GPU
    and on a CPU alike), so the layers of a micro-batch of 4 run at a higher rate than those of 1."""

    tokens: int
    """Tokens per micro-batch (micro-batch size x sequence length)."""
    layer_efficiency: float
    extra_s_per_sample: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    reference_tflops: float
    """The profiled devices' rate as the cluster description gives it."""
    layer_efficiency: float
    """The layers' measured FLOP rate over `reference_tflops` (the first profile's, with several)."""
    extra_s_per_sample: float
    """Compute outside the layers per sample of a micro-batch, on one reference device (TP 1)."""
    step_s: float
    """Per step outside the micro-batches and the DP gradient reduction."""
    latency_s: float = 0.0
    """Each collective's and pipeline send's time beyond its bytes over the link."""
    extra_follows_rate: bool = True
    """A device of another rate runs the work outside the layers (the extra compute, the optimizer step)
    in proportion (False: at the reference's time; virtual devices slow only the layers)."""
    sizes: tuple[SizePoint, ...] = ()
    """One point per micro-batch size profiled (with several profiles), by tokens: the efficiency and
    the extra compute of another size are interpolated between them in log tokens (held at the ends)."""

    def efficiency(self, tokens: int) -> float:
        """The layers' efficiency for micro-batches of `tokens` tokens."""
        return self._at(tokens).layer_efficiency

    def extra_seconds(self, micro_batch: int, tflops: float, tp: int = 1, tokens: int | None = None) -> float:
        """The compute outside the layers for one micro-batch (of `tokens` tokens) on a TP group of `tp`
        devices of `tflops` (the output layer, its largest part, is split over TP)."""
        per_sample = self._at(tokens).extra_s_per_sample if tokens else self.extra_s_per_sample
        return per_sample * micro_batch * self._rate_scale(tflops) / tp

    def step_seconds(self, tflops: float) -> float:
        """The per-step work of a rank on a device of `tflops`. Not scaled by the rank's parameters: on the
        emulated clusters that made the predictions worse (mean error 5.1 % against 4.6 %, TP 1 plans
        predicted slow from a TP 2 profile), as most of it is per-step framework work, not the optimizer."""
        return self.step_s * self._rate_scale(tflops)

    def _rate_scale(self, tflops: float) -> float:
        return self.reference_tflops / tflops if self.extra_follows_rate else 1.0

    def _at(self, tokens: int) -> SizePoint:
        points = self.sizes
        if not points:
            return SizePoint(tokens, self.layer_efficiency, self.extra_s_per_sample)
        if tokens <= points[0].tokens:
            return points[0]
        if tokens >= points[-1].tokens:
            return points[-1]
        lo, hi = next((a, b) for a, b in itertools.pairwise(points) if a.tokens <= tokens <= b.tokens)
        w = math.log(tokens / lo.tokens) / math.log(hi.tokens / lo.tokens)
        mix = lambda a, b: a + w * (b - a)
        return SizePoint(
            tokens,
            mix(lo.layer_efficiency, hi.layer_efficiency),
            mix(lo.extra_s_per_sample, hi.extra_s_per_sample),
        )


def fit_calibration(
    profile: Profile | Sequence[Profile],
    shape: ModelShape,
    *,
    reference_tflops: float,
    precision: str,
    link_gbps: float,
    extra_follows_rate: bool = True,
) -> Calibration:
    """The calibration a profile measures, for a model of `shape` on devices the cluster gives
    `reference_tflops` and links of `link_gbps` inside the profiled node. Several profiles (one layout, a
    micro-batch size each) give the efficiency and extra compute per size; their latency and per-step time
    are the medians."""
    profiles = [profile] if isinstance(profile, Profile) else list(profile)
    if not profiles:
        raise ValueError("no profile given")
    if len({(p.tp, p.dp, p.layers) for p in profiles}) > 1:
        raise ValueError("its profiles ran different layouts: profile each micro-batch size at one layout")
    if len({p.micro_batch for p in profiles}) < len(profiles):
        raise ValueError("two of its profiles ran the same micro-batch size: profile each size once")
    kwargs = {"reference_tflops": reference_tflops, "precision": precision, "link_gbps": link_gbps}
    fits = [_fit_one(p, shape, **kwargs) for p in profiles]
    sizes = sorted(
        (SizePoint(shape.seq * p.micro_batch, f.layer_efficiency, f.extra_s_per_sample)
         for p, f in zip(profiles, fits)),
        key=lambda point: point.tokens,
    )  # fmt: skip
    first = fits[0]
    return Calibration(
        reference_tflops=reference_tflops, layer_efficiency=first.layer_efficiency,
        extra_s_per_sample=first.extra_s_per_sample, step_s=statistics.median(f.step_s for f in fits),
        latency_s=statistics.median(f.latency_s for f in fits), extra_follows_rate=extra_follows_rate,
        sizes=tuple(sizes) if len(sizes) > 1 else (),
    )  # fmt: skip


def _fit_one(
    p: Profile, shape: ModelShape, *, reference_tflops: float, precision: str, link_gbps: float
) -> Calibration:
    """One profile's constants (at its micro-batch size)."""
    tp = p.tp
    passes = p.layers * p.microbatches  # layer forward + backward passes per rank and step
    per_layer = statistics.median(p.layers_s) / passes
    if per_layer <= 0:
        raise ValueError("it measured no time in the layers: profile with --balance.trace")
    flops = 3 * shape.layer_flops(shape.seq * p.micro_batch) / tp
    compute = statistics.median(p.compute_s)
    extra = max(compute - statistics.median(p.layers_s), 0.0) / p.microbatches
    latency = 0.0
    if tp > 1:
        activation = ELEMENT_BYTES[precision] * shape.seq * p.micro_batch * shape.hidden
        per_all_reduce = statistics.median(p.wait_s) / (4 * passes)
        latency = max(per_all_reduce - all_reduce_seconds(activation, tp, link_gbps), 0.0)
    params = shape.rank_params(tp, shape.layers, first=True, last=True)
    sync = gradient_sync_seconds(params, p.dp, link_gbps, precision, latency)
    step = max(statistics.median(p.step_s) - compute - statistics.median(p.wait_s) - sync, 0.0)
    return Calibration(
        reference_tflops=reference_tflops, layer_efficiency=flops / (per_layer * reference_tflops * 1e12),
        extra_s_per_sample=extra * tp / p.micro_batch, step_s=step, latency_s=latency,
    )  # fmt: skip
