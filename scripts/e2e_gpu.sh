#!/usr/bin/env bash
# The end-to-end iteration suite (issue 37, docs/performance.md section 7) on one CUDA GPU, from the checkout's root:
#   bash scripts/e2e_gpu.sh
# Shapes 0.5b and 1.5b, then the largest shape that fits: the LARGEST candidates are tried biggest first and the
# first that completes is kept (with offload on, the trainer's state goes to pinned host memory, so host memory
# decides the fit as much as GPU memory does). One process per shape, so each starts on an empty GPU.
# Needs torch + transformers + pydantic (+ megatron-core for the megatron trainer; without it the torch trainer
# runs and the JSON says so); rollflow need not be installed (scripts/use_checkout.sh maps the checkout).
# Writes benchmarks/results/<gpu>-<date>-e2e-<shape>.json, and logs and the stage plot (e2e-stages.png, when
# matplotlib is installed) under $OUT (default ./gpu-out).
# Knobs (env): SHAPES (default "0.5b 1.5b"; empty: skip), LARGEST (default "5b 3b"; empty: skip), E2E_ARGS (e.g. --quick,
# --repeats 5), E2E_TIMEOUT (seconds per shape, default 1200), RESULTS (default benchmarks/results), COMPILE_CACHE (a
# folder: each shape's process starts with an empty TORCHINDUCTOR_CACHE_DIR, as on a fresh node, and loads / writes
# torch.compile's caches there, store.compile_cache's mechanism; list a shape twice in SHAPES to see the second
# first iteration start warm).
set -uo pipefail
source "$(dirname "$0")/gpu_bench_env.sh" || exit 1  # OUT, RESULTS, stem; the checkout as rollflow.*

run_shape() {
  local shape=$1 cache=()
  local json="$RESULTS/$stem-e2e-$shape.json" log="$OUT/e2e-$shape.log"
  if [ -n "${COMPILE_CACHE:-}" ]; then
    cache=(--compile-cache "$COMPILE_CACHE")
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    export TORCHINDUCTOR_CACHE_DIR
    local n=1
    while [ -e "$json" ]; do n=$((n + 1)); json="$RESULTS/$stem-e2e-$shape-run$n.json"; log="$OUT/e2e-$shape-run$n.log"; done
  fi
  echo "== e2e $shape -> $json"
  written+=("$json")
  # shellcheck disable=SC2086  # E2E_ARGS is a list of flags
  timeout "${E2E_TIMEOUT:-1200}" python3 -m benchmarks --suite e2e --shape "$shape" --no-table --out "$json" \
    "${cache[@]}" ${E2E_ARGS:-} > "$log" 2>&1
  local rc=$?
  sed -n '/^e2e /,/overhead/p' "$log"
  if [ $rc != 0 ]; then
    # what it measured before failing stays with the logs, out of the results folder
    [ -f "$json" ] && [ "$(cd "$RESULTS" && pwd)" != "$(cd "$OUT" && pwd)" ] && mv "$json" "$OUT/"
    echo "e2e $shape FAILED (rc $rc); the end of $log:"
    tail -5 "$log"
  fi
  return $rc
}

rc=0
written=()  # this run's JSON, for the stage plot
for shape in ${SHAPES-0.5b 1.5b}; do
  run_shape "$shape" || rc=1
done
largest=""
for shape in ${LARGEST-5b 3b}; do
  if run_shape "$shape"; then
    largest=$shape
    break
  fi
done
if [ -n "${LARGEST-5b 3b}" ]; then
  if [ -n "$largest" ]; then echo "largest shape that fits: $largest"; else echo "no LARGEST shape fit"; rc=1; fi
fi
# the stage breakdown of every shape that finished, as stacked bars (docs/performance.md section 7)
done_json=()
for json in "${written[@]}"; do [ -f "$json" ] && done_json+=("$json"); done
if [ ${#done_json[@]} -gt 0 ]; then
  if python3 -c "import matplotlib" 2>/dev/null; then
    python3 -m benchmarks.plot_e2e "${done_json[@]}" --out "$OUT/e2e-stages.png" | tail -1
  else
    echo "no stage plot: matplotlib is not installed (pip install matplotlib; then python3 -m benchmarks.plot_e2e $RESULTS/*-e2e-*.json)"
  fi
fi
exit $rc
