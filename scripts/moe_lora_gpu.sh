#!/usr/bin/env bash
# Issue 39's GPU figures on one CUDA GPU (docs/moe.md "On the H200", docs/architecture.md's LoRA entry), each
# benchmark in its own process. From the checkout's root:
#   bash scripts/moe_lora_gpu.sh
# 1. benchmarks.routing_replay_mismatch --shape 1b: a random-init ~1.85B Qwen3-MoE (a scaled-down Qwen3-30B-A3B:
#    hidden 1024, 16 layers, 64 experts, top-8), bf16: the hf engine samples 64 prompts x 4 x 128 new tokens at
#    temperature 1 with routes recorded, the torch trainer scores them without and with routing replay (R3);
#    mean / max |trainer - rollout| log-prob over the generated tokens, route flips. Exit 3 when R3 did not
#    lower the mismatch.
# 2. benchmarks.lora_memory --shapes 0.5b,1.5b: the train worker (torch backend), full-parameter vs LoRA (rank 16,
#    alpha 32, default targets), bf16, 64 samples x 512 tokens, micro-batch 8: trainable params, peak GPU memory
#    of a train call, step time (median of 3 after 1 warm-up).
# Needs torch + transformers + peft + pyarrow + pydantic; rollflow need not be installed (scripts/use_checkout.sh
# maps the checkout), and neither Ray nor Prefect.
# Writes benchmarks/results/<gpu>-<date>-r3-1b.json and <gpu>-<date>-lora.json, logs under $OUT (default ./gpu-out).
# Exit status: 0 both ran and R3 lowered the mismatch, 3 R3 did not lower it, other: a benchmark failed.
# Knobs (env): R3_ARGS / LORA_ARGS (extra flags, e.g. R3_ARGS="--new-tokens 64"), R3_TIMEOUT / LORA_TIMEOUT
# (seconds, default 300 each), RESULTS (default benchmarks/results).
set -uo pipefail
source "$(dirname "$0")/gpu_bench_env.sh" || exit 1  # OUT, RESULTS, stem; the checkout as rollflow.*

# bench NAME JSON TIMEOUT MODULE ARGS...: run one benchmark, show its summary lines, keep a failed run's JSON
# with the logs (out of the results folder).
bench() {
  local name=$1 json=$2 limit=$3 log="$OUT/$1.log"
  shift 3
  echo "== $name -> $json"
  timeout "$limit" python3 -m "$@" --device cuda --out "$json" --no-table > "$log" 2>&1
  local rc=$?
  grep -E '^\[r3\]|^\[lora\]|^r3 |^wrote' "$log"
  if [ $rc != 0 ] && [ $rc != 3 ]; then
    [ -f "$json" ] && mv "$json" "$OUT/"
    echo "$name FAILED (rc $rc); the end of $log:"
    tail -5 "$log"
  fi
  return $rc
}

# shellcheck disable=SC2086  # R3_ARGS / LORA_ARGS are lists of flags
bench r3-1b "$RESULTS/$stem-r3-1b.json" "${R3_TIMEOUT:-300}" benchmarks.routing_replay_mismatch --shape 1b \
  --dtype bfloat16 ${R3_ARGS:-}
r3=$?
# shellcheck disable=SC2086
bench lora "$RESULTS/$stem-lora.json" "${LORA_TIMEOUT:-300}" benchmarks.lora_memory --shapes 0.5b,1.5b \
  --dtype bfloat16 ${LORA_ARGS:-}
lora=$?
if [ $r3 != 0 ] && [ $r3 != 3 ]; then exit $r3; fi
if [ $lora != 0 ]; then exit $lora; fi
exit $r3
