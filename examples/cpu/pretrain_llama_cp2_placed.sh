#!/usr/bin/env bash
# Long packed documents over 2 CP ranks, placed per micro-batch by cost and the ranks' measured speeds
# (context parallelism, docs/context_parallel.md).
#   bash examples/cpu/pretrain_llama_cp2_placed.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # the ranks share the cores: one thread each
exec torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/llama_cp2_placed.yaml "$@"
