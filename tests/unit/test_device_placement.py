"""What a GPU would hit, caught on the CPU: megahet's GPU configuration, and the device of every tensor
it creates.

- The GPU configuration (CUDA reported present) builds: megatron-core's TransformerConfig accepts its
  fused kernels, and the GPT and ViT built from it compute what the CPU configuration computes (GPT-2's
  tanh GELU through megatron-core's fused bias-GELU), forward and backward.
- The resizing executor and the migration exchange create every tensor on the parameters' device: the
  model's parameters sit on `meta`, and `StrictDevice` (tests/unit/strict_device.py) raises on any op
  that mixes it with a CPU tensor, as CUDA raises on CUDA and CPU tensors. Each imputation policy, and
  both sides of a migration (owner and helper), run a whole step: apply, forward, backward, the
  gradient hooks, before_step, after_step, the point-to-point exchange.
  On `meta` no tensor's values can be read either, so these paths are also shown to read nothing
  back to the host (on a GPU, a synchronization) per micro-batch or per step.
- The pretrain scripts' forward_step moves the batch to the process's device.

Run: ``python -m pytest tests/unit/test_device_placement.py -q`` (about 15 s).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch._dynamo
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from resize_gpt import DROPS, MICRO, SEQ, VOCAB, plan_of
from strict_device import MixedDevices, StrictDevice
from tiny_models import TINY_GPT

from megahet.config import MegahetConfig, apply_overrides
from megahet.models import common
from megahet.models.common import resizable_layer_spec
from megahet.models.gpt import build_gpt
from megahet.models.vit import build_vit
from megahet.tensor_parallel import migration
from megahet.tensor_parallel.executor import ResizeExecutor
from megahet.tensor_parallel.plan import ResizePlan

REPO = Path(__file__).resolve().parents[2]
SEED = 777
SMALL = {
    **TINY_GPT,
    "model.seq_length": SEQ,
    "model.image_size": 28,
    "model.patch_size": 7,
    "model.hidden_dropout": 0.0,
    "model.attention_dropout": 0.0,
}


def _config(**overrides) -> MegahetConfig:
    return apply_overrides(MegahetConfig(), {**SMALL, **overrides})


def _build(kind: str, cuda: bool, monkeypatch, spec=None) -> torch.nn.Module:
    """The model as megahet builds it, with CUDA reported present or absent (the config's fused kernels)."""
    monkeypatch.setattr(common, "cuda_available", lambda: cuda)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    cfg = _config()
    model = build_gpt(cfg, VOCAB, spec) if kind == "gpt" else build_vit(cfg)
    monkeypatch.undo()
    return model


# --- the GPU configuration ---------------------------------------------------------------------------


def test_gpu_transformer_config_fuses_bias_gelu_and_keeps_the_tanh_gelu(monkeypatch) -> None:
    monkeypatch.setattr(common, "cuda_available", lambda: True)
    config = common.transformer_config(_config())  # raised ValueError with gelu_tanh + fusion
    assert config.bias_activation_fusion and config.bias_dropout_fusion
    assert config.activation_func is torch.nn.functional.gelu  # megatron-core fuses only F.gelu ...
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    fused = getattr(bias_gelu, "_torchdynamo_orig_callable", bias_gelu)  # ... and its kernel is tanh GELU
    x, b = torch.randn(64, 16), torch.randn(16)
    torch.testing.assert_close(fused(b, x), common.gelu_tanh(x + b), atol=2e-6, rtol=0)
    monkeypatch.setattr(common, "cuda_available", lambda: False)
    assert common.transformer_config(_config()).activation_func is common.gelu_tanh


def test_fused_softmax_only_where_its_cuda_extension_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(common, "cuda_available", lambda: True)
    installed = importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None
    assert common.transformer_config(_config()).masked_softmax_fusion == installed
    monkeypatch.setattr(common, "has_fused_softmax_kernel", lambda: True)
    assert common.transformer_config(_config()).masked_softmax_fusion


@pytest.mark.parametrize("kind", ["gpt", "gpt-resized", "vit"])
def test_gpu_config_models_compute_what_the_cpu_config_computes(world1, monkeypatch, kind: str) -> None:
    """Fused kernels on (megatron-core's, run eagerly here) against the CPU path, forward and backward;
    "gpt-resized" runs megahet's resizable layers under a plan (the fused bias-GELU then takes the kept
    units' bias)."""
    spec = resizable_layer_spec() if kind == "gpt-resized" else None
    cpu, gpu = (_build(kind[:3], cuda, monkeypatch, spec) for cuda in (False, True))
    assert gpu.config.bias_activation_fusion and not cpu.config.bias_activation_fusion
    if spec is not None:
        for model in (cpu, gpu):
            ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1).apply(plan_of(DROPS))
    if kind == "vit":
        args = (torch.rand(MICRO, 1, 28, 28, generator=torch.Generator().manual_seed(1)),)
    else:
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
        args = (tokens, torch.arange(SEQ).expand(MICRO, SEQ), None)
    with torch._dynamo.config.patch(disable=True):  # megatron-core's fused kernels, run eagerly on CPU
        outputs = [model(*args) for model in (cpu, gpu)]
        torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
        for out in outputs:
            out.float().square().mean().backward()
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


# --- every tensor on the parameters' device ----------------------------------------------------------


def test_strict_device_refuses_a_cpu_tensor_meeting_a_meta_one() -> None:
    weight = torch.empty(8, 4, device="meta")
    with StrictDevice():
        weight.index_select(0, torch.tensor([1], device="meta"))
        weight.mul_(torch.tensor(2.0))  # a 0-dim CPU scalar is allowed, as on CUDA
        with pytest.raises(MixedDevices, match="index_select"):
            weight.index_select(0, torch.tensor([1]))


class _P2PRecorder:
    """Stands in for dist.batch_isend_irecv (one process, meta tensors): records what would travel."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __call__(self, ops):
        self.tensors += [op.tensor for op in ops]
        return []


@pytest.fixture
def meta_device(world1, monkeypatch) -> _P2PRecorder:
    """megatron-core's current device is the parameters' (as on a GPU), and P2P is recorded."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    # its attention scores' buffer, allocated on the current device at first use
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", GlobalMemoryBuffer())
    recorder = _P2PRecorder()
    monkeypatch.setattr(migration.dist, "batch_isend_irecv", recorder)
    return recorder


def _meta_gpt(monkeypatch) -> torch.nn.Module:
    # no_mask: the causal mask is built by the CPU shim (megatron-core's own builds it on the GPU)
    with monkeypatch.context() as mp:
        return _build("gpt", False, mp, resizable_layer_spec(AttnMaskType.no_mask)).to("meta")


def _step(model, executor, microbatches: int = 2) -> None:
    tokens = torch.zeros(MICRO, SEQ, dtype=torch.long, device="meta")
    positions = torch.arange(SEQ, device="meta").expand(MICRO, SEQ)
    for _ in range(microbatches):
        (model(tokens, positions, None).float().mean() / microbatches).backward()
    executor.before_step(None)
    executor.after_step(None)


@pytest.mark.parametrize("imputation", ["zero", "same", "average"])
def test_executor_creates_its_tensors_on_the_parameters_device(meta_device, monkeypatch, imputation) -> None:
    model = _meta_gpt(monkeypatch)
    with StrictDevice() as mode:
        executor = ResizeExecutor(
            model, dp_rank=0, tp_rank=0, dp_size=2, imputation=imputation, num_microbatches=2,
            track_gradients=True, track_weights=True, score_samples=16,
        )  # fmt: skip
        plan = plan_of(DROPS)
        executor.apply(ResizePlan({**plan.blocks, ("mlp", 2): {(0, 0): (0, 63), (1, 0): (0, 5)}}))
        _step(model, executor)
        executor.apply(plan_of({("mlp", 1): (4,)}))  # a second plan
        _step(model, executor)
    assert mode.ops > 500
    assert all(g.device.type == "meta" for g in executor.unit_gradients.values())


@pytest.mark.parametrize("tp_rank", [0, 1], ids=["owner", "helper"])
def test_migration_creates_and_sends_its_tensors_on_the_parameters_device(meta_device, monkeypatch, tp_rank):
    model = _meta_gpt(monkeypatch)
    plan = ResizePlan(
        {("mlp", 1): {(0, tp_rank): (7,)}},
        migrated={("mlp", 1): {(0, 0): {1: (1, 2)}}, ("attn", 2): {(0, 0): {1: (3,)}}},
    )
    with StrictDevice():
        executor = ResizeExecutor(model, dp_rank=0, tp_rank=tp_rank, dp_size=1, num_microbatches=2)
        executor.apply(plan)
        _step(model, executor)
    guests = [t for tensors in executor.exchange.guests.values() for t in tensors]
    assert bool(guests) == (tp_rank == 1)
    # apply and after_step push weights, before_step pulls gradients: 3 x 3 tensors per block
    assert len(meta_device.tensors) == 18
    assert {t.device.type for t in meta_device.tensors + guests} == {"meta"}


# --- batches -----------------------------------------------------------------------------------------


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["pretrain_gpt", "pretrain_vit"])
def test_forward_step_moves_the_batch_to_the_device(monkeypatch, name: str) -> None:
    from megahet.data import sampling

    monkeypatch.setattr(sampling, "process_device", lambda: torch.device("meta"))
    if name == "pretrain_gpt":
        batch = {k: torch.zeros(MICRO, SEQ, dtype=torch.long) for k in ("tokens", "position_ids", "labels")}
        batch["loss_mask"] = torch.ones(MICRO, SEQ)
    else:
        batch = {"images": torch.zeros(MICRO, 1, 28, 28), "labels": torch.zeros(MICRO, dtype=torch.long)}
    seen = []

    def model(*args, **kwargs):
        seen.extend(t for t in (*args, *kwargs.values()) if torch.is_tensor(t))
        return torch.zeros(MICRO, SEQ, device="meta") if name == "pretrain_gpt" else torch.zeros(MICRO, 10)

    _, loss_func = _script(name).forward_step(iter([batch]), model)
    assert seen and {t.device.type for t in seen} == {"meta"}
    assert {t.device.type for t in loss_func.args} == {"meta"}  # the labels / loss mask the loss meets


def test_computed_mask_is_made_once_per_plan_on_the_parameters_device(meta_device, monkeypatch) -> None:
    """The statistics read which units were computed from a device tensor made with the plan, not from a
    host array copied to the GPU every step."""
    model = _meta_gpt(monkeypatch)
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1)
    key = ("mlp", 1)
    for plan in (ResizePlan(), plan_of({key: (4,)})):
        executor.apply(plan)
        mask = executor.computed_mask(key)
        assert mask.device.type == "meta" and mask.dtype == torch.bool and mask is executor.computed_mask(key)


def test_batches_go_to_a_gpu_from_pinned_memory(monkeypatch) -> None:
    """On a GPU a batch is pinned, then copied without blocking the host (as megatron's loader does)."""
    from megahet.data import sampling

    calls = []

    class Host:
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            calls.append((str(device), non_blocking))
            return self

    sampling.to_device({"tokens": Host()}, torch.device("cuda", 0))
    assert calls == ["pin", ("cuda:0", True)]
    calls.clear()
    sampling.to_device({"tokens": Host()}, torch.device("cpu"))
    assert calls == [("cpu", True)]
