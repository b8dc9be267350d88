#!/usr/bin/env bash
# Packed documents (code-like lengths, up to 1024 tokens per micro-batch), DP=2 on 2 CPU ranks (gloo),
# replica 1 at half speed from step 20 to 60: documents follow the measured speeds.
#   bash examples/cpu/pretrain_gpt_packed.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # the ranks share the cores: one thread each
exec torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/gpt_packed_dp2.yaml "$@"
