"""Context parallelism end to end (issue 45, static head-tail CP): pretrain_gpt.py with `--parallel.cp` trains
exactly as the unsplit model does.

Every run trains the same model on the same global batches (shipped data, 4 steps, an evaluation at the
end); the per-step loss and gradient norm and the validation loss of the CP runs equal those of the same
run without CP to fp32 tolerance:
- the GPT (learned positions, tied embeddings) at CP 2 x DP 2 with ZeRO-1 against DP 2 (the evaluation
  reads DP x its iterations' samples): gradients summed over CP and averaged over DP by DeepSpeed (the CP
  ranks are its sequence-parallel ranks); and at CP 2 x PP 2 against PP 2 (a pipeline run initializes
  each stage's layers from its own seed stream, so it is compared with a pipeline run);
- the Llama shape (rotary positions, grouped-query attention, SwiGLU) at TP 2 x CP 2 against one rank.

Run: python -m pytest tests/distributed/test_context_parallel.py -q   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import pytest
from harness import GPT_MODEL, LLAMA_MODEL, compare, short_run, torchrun_curves

SCRIPT = "../../pretrain_gpt.py"
STEPS = 4


def _curves(out, gpt_data, model, nproc: int, parallel: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = [*model, *short_run(STEPS), *gpt_data, *parallel]
    return torchrun_curves(SCRIPT, nproc, args, STEPS, cwd=out, timeout=420)


def _same(test: str, actual: dict, expected: dict) -> None:
    for key in ("loss", "grad_norm", "val_loss"):
        compare(test, key, actual[key], expected[key], rtol=2e-5, atol_scale=1e-6)


@pytest.mark.parametrize("other", ["dp2", "pp2"])
def test_gpt_at_cp2_trains_as_without_cp(tmp_path, gpt_data, other):
    """CP 2 x DP 2 against DP 2; CP 2 x PP 2 against PP 2 (megatron-core's schedule sends each stage's
    sequence chunks: its tensor shapes divide by CP)."""
    parallel = {"dp2": [], "pp2": ["--parallel.pp", "2"]}[other]
    reference = _curves(tmp_path / "ref", gpt_data, GPT_MODEL, 2, parallel)
    split = _curves(tmp_path / "cp", gpt_data, GPT_MODEL, 4, ["--parallel.cp", "2", *parallel])
    _same(f"gpt cp2 x {other}", split, reference)


def test_llama_with_rope_and_gqa_at_tp2_cp2_trains_as_one_rank(tmp_path, gpt_data):
    """Rotary positions of each rank's chunks, grouped-query heads split over TP and gathered over CP."""
    reference = _curves(tmp_path / "ref", gpt_data, LLAMA_MODEL, 1, [])
    split = _curves(tmp_path / "cp", gpt_data, LLAMA_MODEL, 4, ["--parallel.cp", "2", "--parallel.tp", "2"])
    _same("llama tp2 x cp2", split, reference)
