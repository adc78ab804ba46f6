"""Multi-GPU megatron backend: one process per GPU, a TP x PP x DP layout, the full `train()` timed.

    python benchmarks/megatron_scale.py --preset 7b --tp 2 --pp 2 --gpus 8 --out $OUT
    python benchmarks/megatron_scale.py --estimate            # memory table of the documented layouts, no GPU

Each rank builds its shard of a randomly initialised Llama of the preset's shape (bf16, sdpa or te spec),
with full activation recompute and the distributed optimizer by default, scores a synthetic rollout
(`compute_log_probs`, forward-only schedule), then times `train()` (Megatron's schedule, grad reduce,
optimizer step) over --iters calls after one warm-up call. Rank 0 writes JSON: tokens/s, peak memory per
GPU, and MFU against two peaks, named: the H200's dense-bf16 datasheet figure (989 TFLOP/s) and a bf16
8192^3 matmul measured on each GPU in the same run (the minimum over ranks).

FLOPs per train() call: 6 * N * T + 6 * L * s * h_q * T (causal attention), N = matmul parameters
(output layer included, input embedding excluded), T = tokens; full recompute adds one forward
(2 * N * T + 2 * L * s * h_q * T) that is reported separately and NOT counted in MFU (model FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DATASHEET_BF16 = 989e12  # H200 SXM dense bf16 (no sparsity)
PRESETS = {
    # name: (vocab, hidden, layers, heads, kv_heads, ffn)
    "tiny": (512, 64, 4, 4, 2, 128),  # CPU smoke test of this script (--device cpu)
    "0.9b": (32000, 2048, 16, 16, 8, 5632),
    "3b": (128256, 3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "6b": (32000, 4096, 28, 32, 32, 11008),  # Llama-2-7B with 28 of its 32 layers (the one-GPU fit limit)
    "7b": (32000, 4096, 32, 32, 32, 11008),  # Llama-2-7B
    "70b": (128256, 8192, 80, 64, 8, 28672),  # Llama-3-70B
}
# Layouts documented in docs/megatron.md (preset, gpus, tp, pp, distributed optimizer).
DOC_LAYOUTS = [
    ("7b", 8, 2, 1, True),
    ("7b", 8, 1, 1, True),
    ("7b", 2, 2, 1, False),
    ("70b", 64, 8, 4, True),
    ("70b", 64, 8, 2, True),
    ("70b", 16, 8, 2, False),
]


def params(preset: str) -> dict:
    v, h, layers, heads, kv, ffn = PRESETS[preset]
    d = h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * ffn + 2 * h
    return {"total": layers * per_layer + 2 * v * h + h, "matmul": layers * (per_layer - 2 * h) + v * h}


def memory_gib(preset: str, gpus: int, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    """Model state per GPU, before activations: bf16 weights (2 B/param), fp32 main grads (4 B, Megatron's
    grad_reduce_in_fp32), fp32 master weights + Adam m and v (12 B, divided over DP with the distributed
    optimizer). Assumes an even split over TP x PP (embedding / output layer on the first / last stage
    make those stages a little heavier)."""
    dp = gpus // (tp * pp)
    shard = params(preset)["total"] / (tp * pp)
    weights, grads, optim = 2 * shard, 4 * shard, 12 * shard / (dp if distributed_optimizer else 1)
    gib = 2**30
    return {
        "preset": preset,
        "gpus": gpus,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "distributed_optimizer": distributed_optimizer,
        "params_per_gpu_b": round(shard / 1e9, 2),
        "weights_gib": round(weights / gib, 1),
        "grads_gib": round(grads / gib, 1),
        "optimizer_gib": round(optim / gib, 1),
        "total_gib": round((weights + grads + optim) / gib, 1),
    }


def _llama(preset: str):
    from transformers import LlamaConfig

    v, h, layers, heads, kv, ffn = PRESETS[preset]
    return LlamaConfig(
        vocab_size=v,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def _lengths(n: int, seq: int, ragged: bool) -> torch.Tensor:
    """Row lengths: all `seq`, or (ragged) uniform in [seq / 4, seq] as RL responses are, seeded."""
    if not ragged:
        return torch.full((n,), seq)
    return torch.randint(seq // 4, seq + 1, (n,), generator=torch.Generator().manual_seed(1))


def _batch(n: int, seq: int, vocab: int, ragged: bool = False):
    from rollflow.tasks.train.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = _lengths(n, seq, ragged)
    cols = torch.arange(seq)
    attention = (cols[None, :] < lengths[:, None]).long()
    tokens = torch.randint(0, vocab, (n, seq), generator=g) * attention
    # target-aligned (column j scores token j + 1): a quarter of each row prompt, the rest response
    resp = ((cols[None, 1:] >= (lengths // 4)[:, None]) & (cols[None, 1:] < lengths[:, None])).float()
    return TrainBatch(
        tokens=tokens,
        lengths=lengths,
        response_mask=resp,
        rewards=torch.zeros(n, dtype=torch.float64),
        rollout_log_probs=torch.zeros(n, seq - 1),
        group_size=n,
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.randn(n, seq - 1, generator=g) * resp,
    )


def _matmul_rate(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - t)


def _rank(rank: int, world: int, port: int, args) -> None:
    from rollflow.tasks.train.data_parallel import DataParallel
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.megatron.process import destroy_parallel_state
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    megatron = {
        "tp": args.tp,
        "pp": args.pp,
        "cp": args.cp,
        "sequence_parallel": args.sp,
        "packing": args.packing,
        "pack_multiple": args.pack_multiple,
        "use_distributed_optimizer": not args.no_dist_opt,
        "layer_spec": args.spec,
    }
    if not args.no_recompute:
        megatron.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    dp = world // (args.tp * args.pp * args.cp)
    megatron["optimizer"] = "megatron"
    if not cuda:
        megatron.update(layer_spec="sdpa", fusions="off", log_prob_impl="chunked", rope_fusion="none")
    optim = OptimConfig(
        backend="megatron",
        device=f"cuda:{rank}" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        lr=1e-6,
        num_steps_per_rollout=1,
        micro_batch_size=args.micro_batch,
        megatron=megatron,
    )
    config = _llama(args.preset)
    be = MegatronBackend(
        config,
        None,
        optim,
        keep_ref=False,
        dp=DataParallel(rank, world, "127.0.0.1", port, backend="nccl" if cuda else "gloo"),
    )
    n_params = sum(p.numel() for chunk in be.chunks for p in chunk.parameters())
    matmul = torch.tensor([_matmul_rate(be.device) if cuda else 1.0], device=be.device)
    torch.distributed.all_reduce(matmul, op=torch.distributed.ReduceOp.MIN)
    n = args.micro_batch * args.micro_batches * dp
    batch = _batch(n, args.seq, config.vocab_size, args.ragged)
    batch.log_probs = be.compute_log_probs(batch) * batch.response_mask
    algo = AlgoConfig()
    be.train(batch, algo)  # warm-up (the optimizer state is allocated at its first step)
    if cuda:
        torch.cuda.synchronize()
        state_gib = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        torch.distributed.barrier()
        t = time.perf_counter()
        stats = be.train(batch, algo)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    mem = torch.tensor(
        [torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, state_gib if cuda else 0.0, float(n_params)],
        device=be.device,
        dtype=torch.float64,
    )
    torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MAX)
    peak, state, rank_params = mem.tolist()
    if rank == 0:
        v, h, layers, heads, _kv, _ffn = PRESETS[args.preset]
        lengths = _lengths(n, args.seq, args.ragged).double()
        tokens = int(lengths.sum())  # real tokens: padding is not work done
        model_flops = 6 * params(args.preset)["matmul"] * tokens + 6 * layers * h * float((lengths**2).sum())
        step = sorted(times)[len(times) // 2]
        rate = model_flops / step / world
        result = {
            "preset": args.preset,
            "packing": args.packing,
            "ragged": args.ragged,
            "real_tokens": tokens,
            "world": world,
            "tp": args.tp,
            "pp": args.pp,
            "cp": args.cp,
            "dp": dp,
            "micro_batch": args.micro_batch,
            "micro_batches_per_rank": args.micro_batches,
            "seq": args.seq,
            "settings": megatron,
            "train_call_s_median": step,
            "tokens_per_s": tokens / step,
            "tokens_per_s_per_gpu": tokens / step / world,
            "model_tflops_per_gpu": rate / 1e12,
            "mfu_vs_datasheet_989": rate / DATASHEET_BF16,
            "matmul_measured_tflops": float(matmul) / 1e12,
            "mfu_vs_measured_matmul": rate / float(matmul),
            "peak_mem_gib_max_rank": peak,
            "state_mem_gib_max_rank": state,
            "params_max_rank": rank_params,
            "peak_bytes_per_param": peak * 2**30 / rank_params,
            "state_bytes_per_param": state * 2**30 / rank_params,
            "grad_norm": stats["train/grad_norm"],
            "loss": stats["train/loss"],
            "memory_estimate": memory_gib(args.preset, world, args.tp, args.pp, not args.no_dist_opt),
            "flops_formula": "6*N_matmul*T + 6*L*h*sum(s_i^2) over rows (causal); T = real tokens (padding not "
            "counted); recompute's extra forward not counted",
        }
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            layout = ("-ragged" if args.ragged else "") + ("-thd" if args.packing == "thd" else "")
            cp = f"-cp{args.cp}" if args.cp > 1 else ""
            name = f"megatron-scale-{args.preset}-tp{args.tp}-pp{args.pp}{cp}-dp{dp}{layout}.json"
            (Path(args.out) / name).write_text(json.dumps(result, indent=1))
    destroy_parallel_state()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: all visible GPUs)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel: each sequence split over cp ranks")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per data-parallel rank")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--spec", default="auto", choices=["auto", "te", "sdpa", "local"])
    parser.add_argument("--no-recompute", action="store_true")
    parser.add_argument("--no-dist-opt", action="store_true")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (tp > 1)")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: gloo ranks, fp32, sdpa spec, --preset tiny; megatron-core's optimizer needs CUDA, so "
        "this runs only under the test suite's CPU shims (tests/test_megatron_scale_script.py)",
    )
    parser.add_argument("--packing", default="off", choices=["off", "thd"], help="train.megatron.packing")
    parser.add_argument("--pack-multiple", type=int, default=1, help="train.megatron.pack_multiple")
    parser.add_argument("--ragged", action="store_true", help="row lengths uniform in [seq/4, seq] (else all seq)")
    parser.add_argument("--estimate", action="store_true", help="print the memory table and exit")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT"),
        help="directory for the result JSON (named after the layout; default: $OUT)",
    )
    args = parser.parse_args()
    if args.estimate:
        for preset in PRESETS:
            print(preset, params(preset))
        for row in DOC_LAYOUTS:
            print(json.dumps(memory_gib(*row)))
        return
    import torch.multiprocessing as mp

    world = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
