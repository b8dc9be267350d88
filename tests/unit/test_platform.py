"""Tests of megahet/compat/cpu_shims.py: every CPU shim of apply_cpu_shims(), the CPU RNG tracker, and that
nothing is patched when CUDA is available.

apply_cpu_shims() patches process-wide globals (torch.cuda, torch.Tensor, megatron-core and
DeepSpeed modules). The `shims` fixture applies them for this module and, when this module was the
one that applied them, puts every original back afterwards, so other test modules see an unpatched
process. The CUDA-available case runs in a subprocess (a fresh process, torch only: ~3 s).

Run: ``python -m pytest tests/unit/test_platform.py -q`` (about 15 s, most of it importing
megatron-core and DeepSpeed).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import deepspeed.ops
import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
from megatron.core.pipeline_parallel import p2p_communication, schedules
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.enums import AttnMaskType

from megahet import platform
from megahet.compat import cpu_shims
from megahet.compat.cpu_shims import CpuRNGStatesTracker, apply_cpu_shims

REPO = Path(__file__).resolve().parents[2]

# Every (object, attribute) that apply_cpu_shims() may replace.
_PATCHED = [
    (torch.cuda, "current_device"),
    (torch.cuda, "synchronize"),
    (torch.Tensor, "cuda"),
    (transformer_utils, "get_default_causal_mask"),
    (fused_softmax, "get_default_causal_mask"),
    (rope_utils, "get_pos_emb_on_this_cp_rank"),
    (rotary_pos_embedding, "get_pos_emb_on_this_cp_rank"),
    (schedules, "torch"),
    (tp_random, "_CUDA_RNG_STATE_TRACKER"),
    (tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    (tp_random, "initialize_rng_tracker"),
]
_MISSING = object()

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims apply only without CUDA")


@pytest.fixture(scope="module")
def shims():
    """apply_cpu_shims() for this module; restores the originals if this module applied them."""
    fresh = not cpu_shims._APPLIED
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name in _PATCHED]
    ops = deepspeed.ops.__compatible_ops__
    saved_shm = ops.get("deepspeed_shm_comm", _MISSING)
    saved_env = os.environ.get("DS_ACCELERATOR")
    applied = apply_cpu_shims()
    yield applied
    if not fresh:
        return
    for obj, name, value in saved:
        if value is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, value)
    if saved_shm is _MISSING:
        ops.pop("deepspeed_shm_comm", None)
    else:
        ops["deepspeed_shm_comm"] = saved_shm
    if saved_env is None:
        os.environ.pop("DS_ACCELERATOR", None)
    else:
        os.environ["DS_ACCELERATOR"] = saved_env
    cpu_shims._APPLIED.clear()


def test_every_replaced_name_exists_in_the_installed_versions() -> None:
    """A version bump that renames or removes what a shim replaces fails here, naming it."""
    for obj, name in _PATCHED:
        assert hasattr(obj, name), (
            f"{getattr(obj, '__name__', obj)}.{name} no longer exists: its CPU shim is stale"
        )
    assert hasattr(deepspeed.ops, "__compatible_ops__"), "deepspeed.ops.__compatible_ops__ no longer exists"


def test_apply_reports_every_shim_and_is_idempotent(shims: list[str]) -> None:
    assert set(shims) == {
        "torch.cuda.current_device",
        "torch.cuda.synchronize",
        "Tensor.cuda",
        "get_default_causal_mask",
        "get_pos_emb_on_this_cp_rank",
        "schedules.torch",
        "skip deepspeed_shm_comm build",
        "rng_tracker",
    }
    tracker, sched_torch = tp_random._CUDA_RNG_STATE_TRACKER, schedules.torch
    tracker.reset()
    tracker.add("kept", 99)
    assert apply_cpu_shims() == shims
    # A second call patches nothing again: the seeded tracker (and its streams) survive.
    assert tp_random._CUDA_RNG_STATE_TRACKER is tracker and "kept" in tracker.get_states()
    assert schedules.torch is sched_torch
    tracker.reset()


def test_current_device_is_a_cpu_device_spec(shims: list[str]) -> None:
    dev = torch.cuda.current_device()
    assert torch.device(dev).type == "cpu"
    t = torch.zeros(3, device=torch.cuda.current_device())
    assert t.device.type == "cpu"
    assert torch.empty(2, 2, device=dev).device == torch.device("cpu")
    assert platform.device() == torch.device("cpu")
    assert platform.distributed_backend() == "gloo"


def test_synchronize_is_a_no_op(shims: list[str]) -> None:
    assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize(0) is None
    assert torch.cuda.synchronize(torch.cuda.current_device()) is None


def test_tensor_cuda_returns_self(shims: list[str]) -> None:
    t = torch.arange(4.0)
    assert t.cuda() is t
    assert t.cuda(0) is t
    assert t.cuda(non_blocking=True) is t
    assert t.cuda(device="cuda:1", non_blocking=False) is t
    weight = torch.nn.Parameter(torch.ones(2, 2))
    data = weight.data.cuda()  # LanguageModule's tied-embedding all-reduce pattern
    data.add_(1.0)
    assert torch.equal(weight.detach(), torch.full((2, 2), 2.0))


@pytest.mark.parametrize(
    "module", [transformer_utils, fused_softmax], ids=["transformer.utils", "fused_softmax"]
)
def test_default_causal_mask_on_cpu(shims: list[str], module) -> None:
    mask = module.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    expected = torch.tensor(
        [[False, True, True, True], [False, False, True, True], [False, False, False, True], [False] * 4]
    )
    assert torch.equal(mask, expected)
    assert module.get_default_causal_mask(1).tolist() == [[False]]


def test_rotary_positions_of_a_cp_rank_on_cpu(shims: list[str]) -> None:
    """megatron-core's RotaryEmbedding takes a context-parallel rank's positions through
    get_pos_emb_on_this_cp_rank (pinned memory and .cuda() upstream): on CPU the same head-tail chunks."""

    class Group:  # a CP group of 2, seen from its rank 1
        def size(self):
            return 2

        def rank(self):
            return 1

    emb = torch.arange(8.0).view(8, 1, 1, 1)  # (s, 1, 1, dim): position p's embedding is p
    for module in (rope_utils, rotary_pos_embedding):
        mine = module.get_pos_emb_on_this_cp_rank(emb, 0, Group())
        assert mine.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4


def test_causal_softmax_uses_the_cpu_mask(shims: list[str]) -> None:
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=transformer_utils.attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    scores = torch.zeros(2, 3, 5, 5)  # (b, heads, sq, sk), all equal
    probs = softmax(scores, None)
    row = torch.arange(5).view(5, 1)
    expected = torch.where(torch.arange(5).view(1, 5) <= row, 1.0 / (row + 1), 0.0)  # uniform over the past
    torch.testing.assert_close(probs, expected.expand(2, 3, 5, 5))


def test_schedules_factories_land_on_cpu(shims: list[str]) -> None:
    st = schedules.torch
    total = st.zeros([], dtype=torch.int, device="cuda")  # the call in the 1F1B / no-pipelining schedules
    assert total.device.type == "cpu" and total.dtype == torch.int and total.item() == 0
    assert st.ones(2, device=0).device.type == "cpu"
    assert st.empty(3, device=torch.device("cuda", 1)).device.type == "cpu"
    assert st.full((2,), 7.0, device="cuda:0").tolist() == [7.0, 7.0]
    assert st.tensor([1, 2], device="cuda").tolist() == [1, 2]
    assert st.arange(3, device="cuda").tolist() == [0, 1, 2]
    assert st.zeros(2).device.type == "cpu" and st.zeros(2, device="cpu").device.type == "cpu"
    assert st.zeros.__name__ == "zeros"


def test_schedules_torch_is_torch_otherwise(shims: list[str]) -> None:
    st = schedules.torch
    assert st is not torch
    for name in (
        "float32",
        "int",
        "Tensor",
        "distributed",
        "autograd",
        "no_grad",
        "cuda",
        "stack",
        "is_tensor",
    ):
        assert getattr(st, name) is getattr(torch, name), name
    # Only the schedules module sees the rewriting torch: the real one and other modules' are untouched.
    assert p2p_communication.torch is torch
    assert transformer_utils.torch is torch
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_deepspeed_shm_op_is_not_built(shims: list[str]) -> None:
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert os.environ.get("DS_ACCELERATOR") == "cpu"
    # DeepSpeed's CPU comm backend asks build_shm_op(); None means no JIT compile. (The module is
    # shadowed by the `torch` attribute of deepspeed.comm, hence import_module.)
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None


# --- the CPU RNG tracker -------------------------------------------------------------------------


def _draws(seed: int, n: int, skip: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if skip:
        torch.rand(skip, generator=g)
    return torch.rand(n, generator=g)


def test_rng_fork_gives_a_reproducible_stream_per_name_and_restores_outer_state() -> None:
    tracker = CpuRNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.add("a", 11)
    tracker.add("b", 22)
    assert tracker.is_initialized()

    torch.manual_seed(5)
    with tracker.fork("a"):
        a1 = torch.rand(3)
    outer = torch.rand(4)  # the default stream continues as if the fork had not happened
    with tracker.fork("a"):
        a2 = torch.rand(3)
    with tracker.fork("b"):
        b1 = torch.rand(3)
    outer2 = torch.rand(4)

    torch.testing.assert_close(a1, _draws(11, 3))
    torch.testing.assert_close(a2, _draws(11, 3, skip=3))  # a fork continues its stream
    torch.testing.assert_close(b1, _draws(22, 3))
    torch.testing.assert_close(torch.cat([outer, outer2]), _draws(5, 8))

    again = CpuRNGStatesTracker()
    again.add("a", 11)
    with again.fork("a"):
        torch.testing.assert_close(torch.rand(3), a1)  # same seed, same stream


def test_rng_fork_restores_outer_state_on_error() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError, match="boom"), tracker.fork("a"):
        torch.rand(2)
        raise RuntimeError("boom")
    torch.testing.assert_close(torch.rand(2), _draws(3, 2))
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(2), _draws(1, 2, skip=2))


def test_rng_duplicate_seed_or_name_and_unknown_fork() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="a"):
        tracker.add("a", 2)
    with pytest.raises(KeyError), tracker.fork("missing"):
        pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}
    tracker.add("a", 1)  # allowed again after reset


def test_rng_get_and_set_states() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 7)
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(5)
    snapshot_copy = tracker.get_states()
    snapshot_copy.pop("a")
    assert "a" in tracker.get_states()  # get_states returns a copy
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(5), first)


def test_megatron_manual_seed_uses_the_cpu_tracker(shims: list[str]) -> None:
    def draws(tp_rank: int, force_reset: bool = False) -> dict[str, torch.Tensor]:
        tensor_parallel.model_parallel_cuda_manual_seed(
            123, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=force_reset
        )
        tracker = tensor_parallel.get_cuda_rng_tracker()
        assert isinstance(tracker, CpuRNGStatesTracker)
        out = {}
        for name in tracker.get_states():
            with tracker.fork(name):
                out[name] = torch.rand(4)
        return out

    rank0, rank0_again, rank1 = draws(0), draws(0, force_reset=True), draws(1)
    assert set(rank0) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank0_again[name])  # reseeding is reproducible
    # megatron-core's seeds: TP stream seed + 2718 + tp_rank, DP stream the seed itself.
    torch.testing.assert_close(rank0["model-parallel-rng"], _draws(123 + 2718, 4))
    torch.testing.assert_close(rank1["model-parallel-rng"], _draws(123 + 2718 + 1, 4))
    torch.testing.assert_close(rank0["data-parallel-rng"], _draws(123, 4))
    torch.testing.assert_close(rank1["data-parallel-rng"], rank0["data-parallel-rng"])
    # model_parallel_cuda_manual_seed's initialize_rng_tracker() kept the CPU tracker.
    tp_random.initialize_rng_tracker(force_reset=True)
    assert isinstance(tp_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker)
    assert tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED is True


# --- CUDA available: nothing is patched ----------------------------------------------------------

_CUDA_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    torch.cuda.is_available = lambda: True  # pretend: a GPU machine
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda)
    from megahet import platform
    from megahet.compat import cpu_shims
    assert cpu_shims.apply_cpu_shims() == [], cpu_shims._APPLIED
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda) == before
    assert platform.distributed_backend() == "cuda:nccl,cpu:gloo"  # host-side metrics go by gloo
    # Nothing imported, so nothing in megatron-core or DeepSpeed can have been patched.
    imported = sorted(m for m in sys.modules if m.startswith(("megatron", "deepspeed")))
    assert not imported, imported
    assert "DS_ACCELERATOR" not in os.environ
    print("NO-OP OK")
    """
)


def test_apply_is_a_no_op_when_cuda_is_available() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run(
        [sys.executable, "-c", _CUDA_SCRIPT],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO-OP OK" in proc.stdout


def test_synchronize_waits_for_the_gpu_only_when_there_is_one(monkeypatch):
    """Compute timers and virtual devices time kernels, not launches: on a GPU they synchronize."""
    from megahet import platform

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    monkeypatch.setattr(platform, "cuda_available", lambda: False)
    platform.synchronize()
    assert calls == []
    monkeypatch.setattr(platform, "cuda_available", lambda: True)
    platform.synchronize()
    assert calls == [1]
