#!/usr/bin/env bash
# The multi-GPU run of the megatron backend in one command, on one host with 2-8 GPUs, from the checkout's root:
#   bash scripts/megatron_multi_gpu.sh
# 1. tests/test_megatron_parallel.py on 2 GPUs (NCCL, no CPU shims): TP=2 (also sequence parallel), PP=2, CP=2,
#    DP=2 (also with the distributed optimizer) against single-rank HF, a checkpoint saved at TP=2 loaded at TP=1,
#    vocab-parallel log-probs;
# 2. benchmarks/megatron_scale.py: the full train() of a 7B Llama shape at TP=2 x PP=2 x DP (all GPUs; full
#    recompute + distributed optimizer), the ~0.9B shape at TP=1 / DP = all GPUs, and at CP=2 with 8k-token rows;
#    JSON + logs under $OUT.
# rollflow need not be installed: scripts/use_checkout.sh maps the checkout (see docs/megatron.md for the wheels).
# Knobs (env): GPUS (default: all visible), SCALE_ARGS (extra benchmark flags, e.g. "--spec te --sp"), *_TIMEOUT.
set -uo pipefail
OUT=${OUT:-./multi-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/use_checkout.sh" || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
GPUS=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
rc=0
timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron_parallel.py \
  > "$OUT/pytest_parallel_gpu.log" 2>&1 || rc=1
tail -3 "$OUT/pytest_parallel_gpu.log"
if [ "$GPUS" -ge 4 ]; then
  timeout "${SCALE_TIMEOUT:-600}" python3 benchmarks/megatron_scale.py --preset 7b --gpus "$GPUS" --tp 2 --pp 2 \
    --out "$OUT" ${SCALE_ARGS:-} > "$OUT/scale_7b_tp2_pp2.log" 2>&1 || rc=1
  tail -25 "$OUT/scale_7b_tp2_pp2.log"
fi
timeout "${SCALE_TIMEOUT:-600}" python3 benchmarks/megatron_scale.py --preset 0.9b --gpus "$GPUS" --seq 2048 \
  --micro-batch 4 --out "$OUT" ${SCALE_ARGS:-} > "$OUT/scale_0.9b.log" 2>&1 || rc=1
tail -25 "$OUT/scale_0.9b.log"
timeout "${SCALE_TIMEOUT:-600}" python3 benchmarks/megatron_scale.py --preset 0.9b --gpus "$GPUS" --cp 2 --seq 8192 \
  --micro-batch 1 --out "$OUT" ${SCALE_ARGS:-} > "$OUT/scale_0.9b_cp2.log" 2>&1 || rc=1
tail -25 "$OUT/scale_0.9b_cp2.log"
exit $rc
