#!/usr/bin/env bash
# A small Llama-style model, TP=2 on 2 CPU ranks (gloo), SEMI balancer on, rank 1 slowed from step 60 to 140.
#   bash examples/cpu/pretrain_llama_tp2.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # the ranks share the cores: one thread each
exec torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/llama_tp2.yaml "$@"
