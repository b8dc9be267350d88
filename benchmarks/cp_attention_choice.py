"""Which causal attention a context-parallel rank runs on CPU: SDPA with a lower-right causal bias, or key
blocks merged by log-sum-exp (megahet/models/block_attention.py). Measured side by side, one process.

    python benchmarks/cp_attention_choice.py [--lengths 512,1024,2048] [--cp 2] [--heads 4 --groups 2 --hn 64]
                                             [--repeats 5]

For each chunk length L, one CP rank's queries (rank 0 of `--cp`: chunks 0 and 2cp - 1, 2L tokens) attend
to the whole sequence's keys (2 cp L), forward and backward, fp32. Per algorithm: the median wall time
(interleaved rounds), the bytes autograd saves for the backward (`saved_tensors_hooks`, each storage once),
and the exactness against SDPA over the whole sequence restricted to the rank's queries. Writes
benchmarks/results/cp_attention_choice.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from benchmarks.common import interleaved_medians, save_results
from megahet.models.block_attention import causal_chunk_spans, merged_block_attention
from megahet.models.context_parallel import head_tail_chunks


def lower_right(q, k, v, chunks, length: int) -> torch.Tensor:
    """The SDPA path: each query chunk against the keys up to its end, causal in its lower-right corner."""
    out = []
    for half, chunk in zip(q.split(length, dim=2), chunks):
        end = (chunk + 1) * length
        kv = [x[:, :, :end] for x in (k, v)]
        out.append(
            F.scaled_dot_product_attention(
                half, *kv, attn_mask=causal_lower_right(length, end), enable_gqa=True
            )
        )
    return torch.cat(out, dim=2)  # (b, np, 2L, hn)


def merged(q, k, v, chunks, length: int) -> torch.Tensor:
    return merged_block_attention(q, k, v, causal_chunk_spans(chunks, length))


ALGORITHMS = {"sdpa_lower_right": lower_right, "merged_blocks": merged}


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `fn` runs its forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(args, length: int) -> list[dict]:
    cp, chunks = args.cp, head_tail_chunks(0, args.cp)
    s = 2 * cp * length
    torch.manual_seed(0)
    q_all = torch.randn(1, args.heads, s, args.hn)  # (b, np, s, hn)
    k = torch.randn(1, args.groups, s, args.hn, requires_grad=True)  # (b, ng, s, hn)
    v = torch.randn(1, args.groups, s, args.hn, requires_grad=True)
    rows = torch.cat([torch.arange(c * length, (c + 1) * length) for c in chunks])
    q = q_all[:, :, rows].clone().requires_grad_()  # (b, np, 2L, hn): the rank's queries
    reference = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True)[
        :, :, rows
    ].detach()
    grad = torch.randn_like(reference)

    def step(name: str):
        def run() -> None:
            ALGORITHMS[name](q, k, v, chunks, length).backward(grad)

        return run

    times = interleaved_medians({name: step(name) for name in ALGORITHMS}, args.repeats)
    out = []
    for name, fn in ALGORITHMS.items():
        error = (fn(q, k, v, chunks, length).detach() - reference).abs().max().item()
        stored = saved_bytes(lambda fn=fn: fn(q, k, v, chunks, length))
        out.append({"L": length, "keys": s, "algorithm": name, "fwd_bwd_ms": 1e3 * times[name],
                    "saved_mb": stored / 2**20, "max_abs_err": error})  # fmt: skip
    base = out[0]
    for row in out:
        row["time_vs_sdpa"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        row["saved_vs_sdpa"] = row["saved_mb"] / base["saved_mb"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048", help="query chunk lengths L")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2, help="key / value heads (grouped-query attention)")
    parser.add_argument("--hn", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for length in map(int, args.lengths.split(",")) for row in measure(args, length)]
    columns = [
        "L",
        "keys",
        "algorithm",
        "fwd_bwd_ms",
        "time_vs_sdpa",
        "saved_mb",
        "saved_vs_sdpa",
        "max_abs_err",
    ]
    save_results("cp_attention_choice", rows, columns, vars(args))


if __name__ == "__main__":
    main()
