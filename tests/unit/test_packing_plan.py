"""The packing plan, the cost model fit and the packed stream (issue 28), pure and in one process.

- stage 1 and 2: every document used exactly once, token caps kept, the same inputs give the same plan,
  a 2x-slow replica gets about half the predicted work, a document that fits only a larger cap goes there;
- stage 2 picks the micro-batch count by the 1F1B time (PP > 1 prefers more, smaller micro-batches);
- the cost-balanced plan is as good as the token-balanced one on alike replicas, far better with a slow one;
- Karmarkar-Karp and round-robin baselines; the cost fit recovers a known a, b, c; generated mixes;
- the stream: every document once per epoch over many global batches (documents or tokens per batch),
  resuming at step k gives the same batches, replicas read disjoint documents of one plan, and a replica
  with a smaller token cap never gets a micro-batch over it.

Run: ``python -m pytest tests/unit/test_packing_plan.py -q``
"""

from __future__ import annotations

import numpy as np
import pytest

from megahet.data.documents import DocumentPieces, generated_lengths, split_pieces
from megahet.data.packed import PackedStream
from megahet.policy.cost_fit import (
    CostSample,
    fit_doc_cost,
    mean_abs_pct_error,
    probe_lengths,
    refit_doc_cost,
)
from megahet.policy.packing import (
    DocCost,
    assign_replicas,
    cost_balanced_plan,
    karmarkar_karp,
    micro_batch_bound,
    micro_batch_costs,
    pack_micro_batches,
    replica_times,
    round_robin_plan,
    token_balanced_plan,
)

COST = DocCost(a=1.0 / 2048, b=1.0, c=32.0)


def _lengths(n: int = 64, seed: int = 0, cap: int = 2048) -> np.ndarray:
    return np.minimum(generated_lengths("code", 10**7, seed)[:n], cap)


def _check_plan(plan, lengths, caps) -> None:
    assert plan.documents() == list(range(len(lengths)))  # each document exactly once
    for mbs, cap in zip(plan.replicas, caps):
        assert mbs, "every replica runs at least one micro-batch"
        assert all(lengths[list(mb)].sum() <= cap for mb in mbs)


@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 0.5), (1.0, 0.7, 0.4, 1.0)])
def test_cost_plan_uses_every_document_once_under_the_caps(speeds) -> None:
    lengths = _lengths()
    caps = (2048,) * len(speeds)
    plan = cost_balanced_plan(lengths, COST, speeds, caps, pp=1, seed=3)
    _check_plan(plan, lengths, caps)
    assert plan == cost_balanced_plan(lengths, COST, speeds, caps, pp=1, seed=3)  # deterministic


def test_a_slow_replica_gets_work_in_proportion_to_its_speed() -> None:
    lengths = _lengths(128)
    plan = cost_balanced_plan(lengths, COST, (1.0, 0.5), (2048, 2048), seed=1)
    times = replica_times(plan, lengths, COST, (1.0, 0.5))
    assert max(times) / min(times) < 1.05
    work = replica_times(plan, lengths, COST, (1.0, 1.0))
    assert 1.8 < work[0] / work[1] < 2.2


def test_documents_that_fit_only_a_larger_cap_go_there() -> None:
    lengths = np.array([3000, 2500, 100, 200, 300, 400])
    owner = assign_replicas(lengths, COST, (1.0, 1.0), (4096, 1024), seed=0)
    assert owner[0] == owner[1] == 0 and (owner == 1).any()
    with pytest.raises(ValueError, match="largest token cap"):
        assign_replicas(np.array([5000, 1]), COST, (1.0, 1.0), (4096, 1024))


def test_stage_two_picks_the_micro_batch_count_by_the_pipeline_time() -> None:
    lengths = np.full(16, 256)
    one_stage = pack_micro_batches(lengths, COST, cap=2048, pp=1)
    four_stages = pack_micro_batches(lengths, COST, cap=2048, pp=4)
    assert len(one_stage) == 2  # fewest micro-batches: c per micro-batch is the only difference
    assert len(four_stages) > 2  # smaller micro-batches shorten warm-up and cool-down
    assert sorted(i for mb in four_stages for i in mb) == list(range(16))


def test_stage_two_evens_the_micro_batches_out_down_to_the_costliest_document() -> None:
    lengths = np.array([621, 456, 283, 452, 485, 295, 620, 985, 839])  # LPT alone: 1.106
    packed = pack_micro_batches(lengths, COST, cap=1400, pp=4)
    costs = [float(COST.docs(lengths[mb]).sum()) + COST.c for mb in packed]
    assert sorted(i for mb in packed for i in mb) == list(range(9))
    assert all(lengths[mb].sum() <= 1400 for mb in packed)
    assert max(costs) / np.mean(costs) <= 1.10
    long_one = np.array([2000, 100, 100, 100])  # one document costlier than the mean: the bound
    packed_long = pack_micro_batches(long_one, COST, cap=2048, pp=4)
    assert micro_batch_bound(micro_batch_costs(packed_long, long_one, COST), long_one, COST) > 1.5


def test_cost_balancing_matches_token_balancing_when_alike_and_beats_it_with_a_slow_replica() -> None:
    lengths = _lengths(96, seed=5)
    tokens = token_balanced_plan(lengths, 2, 2048)
    _check_plan(tokens, lengths, (2048, 2048))
    for speeds, bound in (((1.0, 1.0), 1.01), ((1.0, 0.5), 0.75)):
        cost = cost_balanced_plan(lengths, COST, speeds, (2048, 2048), seed=0)
        slowest = max(replica_times(cost, lengths, COST, speeds))
        assert slowest < bound * max(replica_times(tokens, lengths, COST, speeds))


def test_karmarkar_karp_and_round_robin() -> None:
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]  # the differencing heuristic's answer (the optimum is 15/15)
    plan = round_robin_plan(np.array([5, 5, 5, 5, 5]), 2, cap=10)
    assert plan.replicas == (((0, 2), (4,)), ((1, 3),))


def test_cost_fit_recovers_a_known_model_and_scores_held_out_packs() -> None:
    truth = DocCost(a=3e-9, b=2e-6, c=4e-4)
    rng = np.random.default_rng(0)
    train = [CostSample.of(pack, truth.micro_batch(pack)) for pack in probe_lengths(4096)]
    fitted = fit_doc_cost(train)
    assert fitted.a == pytest.approx(truth.a, rel=1e-6) and fitted.c == pytest.approx(truth.c, rel=1e-6)
    held_out = []
    for _ in range(20):
        pack = rng.integers(1, 1024, size=rng.integers(1, 6)).tolist()
        held_out.append(CostSample.of(pack, truth.micro_batch(pack) * rng.uniform(0.95, 1.05)))
    assert mean_abs_pct_error(fitted, held_out) < 0.05
    with pytest.raises(ValueError, match="at least 3"):
        fit_doc_cost(train[:2])


def test_refit_keeps_the_profile_shape_and_takes_the_measured_scale() -> None:
    truth = DocCost(a=3e-9, b=2e-6, c=4e-4)
    probes = [CostSample.of(pack, 0.5 * truth.micro_batch(pack)) for pack in probe_lengths(4096)]  # 2x off
    profile = fit_doc_cost(probes)
    steps = [[1000, 500, 200], [900, 700, 100], [1200, 300, 300]]  # alike mixes: a, b, c not separable
    measured = [CostSample.of(pack, truth.micro_batch(pack)) for pack in steps]
    refined = refit_doc_cost(profile, probes, measured)
    held_out = [CostSample.of(pack, truth.micro_batch(pack)) for pack in ([4096], [64] * 64, [2048, 100])]
    assert mean_abs_pct_error(profile, held_out) > 0.4
    assert mean_abs_pct_error(refined, held_out) < 0.01
    with pytest.raises(ValueError, match="measured samples"):
        refit_doc_cost(profile, probes, [])


def test_generated_mixes_and_pieces() -> None:
    web, code = generated_lengths("web", 10**6, 0), generated_lengths("code", 10**6, 0)
    assert web.sum() <= 10**6 and code.sum() <= 10**6
    assert np.median(code) > np.median(web) and np.percentile(code, 99) > 2000
    starts, lengths = split_pieces(np.array([0, 10]), np.array([10, 25]), max_tokens=8)
    assert lengths.tolist() == [8, 1, 8, 8, 8] and starts.tolist() == [0, 8, 10, 18, 26]
    long = generated_lengths("long", 10**6, 0, longest=8192)
    assert long.sum() <= 10**6 and 200 < np.median(long) < 320  # mostly short ...
    assert np.percentile(long, 99) > 16 * np.median(long) and long.max() <= 8192  # ... a tail of 16x and more
    with pytest.raises(ValueError, match="unknown length mix"):
        generated_lengths("books", 100, 0)


def _pieces(n: int = 50, cap: int = 64) -> DocumentPieces:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, cap + 1, n)
    starts = np.cumsum(lengths + 1) - (lengths + 1)
    tokens = np.arange(int(starts[-1] + lengths[-1] + 1)) % 60000
    return DocumentPieces(tokens.astype(np.uint16), starts, lengths, cap)


@pytest.mark.parametrize("size", [{"documents_per_batch": 10}, {"tokens_per_batch": 300}])
def test_stream_uses_every_document_once_per_epoch_and_resumes_exactly(size) -> None:
    pieces = _pieces()
    streams = [PackedStream(pieces, dp_rank=r, dp_size=2, cap=64, seed=9, **size) for r in range(2)]
    seen = []
    for _ in range(5 if "documents_per_batch" in size else 8):
        plans = [s.begin_step() for s in streams]
        assert plans[0].plan == plans[1].plan  # every rank plans alike, without a collective
        for r, stream in enumerate(streams):
            for _ in range(plans[r].counts[r]):
                batch = next(stream)
                assert batch["tokens"].shape[1] <= 64
        seen += plans[0].documents.tolist()
    assert sorted(seen[: len(pieces)]) == list(range(len(pieces)))  # the first epoch: each once
    resumed = PackedStream(pieces, dp_rank=0, dp_size=2, cap=64, seed=9, start_step=3, **size)
    original = PackedStream(pieces, dp_rank=0, dp_size=2, cap=64, seed=9, **size)
    assert resumed.plan(3).plan == original.plan(3).plan
    assert (resumed.plan(3).documents == original.plan(3).documents).all()
    original.begin_step()  # a Trainer that resumes positions the stream it built after loading
    original.seek(iteration=3, consumed_samples=0)
    assert (original.begin_step().documents == resumed.begin_step().documents).all()


def test_stream_sends_long_documents_to_the_replica_with_the_larger_cap() -> None:
    pieces = _pieces(n=60, cap=64)
    stream = PackedStream(pieces, dp_rank=1, dp_size=2, cap=(64, 32), documents_per_batch=20, seed=2)
    for _ in range(4):
        step = stream.begin_step()
        small = step.plan.replicas[1]
        assert small and all(step.lengths[list(mb)].sum() <= 32 for mb in small)
        assert all(step.lengths[list(mb)].sum() <= 64 for mb in step.plan.replicas[0])
        assert step.padding_fraction((64, 32)) >= 0
        for _ in range(step.counts[1]):
            assert next(stream)["tokens"].shape[1] <= 32


def test_a_replica_whose_cap_no_document_fits_runs_one_empty_masked_micro_batch() -> None:
    plan = cost_balanced_plan(np.array([50, 40, 60]), COST, (1.0, 1.0), (64, 32))
    assert plan.replicas[1] == ((),) and plan.documents() == [0, 1, 2]
    pieces = _pieces(n=30, cap=64)
    pieces.lengths[:] = 64  # every document longer than replica 1's cap
    stream = PackedStream(pieces, dp_rank=1, dp_size=2, cap=(64, 32), documents_per_batch=4, seed=2)
    step = stream.begin_step()
    assert step.tokens == 4 * 64 and step.counts == (len(step.plan.replicas[0]), 1)
    batch = next(stream)
    assert batch["tokens"].shape == (1, 1) and batch["loss_mask"].sum() == 0  # no loss, no token


def test_stream_refuses_unconsumed_steps_and_bad_sizes() -> None:
    stream = PackedStream(_pieces(), dp_rank=0, dp_size=2, cap=64, documents_per_batch=8)
    with pytest.raises(RuntimeError, match="begin_step"):
        next(stream)
    stream.begin_step()
    with pytest.raises(RuntimeError, match="not consumed"):
        stream.begin_step()
    with pytest.raises(ValueError, match="not both"):
        PackedStream(_pieces(), dp_rank=0, dp_size=2, cap=64, documents_per_batch=8, tokens_per_batch=100)
    with pytest.raises(ValueError, match="exceed the token cap"):
        PackedStream(_pieces(cap=64), dp_rank=0, dp_size=2, cap=32, documents_per_batch=8)
