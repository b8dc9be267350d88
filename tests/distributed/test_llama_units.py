"""Llama-shaped work units across TP ranks, against megatron-core's own spec (workers/llama_equivalence.py:
one launch at TP=2 and one at TP=3, gloo, CPU; GQA with 2 query heads per key/value group, SwiGLU,
RMSNorm, rotary positions, untied output layer):

- gamma = 0: the resizable spec is bit-for-bit megatron-core's local spec (SDPA plugged into both):
  parameters, output and TP-gathered gradients;
- units dropped on the last TP rank (a whole key/value group's heads, a head of another group, SwiGLU
  units): output and gradients equal the TP=1 model whose same global units are zeroed, except the
  dropped heads' own proj columns (no gradient in the resized model); the dropping rank's FLOPs fall;
- the same drops plus migrated heads (whole groups and single heads, their k/v rows sent along) and
  SwiGLU units: output and gradients equal the unmigrated run (lossless), and the helpers' FLOPs rise.

Run: python -m pytest tests/distributed/test_llama_units.py -q   (about 40 s on 2 cores)
"""

from __future__ import annotations

import pytest
import torch
from harness import compare, torchrun


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def results(request, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp(f"llama_tp{request.param}")
    torchrun("workers/llama_equivalence.py", request.param, ["--out", str(out)], cwd=out, timeout=300)
    return torch.load(out / f"llama_tp{request.param}.pt", weights_only=False)


def test_gamma0_is_bitwise_megatron_cores_spec(results: dict) -> None:
    megatron, resizable = results["gamma0"]["megatron"], results["gamma0"]["resizable"]
    for key in ("params", "grads"):
        assert list(resizable[key]) == list(megatron[key])
        for name, value in resizable[key].items():
            assert torch.equal(value, megatron[key][name]), (key, name)
    assert torch.equal(resizable["out"], megatron["out"])


def test_dropped_units_equal_the_tp1_model_with_them_zeroed(results: dict) -> None:
    meta, tp = results["meta"], results["meta"]["tp"]
    resized, reference = results["drops"], results["reference"]
    test = f"llama tp{tp} drops vs zeroed"
    compare(test, "per-token loss", resized["out"], reference["out"])
    assert (resized["out"] - results["gamma0"]["resizable"]["out"]).abs().max() > 1e-4
    hn = meta["head_dim"]
    expected = dict(reference["grads"])
    for (kind, layer), heads in meta["global_drops"].items():
        if kind != "attn":
            continue
        name = f"decoder.layers.{layer - 1}.self_attention.linear_proj.weight"
        expected[name] = expected[name].clone()
        for h in heads:  # the reference's zeroed q still attends (uniformly): its proj columns see it
            assert resized["grads"][name][:, h * hn : (h + 1) * hn].abs().max() == 0
            expected[name][:, h * hn : (h + 1) * hn] = 0
    compare(test, "gradients", resized["grads"], expected)
    mine, other = resized["flops"][tp - 1], resized["flops"][0]
    assert mine < other


def test_migration_is_lossless(results: dict) -> None:
    tp = results["meta"]["tp"]
    migrated, dropped = results["migrate"], results["drops"]
    test = f"llama tp{tp} migrate vs drops"
    compare(test, "per-token loss", migrated["out"], dropped["out"])
    compare(test, "gradients", migrated["grads"], dropped["grads"])
    assert migrated["flops"][0] < dropped["flops"][0] and migrated["flops"][1] > dropped["flops"][1]
