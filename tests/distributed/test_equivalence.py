"""Tensor/pipeline-parallel models compute what the unsharded model computes: logits, loss, gradients.

One launch per model runs the reference (TP=1 PP=1, every rank on its own) and the parallel layouts
in the same processes (worker_equivalence.py), each through the real path: `setup()` -> Trainer ->
`Trainer.forward_backward()` (megatron-core's schedule through the DeepSpeed engine, tied embeddings
reduced) on one global batch of real data. Gradients are compared before any DP reduction: every
DP replica reads the whole batch, so each must hold the full-batch gradient.

Run: python -m pytest tests/distributed/test_equivalence.py -q   (about 50 s on 2 idle CPU cores)
"""

from __future__ import annotations

from pathlib import Path

import torch
from harness import GPT_MODEL, TIED_COPY, compare, torchrun, with_tied_copy

ONE_BATCH = ["--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.train_iters", "1"]


def _logging(tmp_path: Path) -> list[str]:
    return ["--logging.wandb", "false", "--logging.log_dir", str(tmp_path / "runs")]


def _load(tmp_path: Path, phase: str) -> dict:
    return torch.load(tmp_path / f"{phase}.pt", weights_only=False)


def check_against_reference(test: str, tmp_path: Path, phases: dict[str, set[int]], pipelined: set[str]):
    """Compare every phase's saved results with the reference phase "1x1"."""
    ref = _load(tmp_path, "1x1")
    # Each reference DP rank computed the same full-batch reference on its own: identical.
    for dp in ref["grads"]:
        for key in ("params", "grads"):
            assert all(torch.equal(ref[key][dp][n], ref[key][0][n]) for n in ref[key][0]), (key, dp)
        assert torch.equal(ref["logits"][dp], ref["logits"][0]) and torch.equal(
            ref["losses"][dp], ref["losses"][0]
        )
    ref_params, ref_grads = ref["params"][0], ref["grads"][0]
    ref_losses, ref_logits = ref["losses"][0], ref["logits"][0]

    for phase, replicas in phases.items():
        res = _load(tmp_path, phase)
        assert set(res["grads"]) == replicas and set(res["losses"]) == replicas, phase
        for dp in sorted(replicas):
            params, grads = res["params"][dp], res["grads"][dp]
            assert (TIED_COPY in params) == (phase in pipelined), sorted(params)
            # Weights: TP shards built from the seed (PP=1), or loaded from the reference (PP>1):
            # in both cases exactly the reference's.
            compare(
                test,
                f"{phase} dp{dp} initial weights (exact)",
                params,
                with_tied_copy(ref_params, params),
                rtol=0.0,
                atol=0.0,
            )
            compare(test, f"{phase} dp{dp} loss per micro-batch", res["losses"][dp], ref_losses)
            compare(test, f"{phase} dp{dp} logits {tuple(ref_logits.shape)}", res["logits"][dp], ref_logits)
            compare(
                test,
                f"{phase} dp{dp} gradients, {len(grads)} tensors",
                grads,
                with_tied_copy(ref_grads, grads),
            )
        # Every TP rank of the last stage sees the same losses and (gathered) logits.
        for (dp, tp), item in res["tp_last"].items():
            assert torch.equal(item["losses"], res["losses"][dp]), (phase, dp, tp)
            assert torch.equal(item["logits"], res["logits"][dp]), (phase, dp, tp)


def test_gpt_tp2_and_tp2pp2_match_tp1(gpt_data: list[str], tmp_path: Path):
    """GPT at TP=2 (x DP=2) and TP=2 x PP=2: same logits, per-micro-batch losses and full gradients
    (embedding, positions, every layer, final norm, and the last stage's tied output copy)."""
    args = ["--task", "gpt", "--out", str(tmp_path), "--phases", "1x1,2x1,2x2", "--"]
    torchrun(
        "worker_equivalence.py",
        4,
        args + GPT_MODEL + ONE_BATCH + gpt_data + _logging(tmp_path),
        cwd=tmp_path,
        timeout=240,
    )
    check_against_reference("gpt tp2 / tp2pp2 vs tp1", tmp_path, {"2x1": {0, 1}, "2x2": {0}}, {"2x2"})


def test_vit_tp2_matches_tp1(tmp_path: Path):
    """pretrain_vit's ViT on MNIST at TP=2: same logits, losses and gradients as TP=1."""
    batch = ["--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--train.train_iters", "1"]
    args = ["--task", "vit", "--out", str(tmp_path), "--phases", "1x1,2x1", "--"]
    torchrun("worker_equivalence.py", 2, args + batch + _logging(tmp_path), cwd=tmp_path, timeout=240)
    check_against_reference("vit tp2 vs tp1", tmp_path, {"2x1": {0}}, set())
