#!/usr/bin/env bash
# All GPU checks of the megatron backend in one call on the H200 (the `run` device tool), e.g.
#   run(command="bash scripts/gpu_checks.sh", carry=[".whl"], timeout_s=600)
# .whl holds megatron-core 0.19.2 + pydantic (and its deps) for Python 3.12: docs/megatron.md says how to
# fetch them. Writes gpu_checks.json, train_throughput.json and logs under $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))"
rc=0
timeout "${GPU_CHECKS_TIMEOUT:-200}" python3 benchmarks/gpu_checks.py --out "$OUT" > "$OUT/gpu_checks.log" 2>&1 || rc=1
grep -E "^(PASS|FAIL|all_pass)" "$OUT/gpu_checks.log" || tail -20 "$OUT/gpu_checks.log"
timeout "${PYTEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_megatron_gpu.py \
  > "$OUT/pytest_gpu.log" 2>&1 || rc=1
tail -3 "$OUT/pytest_gpu.log"
timeout "${THROUGHPUT_TIMEOUT:-270}" python3 benchmarks/train_throughput.py --out "$OUT" ${THROUGHPUT_ARGS:-} \
  > "$OUT/train_throughput.log" 2>&1 || rc=1
sed -n '/== train throughput/,$p' "$OUT/train_throughput.log"; grep -E '"error"' "$OUT/train_throughput.log" | cut -c1-400
exit $rc
