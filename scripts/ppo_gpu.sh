#!/usr/bin/env bash
# PPO with a critic at the Qwen2-0.5B shape on one CUDA GPU (issue 36, docs/performance.md section 8): does the
# critic's value loss fall? From the checkout's root:
#   bash scripts/ppo_gpu.sh
# The rollout worker (hf engine), the policy trainer (torch) and the critic share the GPU in one process, bf16,
# random-init weights; reward: the share of response token ids below half the vocabulary (varies under a random
# policy). Default: 15 iterations of 32 prompts x 8 samples x 256 new tokens, 4 optimizer steps per rollout.
# Needs torch + transformers + pydantic; rollflow need not be installed (scripts/use_checkout.sh maps the
# checkout), and neither Ray nor Prefect.
# Writes benchmarks/results/<gpu>-<date>-ppo-0.5b.json and a log under $OUT (default ./gpu-out).
# Exit status: 0 the value loss fell (mean of the last 3 iterations below the first 3), 3 it did not, other: failed.
# Knobs (env): ITERATIONS (default 15), PPO_ARGS (e.g. "--new-tokens 128 --critic-lr 5e-5"),
# PPO_TIMEOUT (seconds, default 900), RESULTS (default benchmarks/results).
set -uo pipefail
source "$(dirname "$0")/gpu_bench_env.sh" || exit 1  # OUT, RESULTS, stem; the checkout as rollflow.*
json="$RESULTS/$stem-ppo-0.5b.json" log="$OUT/ppo-0.5b.log"
echo "== ppo 0.5b -> $json"
# shellcheck disable=SC2086  # PPO_ARGS is a list of flags
timeout "${PPO_TIMEOUT:-900}" python3 -m benchmarks.ppo_value_loss --shape 0.5b --device cuda --dtype bfloat16 \
  --iterations "${ITERATIONS:-15}" --prompts 32 --samples-per-prompt 8 --new-tokens 256 --out "$json" \
  ${PPO_ARGS:-} > "$log" 2>&1
rc=$?
grep -E '^\[ppo\]|^ppo |^wrote' "$log"
if [ $rc != 0 ] && [ $rc != 3 ]; then
  # what it measured before failing stays with the logs, out of the results folder
  [ -f "$json" ] && mv "$json" "$OUT/"
  echo "ppo 0.5b FAILED (rc $rc); the end of $log:"
  tail -5 "$log"
fi
exit $rc
