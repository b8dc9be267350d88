#!/usr/bin/env bash
# Several nodes through the DeepSpeed launcher and a hostfile (pdsh on this node, passwordless ssh from
# it to every node, the repo, venv and data at the same path on each; environment variables other than
# NCCL*/PYTHON*/UCX* reach the other nodes only through a .deepspeed_env file, see docs/launching.md):
# 2 nodes x 8 GPUs = TP=2 x PP=2 x DP=4.
#   bash examples/gpu/pretrain_gpt_multinode.sh [--section.key value ...]
# With torchrun instead, run on every node:
#   torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HEAD_NODE:29500 \
#       pretrain_gpt.py --config examples/gpu/gpt_tp2_pp2_dp2.yaml --train.global_batch_size 128
set -euo pipefail
cd "$(dirname "$0")/../.."
exec deepspeed --hostfile examples/gpu/hostfile --num_nodes 2 --num_gpus 8 \
    pretrain_gpt.py --config examples/gpu/gpt_tp2_pp2_dp2.yaml --deepspeed_config examples/ds_config_zero1.json \
    --train.global_batch_size 128 "$@"
