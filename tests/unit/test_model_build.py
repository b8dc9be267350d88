"""A stage built to be loaded skips initializing its weights (`ParallelLayout.weights_loaded`:
megatron-core's `perform_initialization=False`, then `mark_tensor_parallel_weights`), in one process (TP=1,
gloo):

- GPT, ViT and the Llama-shaped GPT built with `initialize=False` draw no random number (the CPU and the
  model-parallel RNG streams are where they were; the GPT's learned position table, a torch.nn.Embedding in
  megatron-core, initializes itself), where an initialized build draws: nothing is initialized and then
  thrown away;
- it has the same parameters (names, shapes, dtypes) and the same tensor-parallel marks on them
  (`tensor_model_parallel`, `partition_dim`, `partition_stride`: DeepSpeed's gradient norm counts a TP
  weight by them; megatron-core's `perform_initialization=False` leaves them unset, megahet sets them) as the initialized
  stage, and once that stage's state is loaded into it, it computes the same logits and gradients bit
  for bit;
That a resume and a re-split build this way through the pretrain scripts, and still train exactly, is checked end to end in
tests/distributed/test_checkpoint_resume.py and test_resume_measured.py.

Run: ``python -m pytest tests/unit/test_model_build.py -q`` (about 5 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from tiny_models import LLAMA, TINY_GPT

from megahet.config import MegahetConfig, apply_overrides
from megahet.models.common import initializes, transformer_config
from megahet.models.gpt import build_gpt
from megahet.models.vit import build_vit

SEED = 31
VOCAB, SEQ, BATCH = 64, 16, 2
KINDS = ["gpt", "vit", "llama"]


def _cfg(kind: str) -> MegahetConfig:
    shape = {**TINY_GPT, "model.seq_length": SEQ, "model.patch_size": 7, "model.hidden_dropout": 0.0}
    return apply_overrides(MegahetConfig(), {**shape, **(LLAMA if kind == "llama" else {})})


def _build(kind: str, initialize: bool) -> torch.nn.Module:
    cfg = _cfg(kind)
    if kind == "vit":
        return build_vit(cfg, initialize=initialize)
    return build_gpt(cfg, VOCAB, initialize=initialize)


def _rng() -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU stream and megatron-core's model-parallel stream (the tracker's, which TP weights may use)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    return torch.get_rng_state(), tracker.get_states()[
        tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME
    ]


def _forward_backward(model: torch.nn.Module, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    model.zero_grad(set_to_none=True)
    if kind == "vit":
        out = model(torch.randn(BATCH, 1, 28, 28, generator=g))
        F.cross_entropy(out, torch.randint(0, 10, (BATCH,), generator=g)).backward()
    else:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens)
        out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _seed() -> None:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stage_built_to_be_loaded_draws_no_random_number(world1, kind: str) -> None:
    """Only the GPT's learned position table draws: megatron-core builds it as a torch.nn.Embedding, which
    initializes itself (seq x hidden values, far fewer than one layer's)."""
    cfg = _cfg(kind)
    _seed()
    if kind == "gpt":
        torch.nn.Embedding(cfg.model.seq_length, cfg.model.hidden_size)
    expected = _rng()
    _seed()
    _build(kind, initialize=False)
    after = _rng()
    assert torch.equal(after[0], expected[0]) and torch.equal(after[1], expected[1]), "the build drew numbers"
    _build(kind, initialize=True)  # the check can fail: an initialized build draws from the CPU stream
    assert not torch.equal(_rng()[0], expected[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_loaded_stage_computes_what_the_initialized_one_does(world1, kind: str) -> None:
    _seed()
    initialized = _build(kind, initialize=True)
    loaded = _build(kind, initialize=False)
    shapes = {n: (p.shape, p.dtype) for n, p in initialized.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in loaded.named_parameters()} == shapes
    marks = ("tensor_model_parallel", "partition_dim", "partition_stride")
    for name, p in loaded.named_parameters():  # where a TP weight is marked as such
        reference = dict(initialized.named_parameters())[name]
        assert [getattr(p, m, None) for m in marks] == [getattr(reference, m, None) for m in marks], name
    assert any(getattr(p, "tensor_model_parallel", False) for p in loaded.parameters())
    loaded.load_state_dict(initialized.state_dict())  # strict: every parameter and buffer is overwritten
    out, grads = _forward_backward(initialized, kind)
    out_loaded, grads_loaded = _forward_backward(loaded, kind)
    assert torch.equal(out_loaded, out)
    assert grads_loaded.keys() == grads.keys()
    assert all(torch.equal(grads_loaded[n], grads[n]) for n in grads)


def test_the_config_carries_the_choice_to_megatron_core(world1) -> None:
    cfg = _cfg("gpt")
    assert initializes(transformer_config(cfg)) and transformer_config(cfg).perform_initialization
    skipping = transformer_config(cfg, initialize=False)
    assert (
        not initializes(skipping) and not skipping.perform_initialization
    )  # megatron-core's path is skipped
