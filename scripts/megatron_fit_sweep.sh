#!/usr/bin/env bash
# Which Llama shapes train on ONE GPU with the megatron backend (full activation recompute + Megatron's
# distributed optimizer, bf16, fp32 main grads and Adam), with peak memory per parameter. From the
# checkout's root on any CUDA machine:
#   bash scripts/megatron_fit_sweep.sh            # presets 0.9b 3b 7b, sequence 4096, 4 micro-batches of 1
# Each preset runs in its own process (an OOM leaves nothing behind for the next); results are
# $OUT/megatron-scale-<preset>-tp1-pp1-dp1.json, logs $OUT/scale-<preset>.log. Knobs (env): PRESETS, SEQ,
# MICRO_BATCHES, SCALE_TIMEOUT.
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/use_checkout.sh" || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
largest=none
for preset in ${PRESETS:-0.9b 3b 7b}; do
  if timeout "${SCALE_TIMEOUT:-300}" python3 benchmarks/megatron_scale.py --preset "$preset" --gpus 1 \
      --seq "${SEQ:-4096}" --micro-batch 1 --micro-batches "${MICRO_BATCHES:-4}" --iters 3 --out "$OUT" \
      > "$OUT/scale-$preset.log" 2>&1; then
    largest=$preset
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'fits: params', r['params_max_rank'], \
'peak GiB', round(r['peak_mem_gib_max_rank'],1), 'B/param', round(r['peak_bytes_per_param'],2), 'state B/param', \
round(r['state_bytes_per_param'],2), 'tokens/s', round(r['tokens_per_s']), 'MFU datasheet', round(r['mfu_vs_datasheet_989'],3), \
'MFU matmul', round(r['mfu_vs_measured_matmul'],3))" "$OUT/megatron-scale-$preset-tp1-pp1-dp1.json" "$preset"
  else
    echo "$preset did not fit or failed:"; grep -m2 -E "OutOfMemoryError|Error|error" "$OUT/scale-$preset.log" | cut -c1-300
  fi
done
echo "largest preset that trained: $largest"
