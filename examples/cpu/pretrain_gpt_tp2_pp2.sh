#!/usr/bin/env bash
# The main job: a small GPT on Shakespeare + the King James Bible, TP=2 x PP=2 on 4 CPU ranks (gloo).
# Rank 0 prepares the corpus, tokenizer and indexed dataset under ~/.cache/megahet/gpt when missing.
#   bash examples/cpu/pretrain_gpt_tp2_pp2.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # 4 ranks share the cores: one thread each
exec torchrun --nproc_per_node 4 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/gpt_tp2_pp2.yaml "$@"
