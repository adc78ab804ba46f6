"""Suite 4: train throughput (tokens/s) of each available backend; on GPU also MFU.

Two figures per backend, on the same synthetic rollout (full-length responses, 0/1 rewards):
- step: `backend.train` alone (forward + backward + optimizer step over every micro-batch);
- call: `train_on_samples` (old and reference log-probs, advantages, then the step), what one RL
  iteration's train task costs.
Tokens = every position of the padded batch (prompt + response). MFU counts the step's model FLOPs:
6 x matmul parameters + 6 x layers x hidden x sequence (causal attention, forward + backward) per
token, against 790 TFLOP/s (the H200's measured dense bf16 rate).
"""

from __future__ import annotations

import importlib.util
import time

import torch

from benchmarks.core import BenchContext, SuiteResult, sync_device
from benchmarks.models import SHAPES, matmul_params, qwen2, save_model_dir, synthetic_samples

TITLE = "train throughput per backend"
PEAK_FLOPS = 790e12


def params_for(ctx: BenchContext) -> dict:
    if ctx.device.startswith("cuda"):
        return dict(shape="qwen2-0.5b", dtype="bfloat16", samples=64, prompt_len=128, response_len=256, micro_batch=16)
    if ctx.quick:
        return dict(shape="cpu-tiny", dtype="float32", samples=16, prompt_len=16, response_len=48, micro_batch=8)
    return dict(shape="cpu-small", dtype="float32", samples=64, prompt_len=32, response_len=96, micro_batch=16)


def flops_per_token(model, seq_len: int) -> float:
    cfg = model.config
    return 6.0 * matmul_params(model) + 6.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def run(ctx: BenchContext) -> SuiteResult:
    from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
    from rollflow.tasks.train.step import prepare_batch, train_on_samples
    from rollflow.tasks.train.torch_backend import TorchBackend

    res = SuiteResult("train", TITLE)
    p = params_for(ctx)
    p.update(ctx.options.get("train", {}))
    repeats = ctx.n(3, 2)
    cuda = ctx.device.startswith("cuda")
    backends = ctx.options.get("train_backends") or ["torch", "megatron"]
    res.params = {
        **p,
        "repeats": repeats,
        "device": ctx.device,
        "backends": backends,
        "optimizer_steps_per_call": 1,
        "threads": torch.get_num_threads(),
        "peak_flops": PEAK_FLOPS if cuda else None,
    }
    vocab = SHAPES[p["shape"]]["vocab_size"]
    samples = synthetic_samples(p["samples"], p["prompt_len"], p["response_len"], vocab, group=4)
    seq = p["prompt_len"] + p["response_len"]
    tokens = p["samples"] * seq
    algo = AlgoConfig()
    optim = OptimConfig(
        backend="torch",
        num_steps_per_rollout=1,
        micro_batch_size=p["micro_batch"],
        dtype=p["dtype"],
        device=ctx.device,
        threads=torch.get_num_threads(),
        lr=1e-5,
    )
    model = qwen2(p["shape"], dtype=p["dtype"], device="meta", max_positions=max(4096, seq))
    fpt = flops_per_token(model, seq)
    res.params["matmul_params"] = matmul_params(model)
    res.params["flops_per_token"] = fpt

    for name in backends:
        if name == "megatron" and importlib.util.find_spec("megatron") is None:
            res.unavailable["megatron backend"] = "megatron-core is not installed here"
            continue
        try:
            if name == "torch":
                backend = TorchBackend(
                    qwen2(p["shape"], dtype=p["dtype"], device=ctx.device, max_positions=max(4096, seq)), optim
                )
            else:
                from rollflow.tasks.train.megatron.backend import build_megatron_backend

                model_dir = save_model_dir(
                    qwen2(p["shape"], dtype="float32", max_positions=max(4096, seq)), ctx.workdir / "train-model"
                )
                backend = build_megatron_backend(
                    model_dir, optim.model_copy(update={"backend": "megatron"}), temperature=1.0
                )
        except Exception as exc:  # noqa: BLE001 - a backend that cannot start here is reported, not fatal
            res.unavailable[f"{name} backend"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        batch, _ = prepare_batch(backend, samples, algo, group_size=4)

        def step() -> None:
            backend.train(batch, algo)

        def call() -> None:
            train_on_samples(backend, samples, algo, group_size=4)

        step(), call()  # warm-up (allocator, kernels, optimizer state)
        step_s, call_s = [], []
        for _ in range(repeats):
            for fn, out in ((step, step_s), (call, call_s)):
                sync_device(ctx.device)
                start = time.perf_counter()
                fn()
                sync_device(ctx.device)
                out.append(time.perf_counter() - start)
        res.add(
            f"{name} step tokens/s",
            "tokens/s",
            [tokens / s for s in step_s],
            note="forward + backward + optimizer, every micro-batch",
        )
        res.add(
            f"{name} call tokens/s",
            "tokens/s",
            [tokens / s for s in call_s],
            note="train_on_samples: old + ref log-probs, advantages, step",
        )
        res.ratio(
            f"{name} step / call time",
            [s / c for s, c in zip(step_s, call_s)],
            note="share of the train call spent in the optimizer step",
        )
        if cuda:
            res.add(
                f"{name} step MFU",
                "fraction",
                [fpt * tokens / s / PEAK_FLOPS for s in step_s],
                note=f"{fpt / 1e9:.2f} GFLOP/token vs {PEAK_FLOPS / 1e12:.0f} TFLOP/s",
            )
            res.notes.append(f"{name}: max GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        del backend, batch
        if cuda:
            torch.cuda.empty_cache()
    return res
