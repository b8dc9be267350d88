#!/usr/bin/env bash
# A TP 2 job whose rank 1 is late to every collective escalates to TP 1 x DP 2 in place
# (escalation, docs/balancer.md).
#   bash examples/cpu/pretrain_gpt_tp2_escalate.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # the ranks share the cores: one thread each
exec torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/gpt_tp2_escalate.yaml "$@"
