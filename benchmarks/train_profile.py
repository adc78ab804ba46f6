"""Where the megatron micro-step's time goes: the train_throughput shape (~0.9B Llama, sequence 2048, micro-batch 4,
bf16, the CUDA defaults `megatron/sdpa-opt`) under torch.profiler, device time summed by kernel family.

    python benchmarks/train_profile.py --out $OUT     # one CUDA GPU; megatron-core installed
    python benchmarks/train_profile.py --preset tiny --seq 64 --device cpu --variant torch/hf-sdpa   # on CPU
    python benchmarks/train_profile.py --preset 7b --micro-batch 2 --drop-optimizer --out $OUT   # Llama-2-7B's shape

Writes <out>/train_profile.json and prints a table: per micro-step, the wall time, the device's busy time by
family (matmul, attention, compiled / elementwise / reduction kernels, copies, other), the time the device sat
idle (host-bound), and the matmul family's rate against a bf16 8192^3 matmul measured in the same process. That
rate times the matmul share bounds the MFU: with every other kernel free and no idle time, MFU could reach only
(matmul FLOPs / all counted FLOPs) x (matmul rate / peak).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import train_throughput as tt  # noqa: E402
from benchmarks.megatron_scale import PRESETS  # noqa: E402

# Kernel families, first match wins. Names are the CUDA kernels torch.profiler reports (cuBLAS / cuBLASLt's nvjet
# and cutlass GEMMs, cuDNN / flash attention, inductor's triton kernels, ATen's elementwise and reduction kernels).
FAMILIES: tuple[tuple[str, re.Pattern], ...] = (
    ("communication", re.compile(r"nccl|allreduce|allgather|reducescatter", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|_attn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm\d+_.*(tn|nt|nn|tt)|^aten::(mm|bmm|addmm)$", re.I)),
    ("compiled (triton)", re.compile(r"^triton_", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy_kernel|Memcpy|Memset", re.I)),
    ("reduction", re.compile(r"reduce|softmax|norm|sum_kernel|max_kernel", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|fill|index|scatter|gather|where", re.I)),
)


def family(kernel: str) -> str:
    for name, pattern in FAMILIES:
        if pattern.search(kernel):
            return name
    return "other"


def breakdown(kernel_us: dict[str, float]) -> dict[str, float]:
    """Device microseconds by family, from microseconds by kernel name."""
    out: dict[str, float] = {}
    for kernel, us in kernel_us.items():
        out[family(kernel)] = out.get(family(kernel), 0.0) + us
    return out


def kernel_times(prof, device: str) -> dict[str, float]:
    """Self device time of each kernel (CUDA) or operator (CPU, where there are no kernels), microseconds."""
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        us = evt.self_device_time_total if device == "cuda" else evt.self_cpu_time_total
        if device == "cuda" and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device != "cuda" and not evt.key.startswith("aten::"):
            continue  # CPU: operators only (their children are counted by their own self time)
        if us > 0:
            out[evt.key] = out.get(evt.key, 0.0) + us
    return out


def drop_optimizer(be) -> None:
    """Free the backend's optimizer and its fp32 masters (a micro-step never reads them)."""
    import gc

    be.optimizer = be.scheduler = None
    for param in be.model.parameters():  # Megatron's mixed-precision optimizer hangs each fp32 master here too
        if hasattr(param, "main_param"):
            del param.main_param
    gc.collect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variant", default="megatron/sdpa-opt", choices=sorted(tt.VARIANTS))
    ap.add_argument("--steps", type=int, default=5, help="micro-steps profiled (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="a Llama shape of benchmarks/megatron_scale.py instead of the ~0.9B one (e.g. 7b: Llama-2-7B; its "
        "micro-step holds bf16 weights, fp32 masters and fp32 main grads, ~10 B per parameter, plus activations)",
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="rows per micro-step (default: the shape's 4); larger "
        "micro-steps launch the same kernels over more tokens, so the host's launch time counts for less",
    )
    ap.add_argument(
        "--drop-optimizer",
        action="store_true",
        help="free the optimizer and its fp32 masters after the build and skip the fit check that counts its Adam "
        "state: the micro-step never reads them, so the 7b shape's micro-step fits an 80 GB GPU (bf16 weights and "
        "fp32 main grads, ~6 B per parameter, plus activations: 56.6 GiB at micro-batch 2, 75.5 at 4, on an H100)",
    )
    ap.add_argument("--name", default="train_profile", help="the JSON's file stem under --out")
    args = ap.parse_args(argv)
    tt.DEVICE = args.device
    shape = dict(tt.SHAPE)
    if args.preset:
        vocab, hidden, layers, heads, kv_heads, ffn = PRESETS[args.preset]
        shape.update(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn)
    if args.seq:
        shape["seq"] = args.seq
    if args.micro_batch:
        shape["micro_batch"] = args.micro_batch
    if args.drop_optimizer:
        shape["check_memory_fit"] = False
    fl = tt.flops(shape)
    peak = tt.matmul_peak()  # 0 on CPU
    be, step, ctx = tt.VARIANTS[args.variant](shape)
    if args.drop_optimizer:
        drop_optimizer(be)
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    micro = tt.make_batch(shape, shape["micro_batch"])
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from rollflow.tasks.train.objective import Denominators

    algo = tt.AlgoConfig()
    with ctx() if ctx else contextlib.nullcontext():
        micro.log_probs = be.compute_log_probs(micro)
        denom = Denominators.of(micro)
        be.model.eval()
        times = tt.cuda_time(lambda: step(micro, algo, denom), args.steps, args.warmup)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step(micro, algo, denom)
            if args.device == "cuda":
                torch.cuda.synchronize()
        profiled_wall = (time.perf_counter() - started) / args.steps
    per_kernel = {k: v / args.steps for k, v in kernel_times(prof, args.device).items()}
    families = breakdown(per_kernel)
    step_s = statistics.median(times)
    busy_s = sum(families.values()) / 1e6
    matmul_s = families.get("matmul", 0.0) / 1e6
    matmul_flops = fl["model_flops"]  # 6 N T: every linear layer incl. the output layer, forward and backward
    result = {
        "variant": args.variant,
        "preset": args.preset,
        "shape": shape,
        "flops": fl,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "measured_matmul_tflops_8192": peak / 1e12,
        "step_s_median": step_s,
        "step_s_all": times,
        "profiled_step_wall_s": profiled_wall,
        "mfu_vs_measured_peak": fl["total_flops"] / step_s / peak if peak else None,
        "device_busy_s": busy_s,
        "device_idle_s": max(0.0, profiled_wall - busy_s),
        "families_s": {k: v / 1e6 for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "matmul_tflops": matmul_flops / matmul_s / 1e12 if matmul_s else None,
        "optimizer_dropped": args.drop_optimizer,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "top_kernels_s": dict(sorted(((k, v / 1e6) for k, v in per_kernel.items()), key=lambda kv: -kv[1])[:25]),
        "date": time.strftime("%Y-%m-%d"),
    }
    if peak and matmul_s:
        # MFU if everything but the matmuls (and attention at its measured time) took no time at all
        attn_s = families.get("attention", 0.0) / 1e6
        result["mfu_bound_matmul_and_attention_only"] = fl["total_flops"] / (matmul_s + attn_s) / peak
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    print(
        f"== {args.variant} on {result['device']}: micro-step {step_s * 1e3:.1f} ms "
        f"(profiled {profiled_wall * 1e3:.1f} ms)"
    )
    if result["mfu_vs_measured_peak"]:
        print(f"MFU {result['mfu_vs_measured_peak']:.1%} of the measured {peak / 1e12:.0f} TFLOP/s")
    for name, s in result["families_s"].items():
        print(f"  {name:20s} {s * 1e3:8.1f} ms  {s / profiled_wall:6.1%}")
    print(
        f"  {'device idle':20s} {result['device_idle_s'] * 1e3:8.1f} ms  {result['device_idle_s'] / profiled_wall:6.1%}"
    )
    if result.get("matmul_tflops"):
        print(f"matmul family: {result['matmul_tflops']:.0f} TFLOP/s")
    if "mfu_bound_matmul_and_attention_only" in result:
        print(f"MFU with every other kernel free and no idle time: {result['mfu_bound_matmul_and_attention_only']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
