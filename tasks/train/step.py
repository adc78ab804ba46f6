"""One train call on one rollout: score it, compute advantages, step the optimizer.

Read top to bottom; every backend goes through here (DESIGN.md section 7).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from rollflow.artifacts.sample import Sample
from rollflow.tasks.train.advantages import compute_advantages
from rollflow.tasks.train.batch import TrainBatch, batch_from_samples, per_sample, to_dense
from rollflow.tasks.train.kl import approx_kl
from rollflow.tasks.train.losses import masked_mean
from rollflow.tasks.train.settings import AlgoConfig


class TrainBackend(Protocol):
    name: str

    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor: ...

    def train(self, batch: TrainBatch, algo: AlgoConfig) -> dict[str, float]: ...

    def named_weights(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_bytes(self) -> bytes: ...

    def load_checkpoint_bytes(self, data: bytes) -> None: ...


@dataclasses.dataclass
class TrainResult:
    metrics: dict[str, float]
    batch: TrainBatch  # with log_probs / ref_log_probs / advantages filled, for dumps and checks


def prepare_batch(backend: TrainBackend, samples: list[Sample], algo: AlgoConfig, *, group_size: int,
                  compute_ref: bool = True) -> tuple[TrainBatch, dict[str, float]]:
    """Old and reference log-probs, KL, advantages and the `rollout/*` metrics."""
    batch = batch_from_samples(samples, group_size=group_size)
    mask = batch.response_mask
    batch.log_probs = backend.compute_log_probs(batch, "policy")
    if compute_ref or algo.needs_ref:
        batch.ref_log_probs = backend.compute_log_probs(batch, "ref")
    rewards = batch.rewards.clone()
    kl_rows = None
    if algo.kl_coef > 0:
        kl = approx_kl(batch.log_probs, batch.ref_log_probs, algo.kl_penalty_type) * mask
        kl_rows = per_sample(kl, mask)
        if algo.advantage_estimator in ("grpo", "gspo", "rloo"):
            # Sequence-level estimators take the penalty on the scalar reward.
            rewards = rewards - algo.kl_coef * kl.sum(dim=1).double()
    token_kl = algo.advantage_estimator.startswith("reinforce")
    adv_rows, ret_rows = compute_advantages(
        algo.advantage_estimator, rewards, [m[m > 0] for m in mask], group_size,
        normalize_std=algo.normalize_advantage_std,
        kl=kl_rows if token_kl else None, kl_coef=algo.kl_coef if token_kl else 0.0,
        gamma=algo.gamma if algo.advantage_estimator == "reinforce_plus_plus" else 1.0,
    )
    batch.advantages = to_dense([a.float() for a in adv_rows], mask)
    batch.returns = to_dense([r.float() for r in ret_rows], mask)

    metrics = {
        "rollout/raw_reward": float(batch.rewards.mean()),
        "rollout/response_len": float(batch.response_lengths().mean()),
        "rollout/truncated_ratio": float(batch.truncated.float().mean()),
        "rollout/log_probs": float(masked_mean(batch.log_probs, mask)),
        "rollout/rollout_log_probs": float(masked_mean(batch.rollout_log_probs, mask)),
        "rollout/advantages": float(masked_mean(batch.advantages, mask)),
    }
    if batch.ref_log_probs is not None:
        on = mask > 0
        metrics["rollout/ref_log_probs"] = float(masked_mean(batch.ref_log_probs, mask))
        metrics["rollout/kl"] = float(masked_mean(batch.log_probs - batch.ref_log_probs, mask))
        metrics["rollout/log_probs_equal_ref"] = float(torch.equal(batch.log_probs[on], batch.ref_log_probs[on]))
    return batch, metrics


def train_on_samples(backend: TrainBackend, samples: list[Sample], algo: AlgoConfig, *, group_size: int,
                     compute_ref: bool = True) -> TrainResult:
    batch, metrics = prepare_batch(backend, samples, algo, group_size=group_size, compute_ref=compute_ref)
    metrics.update(backend.train(batch, algo))
    return TrainResult(metrics=metrics, batch=batch)
