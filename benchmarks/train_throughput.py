"""Train throughput of the megatron vs the torch backend on one GPU, side by side in one process.

    python benchmarks/train_throughput.py --out $OUT

Shape (issue 6): ~0.9B Llama (vocab 32000, hidden 2048, 16 layers, 16 heads / 8 KV heads, head dim 128,
ffn 5632), sequence 2048, micro-batch 4, bf16. What is timed: one micro-step of each backend's real
training path (forward -> response log-probs + entropy -> `micro_batch_objective` -> backward), the
same as inside `train()`, no optimizer; median of --iters timed steps after --warmup. A full
`train()` call (2 micro-batches + optimizer step) is timed too.

FLOPs per micro-step, T = b * s tokens (stated in the JSON):
    model  = 6 * N * T,  N = matmul params = L * (h*(h_q + 2*h_kv) + h_q*h + 3*h*ffn) + V*h (output layer;
             the input embedding is a lookup and is not counted)
    attn   = 6 * L * s * h_q * T    (QK^T and PV, fwd + bwd = 3x fwd, causal: half of the s x s square)
    mfu    = (model + attn) / time / 790e12   (bf16 dense matmul rate measured on this H200)
    mfu_noncausal counts the full s x s square (12 * L * s * h_q * T), as PaLM / Megatron-LM's estimate does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollflow.tasks.train.batch import TrainBatch  # noqa: E402
from rollflow.tasks.train.objective import Denominators, micro_batch_objective  # noqa: E402
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig  # noqa: E402
from rollflow.tasks.train.torch_backend import TorchBackend, response_log_probs  # noqa: E402

PEAK = 790e12
DEVICE = "cuda"
SHAPE = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, seq=2048, micro_batch=4)


def flops(shape: dict) -> dict:
    h, L, V, f = shape["hidden"], shape["layers"], shape["vocab"], shape["ffn"]
    d = h // shape["heads"]
    hq, hkv = shape["heads"] * d, shape["kv_heads"] * d
    n = L * (h * (hq + 2 * hkv) + hq * h + 3 * h * f) + V * h
    T = shape["micro_batch"] * shape["seq"]
    model = 6 * n * T
    attn = 6 * L * shape["seq"] * hq * T
    return {
        "matmul_params": n,
        "tokens": T,
        "model_flops": model,
        "attn_flops_causal": attn,
        "total_flops": model + attn,
        "total_flops_noncausal": model + 2 * attn,
        "formula": "6*N*T + 6*L*s*h_q*T (causal attention); noncausal: 6*N*T + 12*L*s*h_q*T",
    }


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["seq"],
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def make_batch(shape: dict, rows: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    s = shape["seq"]
    tokens = torch.randint(3, shape["vocab"], (rows, s), generator=g)
    resp = torch.zeros(rows, s - 1)
    resp[:, 511:] = 1.0  # 512-token prompt, 1536-token response
    return TrainBatch(
        tokens=tokens,
        lengths=torch.full((rows,), s),
        response_mask=resp,
        rewards=torch.randn(rows, generator=g).double(),
        rollout_log_probs=torch.full((rows, s - 1), -10.0) * resp,
        group_size=rows,
        truncated=torch.zeros(rows, dtype=torch.bool),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, s - 1) * resp,
    )


def cuda_time(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":  # CPU smoke test of the script
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def optim(backend: str, check_memory_fit: bool = True, **megatron) -> OptimConfig:
    return OptimConfig(
        check_memory_fit=check_memory_fit,
        backend=backend,
        dtype="bfloat16",
        device=DEVICE,
        micro_batch_size=SHAPE["micro_batch"],
        num_steps_per_rollout=1,
        lr=1e-5,
        threads=4,
        megatron=megatron,
    )


def build_torch(shape: dict, sdpa_backends: tuple[str, ...] = ()):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(llama_config(shape))
    be = TorchBackend(model, optim("torch"), keep_ref=False)

    def step(micro, algo, denom):
        lp, ent = response_log_probs(be.model, micro, be.temperature, True)
        loss, stats = micro_batch_objective(lp, ent, micro, algo, denom)
        loss.backward()
        return stats

    ctx = None
    if sdpa_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        ctx = lambda: sdpa_kernel([names[n] for n in sdpa_backends], set_priority=True)  # noqa: E731
    return be, step, ctx


FALLBACKS: list[str] = []


def build_megatron(shape: dict, **settings):
    from rollflow.tasks.train.megatron.backend import MegatronBackend

    # shape["check_memory_fit"] False: a caller that drops the optimizer after the build (train_profile's
    # --drop-optimizer) needs no room for its Adam state
    fit = shape.get("check_memory_fit", True)
    try:
        be = MegatronBackend(llama_config(shape), None, optim("megatron", fit, **settings), keep_ref=False)
    except Exception as exc:  # Megatron's optimizer failed to build: time the model with the torch optimizer
        FALLBACKS.append(f"{settings}: optimizer=megatron failed ({type(exc).__name__}: {exc}); used torch")
        gc.collect()
        torch.cuda.empty_cache()
        be = MegatronBackend(
            llama_config(shape), None, optim("megatron", fit, optimizer="torch", **settings), keep_ref=False
        )
    return be, be.micro_step, None


def run_variant(name: str, builder, shape: dict, iters: int, warmup: int, fl: dict) -> dict:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    be, step, ctx = builder()
    build_s = time.perf_counter() - t_build
    algo = AlgoConfig()
    micro = make_batch(shape, shape["micro_batch"])
    import contextlib

    with ctx() if ctx else contextlib.nullcontext():
        micro.log_probs = be.compute_log_probs(micro)
        denom = Denominators.of(micro)
        be.model.eval()
        t0 = time.perf_counter()
        times = cuda_time(lambda: step(micro, algo, denom), iters, warmup)
        wall = time.perf_counter() - t0
        # Full train(): 2 micro-batches + optimizer step.
        batch = make_batch(shape, 2 * shape["micro_batch"], seed=1)
        batch.log_probs = be.compute_log_probs(batch)
        train_times = cuda_time(lambda: be.train(batch, algo), 2, 1)
    med = statistics.median(times)
    out = {
        "variant": name,
        "build_s": build_s,
        "step_s_median": med,
        "step_s_min": min(times),
        "step_s_all": times,
        "tokens_per_s": fl["tokens"] / med,
        "mfu": fl["total_flops"] / med / PEAK,
        "mfu_noncausal": fl["total_flops_noncausal"] / med / PEAK,
        "achieved_tflops": fl["total_flops"] / med / 1e12,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0,
        "timed_wall_s": wall,
        "train_call_s_median": statistics.median(train_times),
        "train_call_tokens_per_s": 2 * fl["tokens"] / statistics.median(train_times),
    }
    if hasattr(be, "layer_spec"):
        out.update(layer_spec=be.layer_spec, optimizer=be.optimizer_kind)
    del be, step, micro, batch
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


EAGER = dict(fusions="off", log_prob_impl="chunked", rope_fusion="none")
VARIANTS = {
    "torch/hf-sdpa": lambda shape: build_torch(shape),
    "torch/hf-sdpa-cudnn": lambda shape: build_torch(shape, ("cudnn", "flash")),
    # no torch.compile'd kernels: eager log-prob chunks, Megatron's unfused SwiGLU / RoPE
    "megatron/sdpa": lambda shape: build_megatron(shape, layer_spec="sdpa", **EAGER),
    "megatron/sdpa-cudnn": lambda shape: build_megatron(
        shape, layer_spec="sdpa", sdpa_backends=("cudnn", "flash"), **EAGER
    ),
    "megatron/sdpa-cudnn-fusions": lambda shape: build_megatron(
        shape, layer_spec="sdpa", sdpa_backends=("cudnn", "flash"), **{**EAGER, "fusions": "on"}
    ),
    "megatron/local": lambda shape: build_megatron(shape, layer_spec="local", **EAGER),
    "megatron/sdpa-compiled-logprobs": lambda shape: build_megatron(
        shape, layer_spec="sdpa", **{**EAGER, "log_prob_impl": "compiled"}
    ),
    # the defaults on CUDA (auto): Megatron's fusions + compiled log-probs + compiled RoPE
    "megatron/sdpa-opt": lambda shape: build_megatron(
        shape, layer_spec="sdpa", fusions="on", log_prob_impl="compiled", rope_fusion="compiled"
    ),
}


def matmul_peak() -> float:
    if DEVICE != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = statistics.median(cuda_time(lambda: a @ b, 10, 3))
    return 2 * 8192**3 / t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--variants", default="torch/hf-sdpa,megatron/sdpa,megatron/sdpa-opt,megatron/local")
    parser.add_argument("--name", default="train_throughput")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny shape, to test the script itself")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    shape = dict(SHAPE)
    if args.small:
        shape.update(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, seq=256, vocab=1000)
    fl = flops(shape)
    import transformers

    from rollflow.tasks.train.megatron.process import megatron_version

    results = {
        "shape": shape,
        "flops": fl,
        "peak_flops_assumed": PEAK,
        "date": time.strftime("%Y-%m-%d"),
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "megatron_core": megatron_version(),
            "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        },
        "measured_matmul_tflops_8192": matmul_peak() / 1e12,
        "variants": [],
    }
    print(f"bf16 8192^3 matmul: {results['measured_matmul_tflops_8192']:.0f} TFLOP/s", flush=True)
    for name in args.variants.split(","):
        try:
            res = run_variant(name, lambda: VARIANTS[name](shape), shape, args.iters, args.warmup, fl)
        except Exception as exc:
            res = {
                "variant": name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        results["variants"].append(res)
        results["fallbacks"] = FALLBACKS
        print(
            json.dumps({k: v for k, v in res.items() if k not in ("step_s_all", "traceback")}, default=str), flush=True
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)  # written after every variant: a timeout keeps the rest
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(results, indent=2, default=str))
    print(
        f"\n== train throughput: {shape['layers']}L h{shape['hidden']} s{shape['seq']} mb{shape['micro_batch']} "
        f"bf16, N={fl['matmul_params'] / 1e9:.3f}B matmul params, fwd+bwd incl. log-probs + loss =="
    )
    print(
        f"{'variant':32s} {'ms/step':>8s} {'tok/s':>9s} {'MFU':>6s} {'MFU*':>6s} {'mem GB':>7s} {'train() tok/s':>13s}"
    )
    for r in results["variants"]:
        if "error" in r:
            print(f"{r['variant']:32s} ERROR {r['error'][:90]}")
            continue
        print(
            f"{r['variant']:32s} {r['step_s_median'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} {r['mfu']:6.1%} "
            f"{r['mfu_noncausal']:6.1%} {r['peak_mem_gb']:7.1f} {r['train_call_tokens_per_s']:13.0f}"
        )
    print("MFU: causal attention flops; MFU*: full s x s attention flops (PaLM-style); peak 790 TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
