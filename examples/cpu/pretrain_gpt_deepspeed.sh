#!/usr/bin/env bash
# The main job through the DeepSpeed launcher (DS_ACCELERATOR=cpu is set by megahet when CUDA is absent),
# with a user ds_config merged over the one megahet builds.
#   bash examples/cpu/pretrain_gpt_deepspeed.sh [--section.key value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec deepspeed --num_accelerators 4 --master_port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py --config examples/cpu/gpt_tp2_pp2.yaml --deepspeed_config examples/ds_config_zero1.json "$@"
