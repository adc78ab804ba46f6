"""One train call on one rollout: score it, compute advantages, step the optimizer.

Read top to bottom; every backend goes through here (docs/architecture.md section 11).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from rollflow.artifacts.columns import SampleColumns
from rollflow.artifacts.sample import Sample
from rollflow.tasks.groups import identical_group_fraction
from rollflow.tasks.train.advantages import compute_advantages
from rollflow.tasks.train.batch import TrainBatch, batch_from_samples, per_sample, to_dense
from rollflow.tasks.train.batch_columns import batch_from_columns, identical_group_fraction_of_columns
from rollflow.tasks.train.kl import approx_kl
from rollflow.tasks.train.losses import masked_mean
from rollflow.tasks.train.mismatch import correction, corrects, mismatch_metrics
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.turn_credit import turn_units

if TYPE_CHECKING:
    from rollflow.tasks.train.critic import CriticEstimate


class TrainBackend(Protocol):
    """What every backend does (TorchBackend, MegatronBackend). What only some do (sharding, offload, bucket
    export, ...) are the capability protocols of tasks/train/capabilities.py, asked with `isinstance`."""

    name: str
    optim_cfg: OptimConfig  # train.* as the backend applies it (checks may narrow it for one call)
    temperature: float  # the sampling temperature its log-probs divide by

    def compute_log_probs(self, batch: TrainBatch, which: str = "policy") -> torch.Tensor: ...

    def train(
        self, batch: TrainBatch, algo: AlgoConfig, on_step: Callable[[dict[str, float]], None] | None = None
    ) -> dict[str, float]: ...

    def named_weights(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_bytes(self) -> bytes: ...

    def load_checkpoint_bytes(self, data: bytes) -> None: ...


@dataclasses.dataclass
class TrainResult:
    metrics: dict[str, float]
    batch: TrainBatch  # with log_probs / ref_log_probs / advantages filled, for dumps and checks
    # each optimizer step's own statistics (loss, pg_loss, grad_norm, ...; unprefixed), in step order
    steps: list[dict[str, float]] = dataclasses.field(default_factory=list)


def use_critic_estimate(batch: TrainBatch, critic: CriticEstimate | None) -> None:
    """ppo: take the critic actor's values, advantages and returns (computed on the same artifact, same order)."""
    if critic is None:
        raise ValueError(
            "advantage_estimator='ppo' takes its advantages from the critic actor (GAE on its values); "
            "none was given: train ppo through rl_train, which runs the critic beside the trainer"
        )
    for name in ("values", "advantages", "returns"):
        tensor = getattr(critic, name)
        if tuple(tensor.shape) != tuple(batch.response_mask.shape):
            raise ValueError(
                f"the critic's {name} have shape {tuple(tensor.shape)}, the rollout's batch "
                f"{tuple(batch.response_mask.shape)}: the critic scored another rollout"
            )
        setattr(batch, name, tensor.float())


def prepare_batch(
    backend: TrainBackend,
    samples: list[Sample] | SampleColumns,
    algo: AlgoConfig,
    *,
    group_size: int,
    compute_ref: bool = True,
    critic: CriticEstimate | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """Old and reference log-probs, KL, advantages and the `rollout/*` metrics. `critic`: ppo's advantages."""
    # An artifact's columns (train_on_artifact) give the same batch without a Python object per token.
    columnar = isinstance(samples, SampleColumns)
    routes = algo.routing_replay  # MoE: every scoring forward below replays the engine's experts
    batch = (
        batch_from_columns(samples, group_size=group_size, routes=routes)
        if columnar
        else batch_from_samples(samples, group_size=group_size, routes=routes)
    )
    mask = batch.response_mask
    span = batch.span()
    # slime's --use-rollout-logprobs: the engine's log-probs are the old policy; no trainer forward.
    batch.log_probs = (
        batch.rollout_log_probs.clone() if algo.use_rollout_logprobs else backend.compute_log_probs(batch, "policy")
    )
    if compute_ref or algo.needs_ref:
        batch.ref_log_probs = backend.compute_log_probs(batch, "ref")
    rewards = batch.rewards.clone()
    kl_rows = None
    if algo.kl_coef > 0:
        kl = approx_kl(batch.log_probs, batch.ref_log_probs, algo.kl_penalty_type) * mask
        kl_rows = per_sample(kl, span)
        if algo.advantage_estimator in ("grpo", "gspo", "rloo"):
            # Sequence-level estimators take the penalty on the scalar reward.
            rewards = rewards - algo.kl_coef * kl.sum(dim=1).double()
    if algo.advantage_estimator == "ppo":
        # GAE needs the critic's values: the critic actor computed them and the advantages (critic_worker.py).
        use_critic_estimate(batch, critic)
    else:
        token_kl = algo.advantage_estimator.startswith("reinforce")
        # Whole response spans: reinforce_plus_plus discounts over masked (tool output) tokens too, as slime.
        adv_rows, ret_rows = compute_advantages(
            algo.advantage_estimator,
            rewards,
            per_sample(mask, span),
            group_size,
            normalize_std=algo.normalize_advantage_std,
            kl=kl_rows if token_kl else None,
            kl_coef=algo.kl_coef if token_kl else 0.0,
            gamma=algo.gamma if algo.advantage_estimator == "reinforce_plus_plus" else 1.0,
            turn_units=turn_units(samples),  # per-turn rewards (conversation feedback), else None
        )
        batch.advantages = to_dense([a.float() for a in adv_rows], span)
        batch.returns = to_dense([r.float() for r in ret_rows], span)

    metrics = {
        "rollout/raw_reward": float(batch.rewards.mean()),
        "rollout/response_len": float(batch.response_lengths().mean()),
        "rollout/truncated_ratio": float(batch.truncated.float().mean()),
        # groups of identical samples have all-zero advantages (1.0: the deterministic-seed trap)
        "rollout/identical_groups": identical_group_fraction_of_columns(samples, group_size)
        if columnar
        else identical_group_fraction([s.tokens for s in samples], group_size),
        "rollout/log_probs": float(masked_mean(batch.log_probs, mask)),
        "rollout/rollout_log_probs": float(masked_mean(batch.rollout_log_probs, mask)),
        "rollout/advantages": float(masked_mean(batch.advantages, mask)),
    }
    # Imported slime dumps may lack the engine's log-probs (zeros): no mismatch figure, no correction.
    has_rollout_lp = not (
        samples.metadata_flag("rollout_log_probs_missing")
        if columnar
        else any(s.metadata.get("rollout_log_probs_missing") for s in samples)
    )
    if has_rollout_lp and not algo.use_rollout_logprobs:
        metrics.update(mismatch_metrics(batch.log_probs, batch.rollout_log_probs, mask))
    if corrects(algo):
        if not has_rollout_lp:
            raise ValueError(
                "algo.use_tis / use_rs / rs_veto_threshold need the rollout engine's log-probs, but "
                "this rollout was imported without them; turn them off for this replay"
            )
        fix = correction(batch.log_probs, batch.rollout_log_probs, mask, algo)
        batch.is_weights, batch.loss_keep = fix.weights, fix.keep
        metrics.update(fix.metrics)
        if algo.use_tis:  # slime's names: the raw mean ratio, and the share of tokens the bounds changed
            metrics["train/tis"] = metrics["mismatch/tis"]
            metrics["train/tis_clipfrac"] = fix.metrics.get(
                "mismatch/tis_clipfrac", fix.metrics.get("mismatch/tis_maskfrac", 0.0)
            )
    if batch.ref_log_probs is not None:
        on = mask > 0
        metrics["rollout/ref_log_probs"] = float(masked_mean(batch.ref_log_probs, mask))
        metrics["rollout/kl"] = float(masked_mean(batch.log_probs - batch.ref_log_probs, mask))
        metrics["rollout/log_probs_equal_ref"] = float(torch.equal(batch.log_probs[on], batch.ref_log_probs[on]))
    return batch, metrics


def train_on_samples(
    backend: TrainBackend,
    samples: list[Sample] | SampleColumns,
    algo: AlgoConfig,
    *,
    group_size: int,
    compute_ref: bool = True,
    critic: CriticEstimate | None = None,
) -> TrainResult:
    batch, metrics = prepare_batch(
        backend, samples, algo, group_size=group_size, compute_ref=compute_ref, critic=critic
    )
    steps: list[dict[str, float]] = []
    metrics.update(backend.train(batch, algo, on_step=steps.append))
    return TrainResult(metrics=metrics, batch=batch, steps=steps)
