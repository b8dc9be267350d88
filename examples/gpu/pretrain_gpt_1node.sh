#!/usr/bin/env bash
# One node of 8 GPUs (NCCL): TP=2 x PP=2 x DP=2. apex / Transformer Engine fused kernels are used by
# megatron-core when installed, never required.
#   bash examples/gpu/pretrain_gpt_1node.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec torchrun --nproc_per_node "${GPUS_PER_NODE:-8}" pretrain_gpt.py --config examples/gpu/gpt_tp2_pp2_dp2.yaml "$@"
