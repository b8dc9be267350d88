"""Training throughput and model-FLOPs utilization on one GPU: megahet's trainer against plain megatron-core.

    python benchmarks/gpu_throughput.py [--layers 24 --hidden 1024 --heads 16 --seq 2048 --micro 4 --accum 2]
                                        [--steps 8 --rounds 3] [--vocab-size 8192]

One process, one GPU, bf16, the same GPT (megatron-core GPTModel, local layer spec, learned positions,
tied embeddings) trained three ways on the shipped corpus's tokens, in interleaved blocks of `--steps`
optimizer steps so that all three see the same machine:

- `mcore`: plain megatron-core, as its own training loop drives it: DistributedDataParallel (fp32 grad
  buffer), get_forward_backward_func's schedule, get_megatron_optimizer (fp32 main params, grad clip);
- `megahet`: megahet's Trainer (DeepSpeed ZeRO-1 engine, bf16, the same schedule) with no balancer;
- `megahet+measuring`: the same with the balancer measuring only (`--balance.trace`, mode static):
  resizable layers and the CUDA-event clock, no planning;
- `megahet+balancer`: the SEMI balancer running (measuring and a planning decision every step) on a
  healthy device: what measuring and deciding cost;
- `megahet+NAME` for each `--ds-variant NAME=JSON`: megahet with that ds_config, e.g.
  `--ds-variant contiguous='{"zero_optimization": {"contiguous_gradients": true}}'`.

`--arch llama` trains the Llama shape instead (rotary positions, RMSNorm, SwiGLU with `--ffn`, `--groups`
key/value heads, untied output layer, no biases), e.g. the 0.6 B model of examples/gpu:

    python benchmarks/gpu_throughput.py --arch llama --layers 24 --hidden 1536 --heads 12 --groups 4 \
        --ffn 4096 --seq 2048 --micro 4 --accum 2 --profile --name gpu_throughput_llama

Model FLOPs per step (Megatron's count, no recompute): 3 x tokens x (layers x [4 h^2 + 4 h kv + 2 h ffn x
(3 SwiGLU | 2 GELU) + 2 s h] + 2 h V), kv = h x groups / heads, the attention term the causal half flash
attention computes (megahet/policy/flops.py). MFU is taken against the card's dense bf16 spec peak
(989 TFLOP/s, H100 / H200 SXM: `mfu_spec`) and against the matrix rate measured here first (8192^3
products: `mfu_measured`). `--profile` adds one step of megahet, megahet+measuring and megatron-core under
torch.profiler: wall time, kernel time (the rest: idle gaps) and the top kernels by device time. On CPU
(no GPU) it runs fp32 as a smoke test of the script. Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

import pretrain_gpt
from benchmarks.common import save_results
from megahet.config import load_config
from megahet.platform import cuda_available, device, synchronize
from megahet.policy.flops import output_layer_flops, transformer_layer_flops
from megahet.training import setup

SPEC_PEAK_TFLOPS = 989.0  # dense bf16, H100 and H200 SXM (the card's datasheet; MFU's denominator)


def model_flops_per_step(cfg, vocab: int, tokens: int) -> float:
    """Training FLOPs of one step without recompute: 3 x the forward's matmuls per token
    (megahet.policy.flops: Q, K/V and output projections, the MLP's 2 or 3 matrices, attention scores and
    values over the causal half of s x s that flash / cuDNN compute, logits), as Megatron counts them."""
    m = cfg.model
    layer = transformer_layer_flops(
        m.hidden_size, m.ffn_size, m.seq_length, heads=m.num_attention_heads, query_groups=m.query_groups,
        gated=m.activation == "swiglu", causal=True,
    )  # fmt: skip
    return 3.0 * tokens * (m.num_layers * layer + output_layer_flops(m.hidden_size, vocab))


def matmul_rate(size: int = 8192, repeats: int = 10) -> float:
    """Measured dense bf16 matrix rate in FLOP/s (the physical limit MFU is taken against)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3)


def mcore_step_fn(cfg, vocab_size: int, accum: int):
    """One optimizer step of plain megatron-core (its DDP, schedule and optimizer) on the same GPT."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from megahet.models.common import local_layer_spec
    from megahet.models.gpt import build_gpt

    spec = local_layer_spec(attention=cfg.model.attention, normalization=cfg.model.normalization)
    model = build_gpt(cfg, vocab_size, spec).to(device())
    if cfg.train.precision == "bf16":  # as megatron's get_model does: bf16 params, fp32 in/out casts
        model = Float16Module(model.config, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    model = DistributedDataParallel(model.config, ddp, model)
    model.config.finalize_model_grads_func = finalize_model_grads  # as megatron's training loop sets them
    model.config.no_sync_func = model.no_sync
    t = cfg.train
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
                        bf16=t.precision == "bf16", params_dtype=model.config.params_dtype),
        [model],
    )  # fmt: skip
    micro, seq = t.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, vocab_size, (micro, seq + 1), device=device())  # (b, s+1)
    positions = torch.arange(seq, device=device()).expand(micro, seq)  # (b, s)

    def forward_step(data_iterator, module):
        out = module(tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # (b, s) per-token losses
        return out, lambda loss: (loss.float().mean(), {})

    forward_backward = get_forward_backward_func()

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(range(accum)), model=[model],
                         num_microbatches=accum, seq_length=seq, micro_batch_size=micro, forward_only=False)  # fmt: skip
        optimizer.step()

    return step, type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__


def megahet_step_fn(args, extra: list[str]):
    cfg = load_config([*base_args(args), *extra])
    trainer = setup(cfg, pretrain_gpt.SPEC)
    params = sum(p.numel() for p in trainer.task.model.parameters())
    return trainer.train_step, type(trainer.engine.optimizer.optimizer).__name__, cfg, params


LLAMA = {
    "model.position_embedding_type": "rope", "model.normalization": "RMSNorm", "model.activation": "swiglu",
    "model.untie_embeddings_and_output_weights": "true", "model.add_bias_linear": "false",
    "model.rotary_base": 500000,
}  # fmt: skip


def base_args(args) -> list[str]:
    precision = "bf16" if cuda_available() else "fp32"
    arch = dict(LLAMA) if getattr(args, "arch", "gpt") == "llama" else {}
    if getattr(args, "groups", 0):
        arch["model.num_query_groups"] = args.groups
    if getattr(args, "ffn", 0):
        arch["model.ffn_hidden_size"] = args.ffn
    values = {
        **arch, "model.attention": getattr(args, "attention", "sdpa"),
        "model.num_layers": args.layers, "model.hidden_size": args.hidden, "model.num_attention_heads": args.heads,
        "model.seq_length": args.seq, "train.precision": precision, "train.micro_batch_size": args.micro,
        "train.global_batch_size": args.micro * args.accum, "train.train_iters": 10**6,
        "train.lr_warmup_iters": 1, "train.log_interval": 10**6, "train.eval_interval": 10**6,
        "logging.wandb": "false", "data.vocab_size": args.vocab_size,
    }  # fmt: skip
    return [part for key, value in values.items() for part in (f"--{key}", str(value))]


def timed_block(step, steps: int) -> float:
    synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return (time.perf_counter() - t0) / steps


def model_parser(description: str, layers: int, seq: int, micro: int, accum: int) -> argparse.ArgumentParser:
    """The GPT's shape and batch as arguments (read by `base_args`), with these defaults."""
    parser = argparse.ArgumentParser(description=description)
    for name, default in (("layers", layers), ("hidden", 1024), ("heads", 16), ("seq", seq), ("micro", micro),
                          ("accum", accum), ("vocab-size", 8192)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser


def profile_step(step, top: int = 15) -> dict:
    """One step under torch.profiler: its wall time, the time the GPU ran kernels (the rest is idle gaps
    between launches), and the `top` kernels by device time with their share of the kernel time (CPU ops
    by self CPU time without a GPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = cuda_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    step()  # outside the profile: nothing lazily built inside it
    synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        synchronize()
        wall = time.perf_counter() - t0
    if gpu:  # kernels only: an op's device time is its kernels', counted once
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        key = "self_device_time_total"
    else:
        events, key = list(prof.key_averages()), "self_cpu_time_total"
    events = [e for e in events if getattr(e, key, 0) > 0]
    busy = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, key))
    kernels = [
        {"kernel": e.key[:90], "calls": e.count, "ms": getattr(e, key) / 1e3, "share": getattr(e, key) / busy}
        for e in events[:top]
    ]
    return {"wall_ms": wall * 1e3, "kernels_ms": busy / 1e3, "idle_share": 1 - busy / 1e3 / (wall * 1e3),
            "top": kernels}  # fmt: skip


def main() -> None:
    parser = model_parser(__doc__.split("\n")[0], layers=24, seq=2048, micro=4, accum=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per timed block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--groups", type=int, default=0, help="key/value heads (0: one per head)")
    parser.add_argument("--ffn", type=int, default=0, help="MLP units (0: 4 x hidden)")
    parser.add_argument("--attention", choices=["sdpa", "local"], default="sdpa")
    parser.add_argument("--profile", action="store_true", help="also profile one megahet step")
    parser.add_argument("--name", default="gpu_throughput", help="results file name")
    parser.add_argument("--ds-variant", action="append", default=[], metavar="NAME=JSON",
                        help="also time megahet with this ds_config, as megahet+NAME (repeatable)")  # fmt: skip
    args = parser.parse_args()

    runs = {}
    runs["megahet"], megahet_opt, cfg, params = megahet_step_fn(args, [])
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    runs["megahet+measuring"], *_ = megahet_step_fn(args, ["--balance.trace", str(trace)])
    runs["megahet+balancer"], *_ = megahet_step_fn(args, ["--balance.mode", "semi"])
    for variant in args.ds_variant:  # megahet with a ds_config on top, in the same interleaved blocks
        name, _, settings = variant.partition("=")
        ds_json = trace.parent / f"{name}.json"
        ds_json.write_text(settings)
        runs[f"megahet+{name}"], *_ = megahet_step_fn(args, ["--train.deepspeed_config", str(ds_json)])
    vocab = pretrain_gpt.SPEC.vocab_size(cfg)
    mcore_opt = "needs CUDA (megatron-core's optimizer allocates its loss scale there)"
    if cuda_available():
        runs["mcore"], mcore_opt = mcore_step_fn(cfg, vocab, args.accum)
    for step in runs.values():  # warm-up: kernels, allocator, DeepSpeed's first step
        timed_block(step, 2)
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, step in runs.items():
            seconds[name].append(timed_block(step, args.steps))

    from megahet.models.gpt import padded_vocab_size

    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, 1)
    tokens = args.micro * args.accum * args.seq
    flops = model_flops_per_step(cfg, padded, tokens)
    peak = matmul_rate() if cuda_available() else float("nan")
    spec_peak = SPEC_PEAK_TFLOPS * 1e12 if cuda_available() else float("nan")
    rows = []
    reference = statistics.median(seconds["mcore"]) if "mcore" in seconds else float("nan")
    for name, samples in seconds.items():
        step_s = statistics.median(samples)
        rows.append({
            "system": name, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "tflops_per_s": flops / step_s / 1e12, "mfu_spec": flops / step_s / spec_peak,
            "mfu_measured": flops / step_s / peak, "vs_mcore": reference / step_s,
        })  # fmt: skip
    meta = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "micro": args.micro,
        "accum": args.accum, "vocab_padded": padded, "tokens_per_step": tokens, "model_flops_per_step": flops,
        "matmul_tflops_measured": peak / 1e12, "rounds": args.rounds, "steps_per_block": args.steps,
        "device": torch.cuda.get_device_name() if cuda_available() else "cpu", "torch": torch.__version__,
        "precision": cfg.train.precision, "optimizers": {"megahet": megahet_opt, "mcore": mcore_opt},
        "block_seconds": seconds, "parameters": params, "arch": args.arch, "attention": args.attention,
        "query_groups": cfg.model.query_groups, "ffn": cfg.model.ffn_size, "spec_peak_tflops": SPEC_PEAK_TFLOPS,
        "flops_formula": "3 x tokens x (layers x [4h^2 + 4h kv + 2h ffn (3 SwiGLU, 2 GELU) + 2 s h] + 2 h V)",
    }  # fmt: skip
    if args.profile:  # megahet's step (plain and measuring) and plain megatron-core's, side by side
        profiled = ("megahet", "megahet+measuring", "mcore")
        meta["profile"] = {name: profile_step(runs[name]) for name in profiled if name in runs}
    columns = ["system", "step_s", "tokens_per_s", "tflops_per_s", "mfu_spec", "mfu_measured", "vs_mcore"]
    save_results(args.name, rows, columns, meta)


if __name__ == "__main__":
    main()
