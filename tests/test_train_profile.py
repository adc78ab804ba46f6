"""benchmarks/train_profile.py: kernel families of real profiler names, and the script end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.train_profile import drop_optimizer, family

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_names_of_a_real_h200_profile_fall_in_their_families():
    # names as torch.profiler printed them on the H200 (benchmarks/results/h200-2026-12-03-megatron-packing-profile.txt)
    text = (ROOT / "benchmarks/results/h200-2026-12-03-megatron-packing-profile.txt").read_text()
    assert "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT" in text
    assert family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1") == "attention"
    assert family("triton_poi_fused__to_copy_mul_silu_0") == "compiled (triton)"
    assert family("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "elementwise"
    assert family("Memcpy DtoD (Device -> Device)") == "copy / memset"
    assert family("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>") == "reduction"
    assert family("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"


def test_the_profile_script_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_profile.py",
            "--preset",
            "tiny",
            "--seq",
            "64",
            "--device",
            "cpu",
            "--variant",
            "torch/hf-sdpa",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--micro-batch",
            "2",
            "--name",
            "mb2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "mb2.json").read_text())
    # megatron_scale's `tiny` Llama: vocab 512, hidden 64, 4 layers, 4 heads, 2 KV heads, FFN 128
    assert {k: result["shape"][k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn")} == dict(
        vocab=512, hidden=64, layers=4, heads=4, kv_heads=2, ffn=128
    )
    assert result["shape"]["micro_batch"] == 2 and result["flops"]["tokens"] == 2 * 64
    families = result["families_s"]
    assert families["matmul"] > 0 and families["attention"] > 0
    assert abs(sum(families.values()) - result["device_busy_s"]) < 1e-9
    assert "matmul" in proc.stdout and "device idle" in proc.stdout


def test_dropping_the_optimizer_frees_it_and_the_micro_step_still_accumulates_grads(monkeypatch):
    """--drop-optimizer (the 7b shape's micro-step on an 80 GB GPU): nothing else in the backend keeps the optimizer
    (and its fp32 masters) alive, and the micro-step still runs forward, objective and backward."""
    import gc
    import weakref

    import torch

    from benchmarks import train_throughput as tt
    from rollflow.tasks.train.objective import Denominators

    monkeypatch.setattr(tt, "DEVICE", "cpu")
    shape = dict(tt.SHAPE, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=576, vocab=512, micro_batch=2)
    shape["check_memory_fit"] = False
    be, step, _ = tt.VARIANTS["megatron/sdpa-opt"](shape)
    gone = weakref.ref(be.optimizer)
    # where Megatron's optimizer builds the masters (CUDA) it also sets them as `main_param` on each parameter
    masters = [torch.zeros(1) for _ in be.model.parameters()]
    for param, master in zip(be.model.parameters(), masters):
        param.main_param = master
    held = [weakref.ref(m) for m in masters]
    del masters, param, master
    drop_optimizer(be)
    gc.collect()
    assert gone() is None and all(m() is None for m in held)
    micro = tt.make_batch(shape, 2)  # its responses start at token 512
    micro.log_probs = be.compute_log_probs(micro)
    step(micro, tt.AlgoConfig(), Denominators.of(micro))
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in be.model.parameters()]
    assert any(g is not None and torch.count_nonzero(g) > 0 for g in grads)
