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
  healthy device: what measuring and deciding cost.

MFU = model FLOPs per step (Megatron's count: 3 x forward matmuls incl. attention scores and logits, no
recompute) / step time / the bf16 matrix rate measured here first (8192^3 products). On CPU (no GPU) it
runs fp32 as a smoke test of the script. Writes benchmarks/results/gpu_throughput.{md,json}.
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
from megahet.training import setup


def model_flops_per_step(layers: int, hidden: int, ffn: int, seq: int, vocab: int, tokens: int) -> float:
    """Training FLOPs of one step without recompute: 3 x the forward's matmuls (QKV, projection, both MLP
    linears, attention scores and values over the full s x s, logits), as Megatron counts them."""
    per_token_forward = layers * (
        2 * hidden * 3 * hidden + 2 * hidden * hidden + 4 * hidden * ffn + 4 * seq * hidden
    )
    return 3.0 * tokens * (per_token_forward + 2 * hidden * vocab)


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

    model = build_gpt(cfg, vocab_size, local_layer_spec()).to(device())
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


def base_args(args) -> list[str]:
    precision = "bf16" if cuda_available() else "fp32"
    values = {
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


def main() -> None:
    parser = model_parser(__doc__.split("\n")[0], layers=24, seq=2048, micro=4, accum=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per timed block")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    runs = {}
    runs["megahet"], megahet_opt, cfg, params = megahet_step_fn(args, [])
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    runs["megahet+measuring"], *_ = megahet_step_fn(args, ["--balance.trace", str(trace)])
    runs["megahet+balancer"], *_ = megahet_step_fn(args, ["--balance.mode", "semi"])
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
    flops = model_flops_per_step(args.layers, args.hidden, cfg.model.ffn_size, args.seq, padded, tokens)
    peak = matmul_rate() if cuda_available() else float("nan")
    rows = []
    reference = statistics.median(seconds["mcore"]) if "mcore" in seconds else float("nan")
    for name, samples in seconds.items():
        step_s = statistics.median(samples)
        rows.append({
            "system": name, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "tflops_per_s": flops / step_s / 1e12, "mfu": flops / step_s / peak,
            "vs_mcore": reference / step_s,
        })  # fmt: skip
    meta = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq, "micro": args.micro,
        "accum": args.accum, "vocab_padded": padded, "tokens_per_step": tokens, "model_flops_per_step": flops,
        "matmul_tflops_measured": peak / 1e12, "rounds": args.rounds, "steps_per_block": args.steps,
        "device": torch.cuda.get_device_name() if cuda_available() else "cpu", "torch": torch.__version__,
        "precision": cfg.train.precision, "optimizers": {"megahet": megahet_opt, "mcore": mcore_opt},
        "block_seconds": seconds, "parameters": params,
    }  # fmt: skip
    save_results(
        "gpu_throughput", rows, ["system", "step_s", "tokens_per_s", "tflops_per_s", "mfu", "vs_mcore"], meta
    )


if __name__ == "__main__":
    main()
