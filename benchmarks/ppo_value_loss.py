"""PPO with a critic at a model shape, in one process: does the critic's value loss fall? (issue 36)

    python -m benchmarks.ppo_value_loss --shape 0.5b --iterations 15     # one CUDA GPU (scripts/ppo_gpu.sh)
    python -m benchmarks.ppo_value_loss --shape tiny --iterations 6      # CPU, seconds

`algo.advantage_estimator=ppo` as `rl_iteration` runs it, without Ray or Prefect: the rollout worker (hf
engine), the policy trainer and the critic are the plain classes their actors wrap (`tasks/rollout/worker.py`,
`tasks/train/worker.py`, `tasks/train/critic_worker.py`), built in this process on one device. Per iteration:

    generate -> reward -> persist -> critic estimate (old values, GAE) -> policy train (the critic's
    advantages) -> critic update (value-loss steps) -> weight sync into the engine -> parity

Models are random-init Qwen2 shapes (benchmarks/models.py; `tiny` is the demo's built-in model). A random
policy earns nothing on the addition task, so the reward here is one with variance under any policy, defined
on token ids alone: the share of a response's token ids below half the vocabulary (`LowTokenIdShare`). The
critic starts at 0 (zero-initialised head), so its value loss starts near 0.5 * E[reward^2] and falls as the
values learn the returns.

Each optimizer step's loss is taken before that step, on a mini-batch it has not trained on
(`num_steps_per_rollout` mini-batches per rollout), so `critic/value_loss` is a prediction error on unseen
rollouts, not a fit to seen ones. `critic/explained_variance` is the critic's before the update.

The JSON: shape, dtype, device, trainer backend, the per-iteration figures (critic/*, rollout/raw_reward,
the per-sample rewards, train/*, seconds per stage, peak GPU memory on CUDA), the value-loss series and the
verdict: "value loss falls" passes when the mean of the last K iterations is below the mean of the first K
(K = 3, or half the iterations when fewer than 6). Exit status: 0 pass, 3 miss, 1 a stage failed (the JSON
keeps the iterations finished before it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.core import default_out, git_sha, machine_info, write_json
from benchmarks.e2e_iteration import StageClock
from benchmarks.models import param_count, qwen2, save_model_dir
from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.sample import Sample
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.rollout.rewards import score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import compare
from rollflow.tasks.train.critic_worker import CriticWorker
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.worker import TrainWorker

RUN = "ppo"
STAGES = ("generate", "reward", "persist", "critic_estimate", "train", "critic_update", "sync", "parity")
# --shape -> benchmarks/models.py shape; tiny is the built-in model of the demo
SHAPES = {"tiny": "builtin:addition", "small": "cpu-small", "0.5b": "qwen2-0.5b"}
CRITIC_FIGURES = ("critic/value_loss", "critic/explained_variance", "critic/values", "critic/returns")


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int
    samples_per_prompt: int
    new_tokens: int
    micro_batch: int
    steps: int  # optimizer steps per rollout, policy and critic (train.num_steps_per_rollout)
    critic_lr: float
    policy_lr: float


WORKLOADS = {
    # the built-in model's context is 64 positions
    "tiny": Workload(
        prompts=8, samples_per_prompt=4, new_tokens=8, micro_batch=32, steps=4, critic_lr=1e-3, policy_lr=1e-6
    ),
    "small": Workload(
        prompts=8, samples_per_prompt=4, new_tokens=32, micro_batch=32, steps=4, critic_lr=1e-4, policy_lr=1e-6
    ),
    "0.5b": Workload(
        prompts=32, samples_per_prompt=8, new_tokens=256, micro_batch=8, steps=4, critic_lr=1e-4, policy_lr=1e-6
    ),
}


class LowTokenIdShare:
    """Reward: the share of the response's token ids below vocab_size / 2 (0 for an empty response).

    Defined on token ids alone, so it has variance under a random policy and needs no trained model; a critic
    can learn its mean at once and, from the response so far, part of each sample's deviation from it."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.__name__ = f"low_token_id_share(vocab_size={vocab_size})"

    def __call__(self, sample: Sample) -> float:
        response = sample.response_tokens
        if not response:
            return 0.0
        return sum(1 for t in response if t < self.vocab_size / 2) / len(response)


def model_vocab_size(model: str) -> int:
    """From the model directory's config.json (not from the workers under test)."""
    return int(json.loads((resolve_model_path(model) / "config.json").read_text())["vocab_size"])


def first_last(series: list[float], k: int | None = None) -> dict[str, Any]:
    """Mean of the first k vs the last k values; 'falls' when the last mean is below the first."""
    if len(series) < 2:
        raise ValueError(f"a first-vs-last comparison needs 2 iterations or more, got {len(series)}")
    k = k or min(3, len(series) // 2)
    first, last = statistics.fmean(series[:k]), statistics.fmean(series[-k:])
    return {"k": k, "first_mean": first, "last_mean": last, "last_over_first": last / first if first else None}


def model_path(shape: str, dtype: str, device: str, workdir: Path) -> str:
    """The built-in model, or a random-init Qwen2 of the shape saved as a local HF directory all three load."""
    spec = SHAPES[shape]
    if spec.startswith("builtin:"):
        return spec
    model = qwen2(spec, dtype=dtype, device=device, seed=0)
    path = save_model_dir(model, workdir / f"ppo-{shape}")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(path)


@dataclasses.dataclass
class Workers:
    engine: RolloutWorker
    trainer: TrainWorker
    critic: CriticWorker
    store: RolloutStore
    rollout: RolloutConfig


def build_workers(model: str, load: Workload, args: argparse.Namespace, store_root: str) -> Workers:
    rollout = RolloutConfig(
        n_samples_per_prompt=load.samples_per_prompt,
        max_new_tokens=load.new_tokens,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
    )
    optim = OptimConfig(
        backend=args.train_backend,
        num_steps_per_rollout=load.steps,
        micro_batch_size=load.micro_batch,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        lr=load.policy_lr,
        compute_ref_log_probs=False,  # no KL term
    )
    algo = AlgoConfig(advantage_estimator="ppo", critic_lr=load.critic_lr)
    data = DataConfig(prompts_per_rollout=load.prompts)
    engine = RolloutWorker(model, rollout, data)
    trainer = TrainWorker(model, optim, algo, store_root=store_root, run=RUN, temperature=rollout.temperature or 1.0)
    critic = CriticWorker(model, optim, algo, store_root=store_root, run=RUN)
    return Workers(engine, trainer, critic, RolloutStore(store_root), rollout)


def persist(w: Workers, rollout_id: int, samples: list[Sample]) -> ArtifactRef:
    d = w.engine.describe()
    return w.store.write(
        RUN,
        "train",
        rollout_id,
        samples,
        n_samples_per_prompt=w.rollout.n_samples_per_prompt,
        engine=EngineInfo(backend=d.backend, model=d.model, weight_version=d.weight_version),
        config_hash="benchmark",
    )


def run_iteration(w: Workers, rollout_id: int, reward: LowTokenIdShare, device: str, cast: str | None) -> dict:
    cuda = device.startswith("cuda")
    stage = StageClock(rollout_id, cuda)
    seconds, peaks = stage.seconds, stage.peaks

    started = time.perf_counter()
    samples = stage("generate", lambda: w.engine.rollout(rollout_id))
    samples = stage("reward", lambda: score_samples(samples, reward))
    ref = stage("persist", lambda: persist(w, rollout_id, samples))
    estimate = stage("critic_estimate", lambda: w.critic.estimate(ref))
    train = stage("train", lambda: w.trainer.train_on_artifact(ref, critic=estimate))
    critic = stage("critic_update", w.critic.update)
    stage("sync", lambda: w.engine.update_weights(w.trainer.named_weights(), rollout_id + 1))
    report = stage("parity", lambda: compare(w.trainer.weight_checksums(cast), w.engine.weight_checksums()))
    if not report.ok:
        raise RuntimeError(f"iteration {rollout_id}: {report.summary()}")
    rewards = [float(s.reward) for s in samples]
    return {
        "rollout_id": rollout_id,
        **{k: critic[k] for k in CRITIC_FIGURES},
        "critic": critic,
        "rollout/raw_reward": statistics.fmean(rewards),
        "rollout/raw_reward_std": statistics.pstdev(rewards),
        "rewards": rewards,
        "train/loss": train.get("train/loss"),
        "train": {k: v for k, v in train.items() if isinstance(v, (int, float))},
        "samples": len(samples),
        "generated_tokens": sum(s.response_length for s in samples),
        "seconds": seconds,
        "iteration_s": time.perf_counter() - started,
        "peak_bytes": peaks,  # empty off CUDA
        "parity_ok": report.ok,
    }


def summarize(result: dict, k: int | None) -> None:
    its = result["per_iteration"]
    losses = [it["critic/value_loss"] for it in its]
    result["value_loss"] = losses
    result["explained_variance"] = [it["critic/explained_variance"] for it in its]
    result["raw_reward"] = [it["rollout/raw_reward"] for it in its]
    if len(losses) >= 2:
        fl = first_last(losses, k)
        result["value_loss_first_vs_last"] = fl
        result["checks"] = {"value loss falls": "pass" if fl["last_mean"] < fl["first_mean"] else "miss"}
    result["stage_seconds_median"] = {s: statistics.median(it["seconds"][s] for it in its) for s in STAGES}
    if its and its[0]["peak_bytes"]:
        result["peak_gpu_memory_gib"] = max(max(it["peak_bytes"].values()) for it in its) / 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.ppo_value_loss",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shape", choices=list(SHAPES), default=None, help="default: 0.5b on CUDA, tiny on CPU")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument(
        "--out", type=Path, default=None, help="default benchmarks/results/<gpu|cpu>-<date>-ppo-<shape>.json"
    )
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--train-backend", default="torch", help="the policy trainer's backend (the critic is torch)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (default 1 on CPU, as RunConfig; torch's own on CUDA)"
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default per shape)")
    ap.add_argument("--samples-per-prompt", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens per response")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per rollout (policy and critic)")
    ap.add_argument("--critic-lr", type=float, default=None)
    ap.add_argument("--first-last", type=int, default=None, help="K of the first-K vs last-K comparison")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder, removed)")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("0.5b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.threads = args.threads or (torch.get_num_threads() if cuda else 1)
    if args.iterations < 2:
        ap.error("--iterations must be >= 2 (the verdict compares first and last iterations)")
    return args


def workload(args: argparse.Namespace) -> Workload:
    load = WORKLOADS[args.shape]
    overrides = {
        "prompts": args.prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "new_tokens": args.new_tokens,
        "steps": args.steps,
        "critic_lr": args.critic_lr,
    }
    return dataclasses.replace(load, **{k: v for k, v in overrides.items() if v is not None})


def run(args: argparse.Namespace, workdir: Path) -> dict:
    cuda = args.device.startswith("cuda")
    torch.set_num_threads(args.threads)
    load = workload(args)
    model = model_path(args.shape, args.dtype, args.device, workdir)
    vocab = model_vocab_size(model)
    reward = LowTokenIdShare(vocab)
    started = time.perf_counter()
    w = build_workers(model, load, args, str(workdir / "store"))
    startup_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "benchmark": "ppo_value_loss",
        "shape": args.shape,
        "model": SHAPES[args.shape],
        "params": param_count(w.engine.engine.model),
        "dtype": args.dtype,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "train_backend": w.trainer.describe().backend,
        "critic_backend": w.critic.backend.name,
        "engine": "hf",
        "iterations": args.iterations,
        "workload": dataclasses.asdict(load),
        "reward": {"name": reward.__name__, "vocab_size": vocab, "threshold": vocab / 2},
        "stages": list(STAGES),
        "git_sha": git_sha(),
        "machine": machine_info(),
        "startup_s": startup_s,
        "per_iteration": [],
    }
    # parity compares in the engine's dtype when it differs from the trainer's
    cast = w.rollout.dtype if w.rollout.dtype != args.dtype else None
    try:
        for rollout_id in range(args.iterations):
            it = run_iteration(w, rollout_id, reward, args.device, cast)
            result["per_iteration"].append(it)
            print(
                f"[ppo] {args.shape} iteration {rollout_id}: value_loss {it['critic/value_loss']:.5f} "
                f"explained_var {it['critic/explained_variance']:+.3f} values {it['critic/values']:.4f} "
                f"returns {it['critic/returns']:.4f} reward {it['rollout/raw_reward']:.4f} "
                f"train/loss {it['train/loss']:+.5f} {it['iteration_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    except Exception as exc:  # noqa: BLE001 - the iterations finished before the failure stay in the JSON
        traceback.print_exc()
        result["error"] = str(exc)
    summarize(result, args.first_last)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or default_out(args.device).with_name(f"{default_out(args.device).stem}-ppo-{args.shape}.json")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.workdir)
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rollflow-ppo-") as tmp:
            result = run(args, Path(tmp))
    write_json(result, out)
    verdict = result.get("checks", {}).get("value loss falls", "not reached")
    fl = result.get("value_loss_first_vs_last")
    if fl:
        print(
            f"ppo {args.shape}: value loss first {fl['k']} mean {fl['first_mean']:.5f} -> last {fl['k']} mean "
            f"{fl['last_mean']:.5f}: value loss falls: {verdict}",
            file=sys.stderr,
        )
    print(f"wrote {out}", file=sys.stderr)
    if result.get("error"):
        return 1
    return 0 if verdict == "pass" else 3


if __name__ == "__main__":
    raise SystemExit(main())
