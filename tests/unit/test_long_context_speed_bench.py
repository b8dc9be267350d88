"""benchmarks/long_context_speed.py's pieces: the key / value tokens each planner moves, the rows and the
summary keys it writes (other parts' kept), and the slow-rank emulation's marks (an identity for values
and gradients)."""

from __future__ import annotations

import json
import types

import torch

from benchmarks.long_context_speed import _Mark, kv_received, rows_of, save
from megahet.policy.cp_placement import CPPlan, Slice


def test_static_cp_moves_every_other_ranks_padded_tokens_and_a_plan_what_it_counts():
    assert kv_received("static", None, [5, 12], cp=2) == 1 * (8 + 12)  # padded to multiples of 4
    plan = CPPlan(2, (8,), (Slice(0, 0, 3, 1), Slice(0, 3, 8, 0)))
    assert kv_received("dynamic", lambda lengths: plan, [8], cp=2) == 3


def _result(static: float, dynamic: float) -> dict:
    row = {"compute_max_mean": 1.0, "kv_tokens_per_step": 100.0}
    return {"planners": {"static": {**row, "step_s": static}, "dynamic": {**row, "step_s": dynamic}}}


def test_rows_and_summary_keep_the_memory_part(tmp_path):
    (tmp_path / "long_context.json").write_text(json.dumps({"summary": {"max_len_ratio_cp2": 2.07}}))
    rows = rows_of("equal", _result(2.0, 1.6)) + rows_of("emulated", _result(3.0, 2.0))
    assert [r["vs_static"] for r in rows] == [1.0, 1.25, 1.0, 1.5]
    save(tmp_path, rows, {"model": "m", "max_tokens": 8, "batch_tokens": 16, "steps": 1, "rounds": 1})
    summary = json.loads((tmp_path / "long_context.json").read_text())["summary"]
    assert summary == {"max_len_ratio_cp2": 2.07, "dynamic_vs_static": 1.25, "slow_rank_vs_static": 1.5}


def test_the_emulation_marks_pass_values_and_gradients_unchanged():
    state = types.SimpleNamespace(t0=0.0, waited=0.0, clock=types.SimpleNamespace(seconds=0.0), factor=1.0)
    x = torch.randn(3, requires_grad=True)
    y = _Mark.apply(_Mark.apply(x, state, "in") * 2, state, "out")
    y.sum().backward()
    assert torch.equal(y, x.detach() * 2) and torch.equal(x.grad, torch.full((3,), 2.0))
