#!/usr/bin/env bash
# All GPU checks of the megatron backend in one command on any CUDA machine, from the checkout's root:
#   bash scripts/gpu_checks.sh
# rollflow need not be installed there: the checkout is mapped to rollflow.* by scripts/use_checkout.sh,
# and wheels in ./.whl (megatron-core 0.19.2 + pydantic and its deps for that box's Python; docs/megatron.md
# says how to download them) are installed next to it. With megatron-core already installed, no .whl is needed. Writes JSON + logs under $OUT (default ./gpu-out). Knobs (env): GPU_CHECKS_ARGS, SKIP_PYTEST=1,
# THROUGHPUT_ARGS, *_TIMEOUT (PYTEST_TIMEOUT 300 s: the GPU test files took 67-120 s each on an H200).
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/use_checkout.sh" || exit 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))"
EAGER='{"fusions": "off", "log_prob_impl": "chunked", "rope_fusion": "none"}'
rc=0
# 1. defaults (on CUDA: compiled fusions): log-prob parity (sdpa + local spec, fp32 + bf16), one train iteration
#    per optimizer, weight-sync parity, checkpoint round trip
timeout "${GPU_CHECKS_TIMEOUT:-200}" python3 benchmarks/gpu_checks.py --out "$OUT" ${GPU_CHECKS_ARGS:-} \
  > "$OUT/gpu_checks.log" 2>&1 || rc=1
grep -E "^(==|PASS|FAIL|all_pass)" "$OUT/gpu_checks.log" || tail -20 "$OUT/gpu_checks.log"
# 2. the same checks with no torch.compile'd kernel (eager fallback settings)
timeout "${GPU_CHECKS_EAGER_TIMEOUT:-120}" python3 benchmarks/gpu_checks.py --out "$OUT" --name gpu_checks_eager \
  --specs sdpa --optimizers megatron --parts parity,train --settings "$EAGER" > "$OUT/gpu_checks_eager.log" 2>&1 || rc=1
grep -E "^(==|PASS|FAIL|all_pass)" "$OUT/gpu_checks_eager.log" || tail -20 "$OUT/gpu_checks_eager.log"
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_megatron_gpu.py \
    > "$OUT/pytest_gpu.log" 2>&1 || rc=1
  grep '^SKIPPED' "$OUT/pytest_gpu.log" || true  # each skip with its reason
  tail -3 "$OUT/pytest_gpu.log"
  timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_ipc_sync.py \
    tests/test_static_decode.py tests/test_trainer_offload.py tests/test_hf_bucket_sync.py tests/test_host_shelf.py > "$OUT/pytest_ipc.log" 2>&1 || rc=1
  grep '^SKIPPED' "$OUT/pytest_ipc.log" || true
  tail -3 "$OUT/pytest_ipc.log"
fi
# 3. train throughput, ~0.9B Llama, megatron vs torch backend in one process
timeout "${THROUGHPUT_TIMEOUT:-270}" python3 benchmarks/train_throughput.py --out "$OUT" ${THROUGHPUT_ARGS:-} \
  > "$OUT/train_throughput.log" 2>&1 || rc=1
sed -n '/== train throughput/,$p' "$OUT/train_throughput.log"; grep -E '"error"' "$OUT/train_throughput.log" | cut -c1-400
exit $rc
