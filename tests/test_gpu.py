"""The GPU suite (marked `gpu`, skipped without CUDA): what only a GPU can show.

- GPT and ViT train on one GPU (NCCL) at fp32 and bf16 through the pretrain scripts: the loss falls,
  and the first step's loss equals the CPU fp32 run's (same seed, same data) within fp32 / bf16
  tolerance.
- Resizing on CUDA: a plan's forward and backward (index_select on CUDA weights, gradient hooks with
  device-side scales, each imputation policy) give the loss, and under zero imputation every
  gradient, of the same model with the dropped units' weights zeroed.
- Migration on CUDA: guest copies, receive buffers and everything sent point to point live on the
  GPU (the two-rank numerics are covered on CPU; NCCL refuses two ranks on one GPU).
- The CUDA-event clock: it measures a GEMM region as CUDA events do, and a step never synchronizes.
- SDPA core attention runs a fused kernel (flash or cuDNN) for multi-head and grouped-query attention.
- Context parallelism's chunks run their lower-right causal corner in a fused kernel (no mask).

Run on a GPU machine: ``python -m pytest -m gpu tests -q`` (a few minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))

pytestmark = pytest.mark.gpu
STEPS = 20
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a launched run, less the rendezvous that `world1` set here (a
    run given its MASTER_PORT fails with EADDRINUSE: the fixture's store holds that port)."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}


def _train(
    script: str, tmp: Path, precision: str, steps: int, gpu: bool, extra: tuple[str, ...] = (), name: str = ""
) -> list[float]:
    """Per-step losses of one run of a pretrain script on one rank (GPU, or CPU with CUDA hidden)."""
    metrics = tmp / f"{script}-{precision}-{'gpu' if gpu else 'cpu'}{name}.jsonl"
    cmd = [sys.executable, f"pretrain_{script}.py", "--train.train_iters", str(steps), "--train.precision",
           precision, "--train.log_interval", "1", "--train.eval_interval", str(steps),
           "--logging.wandb", "false", "--logging.metrics_file", str(metrics), *extra]  # fmt: skip
    env = _env() if gpu else _env(CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def cpu_first_loss(tmp_path_factory) -> dict[str, float]:
    tmp = tmp_path_factory.mktemp("cpu")
    return {script: _train(script, tmp, "fp32", 1, gpu=False)[0] for script in ("gpt", "vit")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("script", ["gpt", "vit"])
def test_pretrain_trains_on_one_gpu(tmp_path: Path, cpu_first_loss, script: str, precision: str) -> None:
    losses = _train(script, tmp_path, precision, STEPS, gpu=True)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    tolerance = 2e-3 if precision == "fp32" else 3e-2  # TF32 convolutions / bf16 matmuls
    assert losses[0] == pytest.approx(cpu_first_loss[script], rel=tolerance)


def test_compiled_layers_train_on_the_gpu_as_the_eager_ones(tmp_path: Path) -> None:
    """`--train.compile` on CUDA (inductor's Triton kernels, bf16): the GPT's per-step losses follow the eager
    GPU run's within bf16 tolerance (inductor fuses the elementwise work), and the loss falls."""
    eager = _train("gpt", tmp_path, "bf16", 8, gpu=True)
    compiled = _train(
        "gpt", tmp_path, "bf16", 8, gpu=True, extra=("--train.compile", "true"), name="-compiled"
    )
    assert compiled[-1] < compiled[0]
    assert compiled == pytest.approx(eager, rel=3e-2)


def _gradients(model, executor=None) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients) of two micro-batches on CUDA, driven as the Trainer drives a step."""
    from resize_gpt import MICRO, SEQ, batches

    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ, device="cuda").expand(MICRO, SEQ)
    total = 0.0
    for b in batches(0):
        loss = model(b["tokens"].cuda(), positions, None, labels=b["labels"].cuda()).mean() / 2
        loss.backward()
        total += float(loss)
    if executor is not None:
        executor.before_step(None)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if executor is not None:
        executor.after_step(None)
    return total, grads


@pytest.mark.parametrize("imputation", ["zero", "same", "average"])
def test_resizing_on_cuda_equals_the_model_with_dropped_units_zeroed(world1, imputation: str) -> None:
    from resize_gpt import DROPS, gpt, plan_of
    from resize_reference import zero_units

    from megahet.tensor_parallel.executor import ResizeExecutor

    torch.backends.cuda.matmul.allow_tf32 = False
    model, reference = gpt().cuda(), gpt().cuda()
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=0, dp_size=1, imputation=imputation,
                              num_microbatches=2, track_gradients=True, score_samples=64)  # fmt: skip
    executor.apply(plan_of(DROPS))
    zero_units(reference, DROPS)
    loss, grads = _gradients(model, executor)
    ref_loss, ref_grads = _gradients(reference)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert {g.device.type for g in executor.unit_gradients.values()} == {"cuda"}
    if imputation == "zero":  # the others give dropped units an imputed gradient
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("tp_rank", [0, 1], ids=["owner", "helper"])
def test_migration_keeps_every_tensor_on_the_gpu(world1, monkeypatch, tp_rank: int) -> None:
    from resize_gpt import gpt

    from megahet.tensor_parallel import migration
    from megahet.tensor_parallel.executor import ResizeExecutor
    from megahet.tensor_parallel.plan import ResizePlan

    sent = []
    monkeypatch.setattr(
        migration.dist, "batch_isend_irecv", lambda ops: sent.extend(op.tensor for op in ops) or []
    )
    model = gpt().cuda()
    plan = ResizePlan(migrated={("mlp", 1): {(0, 0): {1: (1, 2)}}, ("attn", 2): {(0, 0): {1: (3,)}}})
    executor = ResizeExecutor(model, dp_rank=0, tp_rank=tp_rank, dp_size=1, num_microbatches=2)
    executor.apply(plan)
    _gradients(model, executor)
    guests = [t for tensors in executor.exchange.guests.values() for t in tensors]
    assert len(sent) == 18 and bool(guests) == (tp_rank == 1)
    assert {t.device.type for t in sent + guests} == {"cuda"}


def test_cuda_event_clock_times_a_region_without_synchronizing(monkeypatch) -> None:
    from megahet.runtime.timing import CommClock, CudaStamps

    a = torch.randn(4096, 4096, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    synchronize = torch.cuda.synchronize
    synchronize()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: pytest.fail("synchronized in a step"))
    clock = CommClock(CudaStamps())
    start.record()
    clock.open_region()
    for _ in range(20):
        a = a @ a / 4096
    clock.close_region()
    end.record()
    monkeypatch.undo()
    synchronize()
    compute, wait, *_ = clock.read()
    assert wait == 0
    assert compute == pytest.approx(start.elapsed_time(end) / 1e3, rel=0.1)


@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
def test_sdpa_core_attention_takes_a_fused_gpu_kernel(world1, groups: int) -> None:
    """model.attention sdpa must run flash or cuDNN attention on the GPU (causal, bf16), for multi-head and
    grouped-query attention, and compute causal softmax attention (an fp32 reference, bf16 tolerance)."""
    from megatron.core.transformer.enums import AttnMaskType
    from test_attention import _cfg
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megahet.models.attention import SDPACoreAttention
    from megahet.models.common import transformer_config

    cfg = _cfg(**{"model.hidden_size": 512, "model.num_attention_heads": 8, "model.num_query_groups": groups,
                  "train.precision": "bf16"})  # fmt: skip
    core = SDPACoreAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self").cuda()
    s, b, hn = 512, 2, 64
    q = torch.randn(s, b, 8, hn, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s, b, groups, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fused = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                fused[backend.name] = core(q, k, v, None)
        except RuntimeError:
            continue
    assert fused, "neither the flash nor the cuDNN kernel ran SDPA core attention"
    r = 8 // groups
    scores = torch.einsum("sbhd,tbhd->bhst", q.float(), k.repeat_interleave(r, 2).float()) / hn**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    reference = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v.repeat_interleave(r, 2).float())
    for name, out in fused.items():
        torch.testing.assert_close(out.float(), reference.reshape(s, b, -1), rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.parametrize("groups", [8, 2])
def test_packed_documents_run_the_varlen_kernel_and_match_per_document_attention(world1, groups: int) -> None:
    """data.packing=documents on a GPU (bf16): `varlen_attn` runs (its causal keyword detected from this
    torch's signature) and equals causal SDPA run on each document alone (bf16 tolerance)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from test_attention import _cfg

    from megahet.models.attention import SDPACoreAttention, _varlen_attn, packed_documents
    from megahet.models.common import transformer_config

    assert _varlen_attn() is not None, "this torch has no usable torch.nn.attention.varlen.varlen_attn"
    cfg = _cfg(**{"model.hidden_size": 512, "model.num_attention_heads": 8, "model.num_query_groups": groups,
                  "train.precision": "bf16", "data.packing": "documents"})  # fmt: skip
    core = SDPACoreAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self").cuda()
    lengths, hn = [300, 17, 512, 83], 64
    t = sum(lengths)
    q = torch.randn(t, 8, hn, device="cuda", dtype=torch.bfloat16)  # thd: (tokens, heads, hn)
    k, v = (torch.randn(t, groups, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = core(q, k, v, None, packed_seq_params=packed_documents(cu, lengths))  # (t, 8*hn)
    expected = []
    for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        expected.append(
            F.scaled_dot_product_attention(
                qd.transpose(0, 1)[None].float(), kd.transpose(0, 1)[None].float(), vd.transpose(0, 1)[None].float(),
                is_causal=True, enable_gqa=groups != 8,
            )[0].transpose(0, 1).reshape(-1, 8 * hn)
        )  # fmt: skip
    torch.testing.assert_close(out.float(), torch.cat(expected), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
def test_cp_chunks_run_the_lower_right_causal_corner_in_a_fused_kernel(groups: int) -> None:
    """Context parallelism on CUDA (bf16): each CP rank's head-tail chunks attend to the keys up to their
    end with SDPA's lower-right causal bias, which the flash / efficient kernels take without a mask; every
    rank's output equals causal attention over the whole sequence at its tokens (bf16 tolerance)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megahet.models.block_attention import causal_chunk_spans
    from megahet.models.context_parallel import attend_spans, head_tail_chunks

    def sdpa(q, k, v, mask, dropout, causal, gqa):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

    cp, length, hn = 4, 256, 64
    s = 2 * cp * length
    q = torch.randn(1, 8, s, hn, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, groups, s, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != 8)
    for rank in range(cp):
        chunks = head_tail_chunks(rank, cp)
        mine = torch.cat([torch.arange(c * length, (c + 1) * length) for c in chunks]).cuda()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # no math fallback
            out = attend_spans(q[:, :, mine], k, v, causal_chunk_spans(chunks, length), sdpa)
        torch.testing.assert_close(out.float(), whole[:, :, mine].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
def test_placed_slices_attend_their_document_keys_in_a_fused_kernel(groups: int) -> None:
    """Dynamic CP placement on CUDA (bf16): each rank's slices (whole documents and blocks of cut ones, from
    the planner with a half-speed rank) attend to their documents' keys assembled as the all-to-all would
    (megahet/models/cp_placed.py), lower-right causal SDPA per slice in the flash / efficient kernels; every
    rank's output equals causal attention inside each whole document at its tokens (bf16 tolerance)."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megahet.models.context_parallel import attend_spans
    from megahet.models.cp_placed import PlacedLayout
    from megahet.policy.cp_placement import dynamic_cp_plan
    from megahet.policy.packing import DocCost

    def sdpa(q, k, v, mask, dropout, causal, gqa):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

    lengths, hn = [3000, 200, 1200, 64, 700], 64
    plan = dynamic_cp_plan(lengths, DocCost(a=1e-8, b=1e-6, c=0.0), [1.0, 0.5, 1.0, 1.0], block=256)
    assert not all(plan.whole())  # some document is cut across ranks
    t = sum(lengths)
    q = torch.randn(1, 8, t, hn, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, groups, t, hn, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    whole = torch.cat(
        [F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=groups != 8)
         for x in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], dim=2,
    )  # fmt: skip
    layout = PlacedLayout(plan)
    for rank in range(plan.cp):
        mine = torch.from_numpy(layout.local_positions(rank)).cuda()
        keys = torch.from_numpy(
            layout.key_positions(rank).astype(np.int64)
        ).cuda()  # what the exchange assembles
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # no math fallback
            out = attend_spans(q[:, :, mine], k[:, :, keys], v[:, :, keys], layout.spans(rank), sdpa)
        torch.testing.assert_close(out.float(), whole[:, :, mine].float(), rtol=2e-2, atol=2e-2)


def test_balancer_trace_on_the_gpu_times_compute_and_fixed_work_with_cuda_events(tmp_path: Path) -> None:
    """pretrain_gpt --balance.mode semi --balance.trace on one GPU: every step's row carries the layers'
    compute, the fixed work and its optimizer part (issue 31), all read from CUDA events: positive, the
    optimizer step a part of the fixed work, and the plan's efficiency E in (0, 1]."""
    trace = tmp_path / "semi.jsonl"
    cmd = [sys.executable, "pretrain_gpt.py", "--train.train_iters", "8", "--train.log_interval", "4",
           "--train.eval_interval", "8", "--logging.wandb", "false", "--balance.mode", "semi",
           "--balance.trace", str(trace)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) >= 6, rows
    for row in rows[2:]:  # past the warm-up steps
        compute, fixed, optimizer = row["compute_s"][0][0], row["fixed_s"][0][0], row["optimizer_s"][0][0]
        assert compute > 0 and fixed > 0 and 0 < optimizer <= fixed, row
        assert 0 < row["efficiency"][0] <= 1.0 + 1e-6, row


def test_elastic_restart_reads_a_cpu_checkpoint_into_a_gpu_engine(tmp_path: Path) -> None:
    """Issue 32's parallel elastic read into CUDA fragments: a DP 2 checkpoint saved by two CPU ranks (gloo)
    resumes on one GPU. The rank reads its own slices (weights, fp32 masters and both saved ZeRO fragments'
    Adam moments) memory-mapped from the saved files straight into its GPU engine, and training goes on
    along the CPU run's curve (fp32; CPU and GPU kernels sum in other orders)."""
    import shutil

    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from harness import GPT_MODEL, read_records, short_run

    from megahet.launch import free_port

    steps = 8
    args = [*GPT_MODEL, *short_run(steps), "--train.save_interval", "4"]
    cpu_env = _env(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
              "--master_port", str(free_port()), "pretrain_gpt.py"]  # fmt: skip
    reference = [*args, "--train.save", str(tmp_path / "ref"),
                 "--logging.metrics_file", str(tmp_path / "ref.jsonl")]  # fmt: skip
    out = subprocess.run([*launch, *reference], cwd=REPO, env=cpu_env, capture_output=True, text=True,
                         timeout=900, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    resume = tmp_path / "ck"
    shutil.copytree(tmp_path / "ref" / "iter_0000004", resume / "iter_0000004")
    (resume / "latest").write_text("iter_0000004")
    gpu = [*args, "--train.load", str(resume), "--train.save", str(tmp_path / "gpu"),
           "--logging.metrics_file", str(tmp_path / "gpu.jsonl")]  # fmt: skip
    out = subprocess.run([sys.executable, "pretrain_gpt.py", *gpu], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=900, check=False)  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "read its own slices of" in log and "resharded from TP 1 x PP 1 x DP 2" in log, log[-3000:]
    expected, actual = read_records(tmp_path / "ref.jsonl"), read_records(tmp_path / "gpu.jsonl")
    assert max(actual) == steps
    for step in range(5, steps + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert actual[step][key] == pytest.approx(expected[step][key], rel=2e-3), (step, key)
