#!/usr/bin/env bash
# IMA triage (issue 8) on the H200 without Prefect: the plain runner of `tasks/debug/ima.py`.
#   bash benchmarks/ima_gpu.sh        (on any CUDA machine, from the checkout's root; needs torch, transformers,
# triton, pyarrow, fsspec and pydantic: wheels missing on the box can be put in ./.whl, see scripts/use_checkout.sh)
# A real illegal memory access: a Triton kernel in the decode step stores 2**40 elements past the logits,
# armed only in cells matching $CRASH_WHEN. Writes ima_report.{json,md}, ima.log, versions.txt,
# ima_logs.tgz and coredumps.txt under $OUT.
set -uo pipefail
OUT=${OUT:-./ima-gpu-out}
mkdir -p "$OUT"
source "$(dirname "$0")/../scripts/use_checkout.sh" || exit 1
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
{
  python3 -c "import torch, transformers, triton, pydantic, pyarrow, fsspec; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "cuda-gdb: $(command -v cuda-gdb || echo missing)"; uname -r
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
CONFIG=${IMA_CONFIG:-'{"run":"h200-ima","data":{"prompts_per_rollout":8},"rollout":{"device":"cuda","n_samples_per_prompt":2}}'}
rm -rf /tmp/ima-run
timeout "${IMA_TIMEOUT:-360}" python3 -m rollflow.tasks.debug.ima --matrix --config "$CONFIG" \
  --crash-when "${CRASH_WHEN:-cuda_graph=on}" --fault "${FAULT:-triton_oob}" --parallel "${PARALLEL:-4}" \
  --timeout-s "${CELL_TIMEOUT:-150}" --run-dir /tmp/ima-run --out "$OUT" > "$OUT/ima.log" 2>&1
rc=$?
grep -E "^\[(matrix|launch_blocking|coredump)\]|Verdict|faulting kernel|cuda-gdb:" "$OUT/ima.log"
tar czf "$OUT/ima_logs.tgz" -C /tmp/ima-run ima_logs 2>/dev/null
ls -la /tmp/ima-run/coredumps > "$OUT/coredumps.txt" 2>&1
cat "$OUT/coredumps.txt"
exit $rc
