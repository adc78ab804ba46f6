"""The training objective of one micro-batch, shared by every backend.

Reductions use the denominators of the whole mini-batch, so splitting a mini-batch into
micro-batches leaves the gradient unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.kl import approx_kl
from rollflow.tasks.train.losses import importance_correction, policy_loss
from rollflow.tasks.train.settings import AlgoConfig

STAT_NAMES = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss",
              "train_rollout_logprob_abs_diff", "tis", "tis_clipfrac")


@dataclasses.dataclass(frozen=True)
class Denominators:
    tokens: float  # masked response tokens in the mini-batch
    rows: float  # samples in the mini-batch with at least one response token

    @classmethod
    def of(cls, mini: TrainBatch) -> "Denominators":
        per_row = mini.response_mask.sum(dim=1)
        return cls(tokens=max(float(per_row.sum()), 1.0), rows=max(float((per_row > 0).sum()), 1.0))


def reduce(values: torch.Tensor, mask: torch.Tensor, denom: Denominators, per_sample: bool) -> torch.Tensor:
    """This micro-batch's share of the mini-batch mean (token- or sample-level)."""
    if per_sample:
        row_tokens = mask.sum(dim=1).clamp(min=1.0)
        return ((values * mask).sum(dim=1) / row_tokens).sum() / denom.rows
    return (values * mask).sum() / denom.tokens


def micro_batch_objective(log_probs: torch.Tensor, entropy: torch.Tensor, micro: TrainBatch, algo: AlgoConfig,
                          denom: Denominators) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to backpropagate plus this micro-batch's share of every `train/*` statistic."""
    mask = micro.response_mask
    per_sample = algo.loss_reduction == "sample"
    terms = policy_loss(log_probs, micro.log_probs, micro.advantages, eps_clip=algo.eps_clip,
                        eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c)
    pg_per_token = terms.loss
    stats: dict[str, torch.Tensor] = {}
    if algo.tis is not None:
        weights, clipped = importance_correction(micro.log_probs, micro.rollout_log_probs, mask, mode=algo.tis,
                                                 low=algo.tis_low, high=algo.tis_high)
        pg_per_token = pg_per_token * weights
        stats["tis"] = reduce(weights, mask, denom, False)
        stats["tis_clipfrac"] = reduce(clipped.float(), mask, denom, False)
    pg_loss = reduce(pg_per_token, mask, denom, per_sample)
    entropy_loss = reduce(entropy, mask, denom, per_sample)
    loss = pg_loss - algo.entropy_coef * entropy_loss
    if algo.kl_loss_coef > 0:
        kl = approx_kl(log_probs, micro.ref_log_probs, algo.kl_loss_type)
        kl_loss = reduce(kl, mask, denom, per_sample)
        loss = loss + algo.kl_loss_coef * kl_loss
        stats["kl_loss"] = kl_loss
    stats.update(
        loss=loss,
        pg_loss=pg_loss,
        entropy_loss=entropy_loss,
        pg_clipfrac=reduce(terms.clipped.float(), mask, denom, False),
        ppo_kl=reduce(terms.ppo_kl, mask, denom, False),
        train_rollout_logprob_abs_diff=reduce((log_probs - micro.rollout_log_probs).abs(), mask, denom, False),
    )
    return loss, {k: float(v.detach()) for k, v in stats.items()}


def minibatch_slices(n_rows: int, steps_per_rollout: int) -> list[slice]:
    """Rows of each optimizer step's mini-batch: consecutive, ceil(n / steps) rows each (the last ones
    may be short or empty). Data parallel ranks derive their shares from these same slices."""
    steps = min(steps_per_rollout, n_rows)
    if steps == 0:
        return []
    mini_size = -(-n_rows // steps)
    return [slice(step * mini_size, min((step + 1) * mini_size, n_rows)) for step in range(steps)]


def minibatch_steps(batch: TrainBatch, steps_per_rollout: int, micro_batch_size: int, *,
                    zero_grad, micro_step, optimizer_step,
                    local_rows: Callable[[int], slice] | None = None,
                    sum_stats: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, float]:
    """The optimizer loop every backend shares: consecutive mini-batches, one optimizer step each.

    `micro_step(micro, denom) -> stats` runs forward + objective + backward of one micro-batch;
    `optimizer_step() -> grad_norm` clips and steps. Returns the mean of the step statistics as
    `train/*`, plus the first step's ppo_kl / pg_clipfrac / grad_norm (exactly 0, 0, finite at step 1).

    Data parallel (both None on one rank): `local_rows(mini_size) -> slice` picks this rank's rows of
    each mini-batch, and `sum_stats(stats) -> stats` sums the ranks' shares of the statistics. The
    denominators stay those of the whole mini-batch (every rank holds the whole batch), so the ranks'
    losses add up to the single-rank loss and their gradients must be summed, not averaged.
    """
    slices = minibatch_slices(batch.size, steps_per_rollout)
    steps = len(slices)
    totals: dict[str, float] = {}
    first: dict[str, float] = {}
    for rows in slices:
        mini = batch.select(rows)
        if mini.size == 0:
            continue
        denom = Denominators.of(mini)
        if local_rows is not None:
            mini = mini.select(local_rows(mini.size))  # may be empty: the rank still joins the collectives
        zero_grad()
        acc: dict[str, float] = {}
        for start in range(0, mini.size, micro_batch_size):
            for key, value in micro_step(mini.select(slice(start, start + micro_batch_size)), denom).items():
                acc[key] = acc.get(key, 0.0) + value
        if sum_stats is not None:
            acc = sum_stats(acc)
        acc["grad_norm"] = float(optimizer_step())
        if not first:
            first = dict(acc)
        for key, value in acc.items():
            totals[key] = totals.get(key, 0.0) + value / steps
    out = {f"train/{k}": v for k, v in totals.items()}
    out.update({f"train/step1_{k}": v for k, v in first.items() if k in ("ppo_kl", "pg_clipfrac", "grad_norm")})
    return out
