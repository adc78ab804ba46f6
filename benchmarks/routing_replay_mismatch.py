"""Train/rollout log-prob mismatch of an MoE model with and without rollout routing replay (R3, issue 39).

    python -m benchmarks.routing_replay_mismatch --shape 1b      # one CUDA GPU, bf16 (scripts/moe_lora_gpu.sh)
    python -m benchmarks.routing_replay_mismatch --shape tiny    # CPU, seconds (builtin:addition-moe)

The project's R3 path, without Ray or Prefect, in one process:

    rollout worker (hf engine, dynamic KV cache, routes recorded: `record_routes=True`) -> samples with
    `routed_experts` -> the torch trainer's batch (`batch_from_samples`, routes off / on) -> the trainer's
    teacher-forced log-probs (`TorchBackend.compute_log_probs`, the old log-probs of a train step)

and reports mean / max |trainer - rollout| over the generated tokens without and with replay, and the route
flips: (token, MoE layer) pairs whose top-k expert set in the trainer's own forward differs from the engine's.
The static-cache decoder is off: routes are recorded in transformers' `generate` only (docs/moe.md).

Shapes: `tiny` is the shipped `builtin:addition-moe` (2 layers, 8 experts, top-2); `1b` is a random-init
Qwen3-MoE built from a config, a scaled-down Qwen3-30B-A3B (hidden 1024, 16 layers, 64 experts, top-8,
moe_intermediate 512, 16 heads / 4 KV heads of 128, Qwen's 151936 vocabulary; ~1.85B parameters, ~0.44B
active per token), saved as a local HF directory both sides load. Prompts: the built-in addition prompts
(the model's character tokenizer); the responses are sampled from the whole vocabulary at temperature 1.

The JSON (benchmarks/core.py conventions: schema, machine, versions, one suite's figures; the table is
printed when `rich` is importable): the mismatch figures, flips, tokens, parameters, peak GPU memory and
seconds per stage. Exit status: 0 when R3 lowered the mean mismatch (or left it equal and lowered the max),
3 when it did not, 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from benchmarks.core import SuiteResult, default_out, finish_report, report_header, run_standalone
from benchmarks.models import param_count, random_init, save_model_dir
from rollflow.tasks.model.routing import record_routes, route_shape
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.train.batch import TrainBatch, batch_from_samples
from rollflow.tasks.train.settings import OptimConfig
from rollflow.tasks.train.worker import build_backend

NAME = "routing_replay_mismatch"
T = TypeVar("T")

# A scaled-down Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts, top-8, moe_intermediate 768, 32 / 4 heads).
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(
        hidden_size=1024,
        intermediate_size=3072,  # dense MLP size; unused with decoder_sparse_step=1 (every layer is MoE)
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1_000_000.0,
    ),
}
SHAPES = {"tiny": "builtin:addition-moe", "1b": "qwen3-moe-1b"}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int
    samples_per_prompt: int
    new_tokens: int
    micro_batch: int  # the trainer's scoring micro-batch (train.micro_batch_size)


WORKLOADS = {
    # the built-in model's context is 64 positions; tests/test_routing_replay.py's harness runs this workload
    "tiny": Workload(prompts=64, samples_per_prompt=4, new_tokens=12, micro_batch=64),
    "1b": Workload(prompts=64, samples_per_prompt=4, new_tokens=128, micro_batch=32),
}


def qwen3_moe(shape: str, *, dtype: str, device: str, seed: int = 0, max_positions: int = 4096):
    """A random-init Qwen3-MoE of `shape` (MOE_SHAPES), built from a config on `device`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return random_init(
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        MOE_SHAPES[shape],
        dtype=dtype,
        device=device,
        seed=seed,
        max_positions=max_positions,
    )


def model_path(shape: str, dtype: str, device: str, workdir: Path) -> str:
    spec = SHAPES[shape]
    if spec.startswith("builtin:"):
        return spec
    model = qwen3_moe(shape, dtype=dtype, device=device)
    path = save_model_dir(model, workdir / f"moe-{shape}")
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(path)


def active_params(model) -> int:
    """Parameters one token runs through: all but the experts it is not routed to (embedding counted once)."""
    total = param_count(model)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    config = model.config
    unused = 1 - config.num_experts_per_tok / config.num_experts
    return int(total - unused * sum(param_count(e) for e in experts))


def mismatch(trainer_log_probs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """|trainer - rollout| log-prob of every generated token (the batch's response mask), flat."""
    mask = batch.response_mask
    return (trainer_log_probs[mask] - batch.rollout_log_probs[mask]).abs()


def route_flips(calls: list[list[torch.Tensor]], batch: TrainBatch) -> tuple[int, int]:
    """(flips, slots): the (generated token, MoE layer) pairs whose top-k expert set in the trainer's own
    forward (`calls`, recorded over its micro-batches of whole rows) differs from the engine's (`batch.routes`).
    Column j of the response mask scores token j + 1, routed as input position j."""
    rows, width = batch.tokens.shape
    mask = batch.response_mask  # [B, L-1]
    flips = 0
    for layer, layer_calls in enumerate(calls):
        own = torch.cat(layer_calls, dim=0).view(rows, width, -1)[:, :-1].long().sort(dim=-1).values
        engine = batch.routes[:, :-1, layer].long().sort(dim=-1).values
        flips += int(((own != engine).any(dim=-1) & mask).sum())
    return flips, int(mask.sum()) * len(calls)


def run(args: argparse.Namespace, workdir: Path, suite: SuiteResult) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    torch.set_num_threads(args.threads)
    load = workload(args)
    seconds: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def stage(name: str, fn: Callable[[], T]) -> T:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            out = fn()
            if cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            raise RuntimeError(f"stage {name}: {type(exc).__name__}: {exc}") from exc
        seconds[name] = time.perf_counter() - start
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        print(f"[r3] {args.shape} {name}: {seconds[name]:.1f} s", file=sys.stderr, flush=True)
        return out

    model = stage("build", lambda: model_path(args.shape, args.dtype, args.device, workdir))
    rollout = RolloutConfig(
        n_samples_per_prompt=load.samples_per_prompt,
        max_new_tokens=load.new_tokens,
        temperature=1.0,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        static_cache=False,  # routes are recorded in `generate` only
        seed=args.seed,
    )
    data = DataConfig(prompts_per_rollout=load.prompts, seed=args.seed)
    engine = stage("load_engine", lambda: RolloutWorker(model, rollout, data, record_routes=True))
    optim = OptimConfig(
        backend="torch",
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        micro_batch_size=load.micro_batch,
        num_steps_per_rollout=1,
    )
    trainer = stage("load_trainer", lambda: build_backend(model, optim, temperature=1.0))
    samples = stage("generate", lambda: engine.rollout(0))
    # the batch builder needs a reward per sample; nothing here trains, so any constant does
    samples = [dataclasses.replace(s, reward=0.0) for s in samples]
    off_batch = batch_from_samples(samples, group_size=load.samples_per_prompt)
    on_batch = batch_from_samples(samples, group_size=load.samples_per_prompt, routes=True)
    layers, top_k = route_shape(trainer.model)

    def score_without_replay():
        with record_routes(trainer.model) as calls:
            log_probs = trainer.compute_log_probs(off_batch)
        return log_probs, route_flips(calls, on_batch)

    off_lp, (flips, slots) = stage("score_without_r3", score_without_replay)
    on_lp = stage("score_with_r3", lambda: trainer.compute_log_probs(on_batch))
    off, on = mismatch(off_lp, off_batch), mismatch(on_lp, on_batch)
    figures = {
        "tokens": int(off.numel()),
        "without_r3": {"mean": off.mean().item(), "max": off.max().item()},
        "with_r3": {"mean": on.mean().item(), "max": on.max().item()},
        "route_flips": flips,
        "route_slots": slots,  # generated tokens x MoE layers
    }
    figures["mean_ratio"] = figures["with_r3"]["mean"] / figures["without_r3"]["mean"]
    figures["max_ratio"] = figures["with_r3"]["max"] / figures["without_r3"]["max"]
    lowered = figures["with_r3"]["mean"] < figures["without_r3"]["mean"] or (
        figures["with_r3"]["mean"] == figures["without_r3"]["mean"]
        and figures["with_r3"]["max"] < figures["without_r3"]["max"]
    )
    figures["r3_lowers_mismatch"] = lowered

    suite.params.update(
        shape=args.shape,
        model=SHAPES[args.shape],
        config=MOE_SHAPES.get(args.shape, "builtin:addition-moe (tasks/model/tiny_moe.py)"),
        dtype=args.dtype,
        device=args.device,
        workload=dataclasses.asdict(load),
        temperature=1.0,
        seed=args.seed,
        threads=args.threads,
        moe_layers=layers,
        top_k=top_k,
        experts=int(trainer.model.config.num_experts),
        params=param_count(trainer.model),
        active_params=active_params(trainer.model),
    )
    suite.add("mismatch mean without R3", "logprob", [figures["without_r3"]["mean"]])
    suite.add("mismatch mean with R3", "logprob", [figures["with_r3"]["mean"]])
    suite.ratio("mismatch mean with / without R3", [figures["mean_ratio"]])
    suite.add("mismatch max without R3", "logprob", [figures["without_r3"]["max"]])
    suite.add("mismatch max with R3", "logprob", [figures["with_r3"]["max"]])
    suite.ratio("mismatch max with / without R3", [figures["max_ratio"]])
    suite.add("route flips (token x layer)", "pairs", [flips], note=f"of {slots}")
    suite.add("generated tokens", "tokens", [figures["tokens"]])
    for name, s in seconds.items():
        suite.add(f"{name} time", "s", [s])
    if peaks:
        suite.add("peak GPU memory", "GiB", [max(peaks.values())])
    suite.data.update(mismatch=figures, seconds=seconds, peak_gpu_memory_gib=peaks)
    if not lowered:
        suite.notes.append("R3 did not lower the mismatch")
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.routing_replay_mismatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shape", choices=list(SHAPES), default=None, help="default: 1b on CUDA, tiny on CPU")
    ap.add_argument(
        "--out", type=Path, default=None, help="default benchmarks/results/<gpu|cpu>-<date>-r3-<shape>.json"
    )
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--dtype", default="bfloat16", help="default bfloat16 (where routing flips; fp32 rarely does)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU, torch's own on CUDA)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default per shape)")
    ap.add_argument("--samples-per-prompt", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens per response")
    ap.add_argument("--micro-batch", type=int, default=None, help="the trainer's scoring micro-batch (rows)")
    ap.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder, removed)")
    ap.add_argument("--no-table", action="store_true", help="skip the table on stdout")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("1b" if cuda else "tiny")
    args.threads = args.threads or (torch.get_num_threads() if cuda else 1)
    return args


def workload(args: argparse.Namespace) -> Workload:
    overrides = {
        "prompts": args.prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "new_tokens": args.new_tokens,
        "micro_batch": args.micro_batch,
    }
    return dataclasses.replace(WORKLOADS[args.shape], **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = default_out(args.device)
    out = args.out or base.with_name(f"{base.stem}-r3-{args.shape}.json")
    command = f"python -m benchmarks.{NAME} " + " ".join(argv if argv is not None else sys.argv[1:])
    report = report_header(command, args.device, benchmark=NAME)
    suite, figures = run_standalone(
        NAME,
        "MoE train/rollout log-prob mismatch without / with routing replay (R3)",
        args.workdir,
        "rollflow-r3-",
        lambda workdir, suite: run(args, workdir, suite),
    )
    figures = figures or {}
    report["mismatch"] = figures  # the headline figures, also under suites.<name>.data
    finish_report(report, suite, out, table=not args.no_table)
    if figures:
        off, on = figures["without_r3"], figures["with_r3"]
        print(
            f"r3 {args.shape} {args.dtype}: mismatch mean/max without R3 {off['mean']:.3g}/{off['max']:.3g}, "
            f"with R3 {on['mean']:.3g}/{on['max']:.3g} ({figures['mean_ratio']:.3f}x mean, "
            f"{figures['max_ratio']:.3f}x max) over {figures['tokens']} tokens, route flips "
            f"{figures['route_flips']} of {figures['route_slots']}: R3 lowers the mismatch: "
            f"{'pass' if figures['r3_lowers_mismatch'] else 'miss'}",
            file=sys.stderr,
        )
    if suite.error:
        return 1
    return 0 if figures.get("r3_lowers_mismatch") else 3


if __name__ == "__main__":
    raise SystemExit(main())
