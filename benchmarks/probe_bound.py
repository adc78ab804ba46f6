"""The post-sync probe's per-dtype bound, measured (docs/checks.md, tasks/sync/probe.py).

An hf engine and a torch trainer hold the same weights (a Qwen2 shape built from its config, same seed); the engine
generates the probe's continuations through its ordinary `generate` (KV cache, its own forward), the trainer scores
the same tokens teacher-forced (`probe_log_probs`). The mean |engine - trainer| log-prob of a *good* sync is the
dtype's noise floor; the bound must sit above it. For contrast the same probe runs against a trainer whose weights
moved by one Adam-sized step (every parameter +-lr, the size of one Adam update), i.e. an engine left stale by
one step. Random-init weights give near-uniform next-token distributions, where log-probs hardly move, so the LM
head is scaled until the mean next-token entropy is near a trained model's (a few nats).

    python -m benchmarks.probe_bound                      # CPU: a small shape, fp32 + bf16
    python -m benchmarks.probe_bound --device cuda        # a CUDA GPU: Qwen2-0.5B shape, fp32 + bf16

Writes benchmarks/results/<machine>-probe-bound-<date>.json and prints one line per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics

import torch

from benchmarks.core import REPO, machine_info, versions
from benchmarks.models import qwen2
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tokenizer import load_tokenizer
from rollflow.tasks.rollout.hf_engine import HFEngine
from rollflow.tasks.rollout.probe import probe_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.sync.probe import ProbeBounds, ProbeSpec, compare_probe
from rollflow.tasks.train.probe import probe_log_probs
from rollflow.tasks.train.settings import OptimConfig
from rollflow.tasks.train.torch_backend import TorchBackend


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    seed: int
    good: float  # mean |engine - trainer| after a good sync
    good_max: float
    stale: float  # ... with the trainer one Adam-sized step ahead of the engine
    tokens: int
    entropy: float  # mean next-token entropy of the probe positions (nats)


def _peaked(model, target_entropy: float) -> float:
    """Scale the LM head (tied to the embeddings in this shape) so next-token entropies look like a trained
    model's: bisection on a log scale; returns the scale used."""
    head = model.get_output_embeddings().weight
    ids = torch.randint(3, 500, (4, 32), device=head.device)
    base = head.detach().clone()

    def entropy_at(scale: float) -> float:
        with torch.no_grad():
            head.copy_(base * scale)
            logits = model(input_ids=ids).logits.float()
        return float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean())

    lo, hi = 0.0, math.log(1000.0)
    for _ in range(20):
        mid = (lo + hi) / 2
        if entropy_at(math.exp(mid)) > target_entropy:
            lo = mid
        else:
            hi = mid
    entropy_at(math.exp(hi))
    return math.exp(hi)


def _entropy(model, samples) -> float:
    values = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device=model.device)
            logits = model(input_ids=ids).logits.float()[0, -s.response_length - 1 : -1]
            values.append(float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()))
    return statistics.fmean(values)


def measure(shape: str, dtype: str, device: str, seed: int, spec: ProbeSpec, lr: float) -> Case:
    model = qwen2(shape, dtype="float32", device=device, seed=seed)
    scale = _peaked(model, target_entropy=2.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    engine_model = qwen2(shape, dtype="float32", device=device, seed=seed)
    engine_model.load_state_dict(state)
    engine = HFEngine(engine_model.to(getattr(torch, dtype)), pad_token_id=0, eos_token_id=2)
    trainer_model = qwen2(shape, dtype="float32", device=device, seed=seed)
    trainer_model.load_state_dict(state)
    backend = TorchBackend(
        trainer_model.to(getattr(torch, dtype)),
        OptimConfig(dtype=dtype, device=device, threads=torch.get_num_threads()),
        keep_ref=False,
    )
    del state
    tokenizer = load_tokenizer(resolve_model_path("builtin:addition"))
    rollout = RolloutConfig(temperature=1.0, max_new_tokens=spec.tokens)
    samples = probe_samples(engine, tokenizer, DataConfig(prompts_per_rollout=spec.prompts), rollout, spec)
    engine_lp = [s.rollout_log_probs for s in samples]
    good = compare_probe(engine_lp, probe_log_probs(backend, samples), dtype=dtype, bound=math.inf, weight_version=1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in backend.model.parameters():
            step = torch.randint(0, 2, p.shape, generator=gen).to(p.device, torch.float32) * 2 - 1
            p.copy_((p.float() + lr * step).to(p.dtype))
    stale = compare_probe(engine_lp, probe_log_probs(backend, samples), dtype=dtype, bound=math.inf, weight_version=2)
    entropy = _entropy(engine.model, samples)
    print(
        f"{shape} {dtype} seed {seed} (head x{scale:.3g}, entropy {entropy:.2f} nats): good sync "
        f"{good.mean_abs_diff:.3g} (max {good.max_abs_diff:.3g}), engine one step stale (lr {lr:g}) "
        f"{stale.mean_abs_diff:.3g} over {good.tokens} tokens"
    )
    return Case(dtype, seed, good.mean_abs_diff, good.max_abs_diff, stale.mean_abs_diff, good.tokens, entropy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default=None, help="benchmarks/models.py shape (default by device)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5, help="size of the one Adam step the stale engine missed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = args.shape or ("qwen2-0.5b" if args.device.startswith("cuda") else "cpu-sync")
    spec = ProbeSpec(prompts=args.prompts, tokens=args.tokens)
    cases = [
        measure(shape, dtype, args.device, seed, spec, args.lr)
        for dtype in ("float32", "bfloat16")
        for seed in range(1, args.seeds + 1)
    ]
    bounds = ProbeBounds()
    summary = {}
    for dtype in ("float32", "bfloat16"):
        rows = [c for c in cases if c.dtype == dtype]
        bound = getattr(bounds, dtype)
        summary[dtype] = {
            "bound": bound,
            "good_max_of_means": max(c.good for c in rows),
            "stale_min_of_means": min(c.stale for c in rows),
            "good_under_bound": all(c.good <= bound for c in rows),
            "stale_over_bound": all(c.stale > bound for c in rows),
        }
        print(f"{dtype}: {summary[dtype]}")
    stamp = datetime.date.today().isoformat()
    kind = "h200" if "H200" in (torch.cuda.get_device_name() if args.device.startswith("cuda") else "") else "cpu"
    out = args.out or REPO / "benchmarks" / "results" / f"{kind}-{stamp}-probe-bound.json"
    report = {
        "benchmark": "probe_bound",
        "shape": shape,
        "device": args.device,
        "lr": args.lr,
        "spec": dataclasses.asdict(spec),
        "cases": [dataclasses.asdict(c) for c in cases],
        "summary": summary,
        "machine": machine_info(),
        "versions": versions(),
    }
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
