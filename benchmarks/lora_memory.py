"""GPU memory and step time of a LoRA policy vs full-parameter training on the torch trainer (issue 39).

    python -m benchmarks.lora_memory --shapes 0.5b,1.5b     # one CUDA GPU, bf16 (scripts/moe_lora_gpu.sh)
    python -m benchmarks.lora_memory --shapes tiny          # CPU, seconds (builtin:addition)

Per shape, the same train worker as a run's (`TrainWorker`, torch backend, the project's default
`compute_ref_log_probs`) is built twice, once full-parameter and once with `model.lora` (rank 16, alpha 32,
the default target modules: LoraTorchBackend, peft), and trains on the same committed rollout artifact with
`train_on_artifact`. One call is one rollout's train step: old and reference log-probs, then one optimizer step
over all samples in micro-batches. After --warmup calls, --steps calls are timed; per mode:

- trainable parameters (what the optimizer holds) and all parameters;
- peak GPU memory of a train call (`torch.cuda.max_memory_allocated`, reset before each timed call; the
  largest), and the memory held between calls (weights, reference, gradients, AdamW state);
- step time: the median of the timed calls (min and max kept).

Models: random-init Qwen2 shapes (benchmarks/models.py: `qwen2-0.5b`, `qwen2-1.5b`; `tiny` is the demo's
built-in model) saved as local HF directories. The rollout is synthetic (benchmarks.models.synthetic_samples:
full-length responses, 0/1 rewards, groups of 4): default 64 samples x 512 tokens (64 prompt + 448
response), micro-batch 8. Same workload, seed and data for both modes.

The JSON follows benchmarks/core.py (schema, machine, versions, one suite's figures) with every mode's raw
figures under `lora_memory`. Exit status: 0 measured, 1 a mode failed (the JSON keeps the others).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import SuiteResult, default_out, finish_report, report_header, run_standalone
from benchmarks.models import param_count, qwen2, save_model_dir, synthetic_samples
from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.train.settings import LORA_DEFAULT_TARGETS, AlgoConfig, LoraSettings, OptimConfig
from rollflow.tasks.train.worker import TrainWorker

NAME = "lora_memory"
RUN = "lora-bench"
# --shapes entry -> benchmarks/models.py shape; tiny is the built-in model of the demo
SHAPES = {"tiny": "builtin:addition", "0.5b": "qwen2-0.5b", "1.5b": "qwen2-1.5b"}
MODES = ("full", "lora")
LORA = LoraSettings(rank=16, alpha=32.0)  # default target modules


@dataclasses.dataclass(frozen=True)
class Workload:
    samples: int
    prompt_tokens: int
    response_tokens: int
    micro_batch: int


WORKLOADS = {
    "tiny": Workload(samples=16, prompt_tokens=8, response_tokens=24, micro_batch=4),  # 64-position context
    "0.5b": Workload(samples=64, prompt_tokens=64, response_tokens=448, micro_batch=8),
    "1.5b": Workload(samples=64, prompt_tokens=64, response_tokens=448, micro_batch=8),
}


def model_path(shape: str, dtype: str, device: str, workdir: Path) -> tuple[str, int]:
    """(model spec, vocabulary size): the built-in model, or a random-init Qwen2 saved as a local HF directory."""
    spec = SHAPES[shape]
    if spec.startswith("builtin:"):
        import json

        from rollflow.tasks.model.source import resolve_model_path

        return spec, int(json.loads((resolve_model_path(spec) / "config.json").read_text())["vocab_size"])
    model = qwen2(spec, dtype=dtype, device=device, seed=0)
    vocab = int(model.config.vocab_size)
    path = save_model_dir(model, workdir / f"lora-{shape}")
    del model
    free(device)
    return str(path), vocab


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def commit_rollout(store: RolloutStore, load: Workload, vocab: int) -> ArtifactRef:
    samples = synthetic_samples(load.samples, load.prompt_tokens, load.response_tokens, vocab, group=4, seed=0)
    return store.write(
        RUN,
        "train",
        0,
        samples,
        n_samples_per_prompt=4,
        engine=EngineInfo(backend="synthetic", model="benchmark", weight_version=0),
        config_hash="benchmark",
    )


def measure(mode: str, model: str, ref: ArtifactRef, load: Workload, args: argparse.Namespace, store: str) -> dict:
    cuda = args.device.startswith("cuda")
    optim = OptimConfig(
        backend="torch",
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        micro_batch_size=load.micro_batch,
        num_steps_per_rollout=1,
        lr=1e-6,
    )
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    worker = TrainWorker(model, optim, AlgoConfig(), store_root=store, run=RUN, lora=LORA if mode == "lora" else None)
    build_s = time.perf_counter() - started
    policy = worker.backend.model
    out: dict[str, Any] = {
        "mode": mode,
        "backend": worker.describe().backend,
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "params": param_count(policy),
        "build_s": build_s,
    }
    if cuda:
        out["built_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
    times: list[float] = []
    peaks: list[float] = []
    losses: list[float] = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = worker.train_on_artifact(ref)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        losses.append(float(metrics.get("train/loss", float("nan"))))
        if step < args.warmup:
            continue
        times.append(elapsed)
        if cuda:
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
    out.update(
        step_s=statistics.median(times),
        step_s_all=times,
        losses=losses,
        tokens_per_step=load.samples * (load.prompt_tokens + load.response_tokens),
    )
    if cuda:
        out["peak_gib"] = max(peaks)
        out["peak_gib_all"] = peaks
        out["held_gib"] = (torch.cuda.memory_allocated() - before) / 2**30  # weights, ref, grads, AdamW state
    del worker, policy
    free(args.device)
    return out


def run(args: argparse.Namespace, workdir: Path, suite: SuiteResult) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for shape in args.shapes:
        load = workload(args, shape)
        print(f"[lora] {shape}: building", file=sys.stderr, flush=True)
        model, vocab = model_path(shape, args.dtype, args.device, workdir)
        store_root = str(workdir / f"store-{shape}")
        ref = commit_rollout(RolloutStore(store_root), load, vocab)
        per_mode: dict[str, Any] = {"model": SHAPES[shape], "workload": dataclasses.asdict(load)}
        results[shape] = per_mode
        for mode in MODES:
            try:
                m = measure(mode, model, ref, load, args, store_root)
            except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                traceback.print_exc()
                per_mode[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                suite.error = f"{shape} {mode}: {type(exc).__name__}: {exc}"
                free(args.device)
                continue
            per_mode[mode] = m
            suite.add(f"{shape} {mode} trainable params", "params", [m["trainable_params"]])
            suite.add(f"{shape} {mode} step time", "s", m["step_s_all"])
            if "peak_gib" in m:
                suite.add(f"{shape} {mode} peak GPU memory", "GiB", m["peak_gib_all"])
                suite.add(f"{shape} {mode} held GPU memory", "GiB", [m["held_gib"]])
            print(
                f"[lora] {shape} {mode}: trainable {m['trainable_params']:,} of {m['params']:,} params, step "
                f"{m['step_s']:.3f} s (median of {len(m['step_s_all'])})"
                + (f", peak {m['peak_gib']:.2f} GiB, held {m['held_gib']:.2f} GiB" if "peak_gib" in m else ""),
                file=sys.stderr,
                flush=True,
            )
        full, lora = per_mode.get("full", {}), per_mode.get("lora", {})
        if "step_s" in full and "step_s" in lora:
            per_mode["lora_over_full"] = {
                "trainable_params": lora["trainable_params"] / full["trainable_params"],
                "step_s": lora["step_s"] / full["step_s"],
            }
            suite.ratio(f"{shape} step time lora / full", [lora["step_s"] / full["step_s"]])
            if "peak_gib" in full and "peak_gib" in lora:
                per_mode["lora_over_full"]["peak_gib"] = lora["peak_gib"] / full["peak_gib"]
                suite.ratio(f"{shape} peak GPU memory lora / full", [lora["peak_gib"] / full["peak_gib"]])
    suite.params.update(
        shapes=args.shapes,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        warmup=args.warmup,
        steps=args.steps,
        lora={
            "rank": LORA.rank,
            "alpha": LORA.alpha,
            "dropout": LORA.dropout,
            "target_modules": list(LORA_DEFAULT_TARGETS),
        },
        train_call="TrainWorker.train_on_artifact: old + ref log-probs, one optimizer step over all samples",
    )
    suite.data["lora_memory"] = results
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", default=None, help="comma-separated of tiny, 0.5b, 1.5b (default: 0.5b,1.5b on CUDA)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/<gpu|cpu>-<date>-lora.json")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU, torch's own on CUDA)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed train calls per mode")
    ap.add_argument("--steps", type=int, default=3, help="timed train calls per mode")
    ap.add_argument("--samples", type=int, default=None, help="samples per train call (default per shape)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--response-tokens", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder, removed)")
    ap.add_argument("--no-table", action="store_true", help="skip the table on stdout")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    args.shapes = [s.strip() for s in (args.shapes or ("0.5b,1.5b" if cuda else "tiny")).split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.threads = args.threads or (torch.get_num_threads() if cuda else 1)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def workload(args: argparse.Namespace, shape: str) -> Workload:
    overrides = {
        "samples": args.samples,
        "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens,
        "micro_batch": args.micro_batch,
    }
    return dataclasses.replace(WORKLOADS[shape], **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = default_out(args.device)
    out = args.out or base.with_name(f"{base.stem}-lora.json")
    command = "python -m benchmarks.lora_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    report = report_header(command, args.device, benchmark=NAME)
    suite, results = run_standalone(
        NAME,
        "LoRA vs full-parameter training: trainable params, peak GPU memory, step time",
        args.workdir,
        "rollflow-lora-",
        lambda workdir, suite: run(args, workdir, suite),
    )
    report["lora_memory"] = results or {}  # the raw per-shape, per-mode figures (also under suites.<name>.data)
    finish_report(report, suite, out, table=not args.no_table)
    return 1 if suite.error else 0


if __name__ == "__main__":
    raise SystemExit(main())
