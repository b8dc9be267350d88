"""Training throughput of SDPA core attention against megatron-core's local attention, side by side.

    python benchmarks/attention_throughput.py [--seqs 512,2048] [--layers 4 --hidden 256 --heads 8 --groups 2]
                                              [--micro 1 --accum 2 --steps 3 --rounds 3]

One process (CPU: fp32, gloo; GPU: bf16), megahet's Trainer on the shipped corpus, a Llama-shaped GPT
(rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied output layer, no biases). For every
sequence length both kernels train the same model in interleaved blocks of `--steps` optimizer steps (so
that machine noise hits both alike); the table gives tokens/s of each, their ratio, and on a GPU the peak
memory of a step. `local` materializes the scores [b*heads, s, s] and runs an unfused fp32 softmax;
`sdpa` is torch's fused kernel (flash / cuDNN on GPUs, a flash-style kernel on CPU).
Writes benchmarks/results/attention_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

import pretrain_gpt
from benchmarks.common import save_results
from benchmarks.gpu_throughput import timed_block
from megahet.config import load_config
from megahet.platform import cuda_available
from megahet.training import setup

KERNELS = ("sdpa", "local")


def trainer_args(args, seq: int, attention: str) -> list[str]:
    values = {
        "model.num_layers": args.layers, "model.hidden_size": args.hidden, "model.num_attention_heads": args.heads,
        "model.num_query_groups": args.groups, "model.ffn_hidden_size": args.ffn, "model.seq_length": seq,
        "model.position_embedding_type": "rope", "model.normalization": "RMSNorm", "model.activation": "swiglu",
        "model.untie_embeddings_and_output_weights": "true", "model.add_bias_linear": "false",
        "model.attention": attention, "train.precision": "bf16" if cuda_available() else "fp32",
        "train.micro_batch_size": args.micro, "train.global_batch_size": args.micro * args.accum,
        "train.train_iters": 10**6, "train.lr_warmup_iters": 1, "train.log_interval": 10**6,
        "train.eval_interval": 10**6, "logging.wandb": "false",
    }  # fmt: skip
    return [part for key, value in values.items() for part in (f"--{key}", str(value))]


def peak_memory_gb(step) -> float:
    """Peak GPU memory of one step, in GB (nan on CPU)."""
    if not cuda_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("groups", 2), ("ffn", 704), ("micro", 1),
                          ("accum", 2), ("steps", 3), ("rounds", 3)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--seqs", default="512,2048", help="comma-separated sequence lengths")
    args = parser.parse_args()

    rows, seconds = [], {}
    for seq in (int(s) for s in args.seqs.split(",")):
        steps = {
            a: setup(load_config(trainer_args(args, seq, a)), pretrain_gpt.SPEC).train_step for a in KERNELS
        }
        memory = {a: peak_memory_gb(step) for a, step in steps.items()}  # also the warm-up
        for step in steps.values():
            timed_block(step, 1)
        samples = {a: [] for a in KERNELS}
        for _ in range(args.rounds):
            for a, step in steps.items():
                samples[a].append(timed_block(step, args.steps))
        seconds[seq] = samples
        tokens = args.micro * args.accum * seq
        rate = {a: tokens / statistics.median(s) for a, s in samples.items()}
        rows.append({
            "seq": seq, "sdpa_tokens_per_s": rate["sdpa"], "local_tokens_per_s": rate["local"],
            "sdpa_vs_local": rate["sdpa"] / rate["local"], "sdpa_peak_gb": memory["sdpa"],
            "local_peak_gb": memory["local"],
        })  # fmt: skip
    meta = {
        **{k: getattr(args, k) for k in ("layers", "hidden", "heads", "groups", "ffn", "micro", "accum", "steps",
                                         "rounds")},
        "device": torch.cuda.get_device_name() if cuda_available() else "cpu", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "block_seconds": seconds,
    }  # fmt: skip
    columns = [
        "seq",
        "sdpa_tokens_per_s",
        "local_tokens_per_s",
        "sdpa_vs_local",
        "sdpa_peak_gb",
        "local_peak_gb",
    ]
    save_results("attention_throughput" + ("" if cuda_available() else "_cpu"), rows, columns, meta)


if __name__ == "__main__":
    main()
