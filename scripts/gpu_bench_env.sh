# Sourced by the one-GPU benchmark scripts (e2e_gpu.sh, moe_lora_gpu.sh, ppo_gpu.sh), from the checkout's root:
# OUT (logs, default ./gpu-out) and RESULTS (JSON, default benchmarks/results) exist afterwards; the checkout is
# mapped to rollflow.* (use_checkout.sh); the GPU and host memory are recorded under $OUT; `stem` is the results'
# file stem, <gpu>-<date>, as the benchmarks name their JSON.
OUT=${OUT:-./gpu-out}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$OUT" "$RESULTS"
source "$(dirname "${BASH_SOURCE[0]}")/use_checkout.sh" || return 1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
free -g > "$OUT/host-memory.txt" 2>&1
stem=$(python3 -c 'from benchmarks.core import default_out; print(default_out("cuda").stem)') || return 1
