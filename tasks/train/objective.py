"""The training objective of one micro-batch, shared by every backend.

Reductions use the denominators of the whole mini-batch, so splitting a mini-batch into
micro-batches leaves the gradient unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from rollflow.tasks.train.batch import TrainBatch
from rollflow.tasks.train.kl import approx_kl
from rollflow.tasks.train.losses import policy_loss
from rollflow.tasks.train.settings import AlgoConfig

STAT_NAMES = (
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "ppo_kl",
    "kl_loss",
    "entropy_loss",
    "train_rollout_logprob_abs_diff",
    "ratio_clampfrac",
)


@dataclasses.dataclass(frozen=True)
class Denominators:
    tokens: float  # loss tokens in the mini-batch
    rows: float  # samples in the mini-batch, fully masked ones included (as slime divides by samples)
    width: float  # response columns of the padded layout, the token-sum-norm divisor when none is set

    @classmethod
    def of(cls, mini: TrainBatch) -> "Denominators":
        per_row = mini.response_mask.sum(dim=1)
        return cls(
            tokens=max(float(per_row.sum()), 1.0),
            rows=max(float(mini.size), 1.0),
            width=max(float(mini.response_mask.shape[1]), 1.0),
        )


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, denom: Denominators, mode: str, norm: float | None = None
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss under ``mode`` (verl's ``loss_agg_mode`` names).

    With ``v`` the masked values and ``n_i`` sample i's loss tokens, over the mini-batch's N samples and
    T loss tokens: ``token-mean`` ``sum v / T``; ``seq-mean-token-mean`` ``sum_i (sum_t v / n_i) / N``;
    ``seq-mean-token-sum`` ``sum v / N``; ``seq-mean-token-sum-norm`` ``sum v / (N * C)`` with the
    constant ``C = norm`` (Dr. GRPO: the generation budget; ``denom.width`` if None). Fully masked
    samples count in N (they add 0 to the numerator), as slime's per-sample mean does. Masked slots
    are dropped with ``where``, so inf/NaN there cannot leak into the sum.
    """
    m = mask.to(values.dtype)
    v = torch.where(mask != 0, values * m, torch.zeros_like(values))
    if mode == "token-mean":
        return v.sum() / denom.tokens
    if mode == "seq-mean-token-mean":
        return (v.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).sum() / denom.rows
    if mode == "seq-mean-token-sum":
        return v.sum() / denom.rows
    if mode == "seq-mean-token-sum-norm":
        return v.sum() / (denom.rows * (denom.width if norm is None else float(norm)))
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def reduce(values: torch.Tensor, mask: torch.Tensor, denom: Denominators, per_sample: bool) -> torch.Tensor:
    """Token mean (statistics) or per-sample mean of ``values``: ``aggregate`` without a mode name."""
    return aggregate(values, mask, denom, "seq-mean-token-mean" if per_sample else "token-mean")


def micro_batch_objective(
    log_probs: torch.Tensor, entropy: torch.Tensor, micro: TrainBatch, algo: AlgoConfig, denom: Denominators
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to backpropagate plus this micro-batch's share of every `train/*` statistic.

    Policy loss: PPO clip of the token ratio, or of GSPO's sequence ratio (``gspo``), times the
    importance weights and with rejected tokens dropped (``micro.is_weights`` / ``micro.loss_keep``,
    from mismatch.py; the denominators stay the loss mask's). Every loss term is aggregated with
    ``algo.loss_agg_mode``; statistics are token means.
    """
    mask = micro.response_mask
    mode, norm = algo.loss_agg_mode, algo.loss_norm_constant
    level = "sequence" if algo.advantage_estimator == "gspo" else "token"
    terms = policy_loss(
        log_probs,
        micro.log_probs,
        micro.advantages,
        eps_clip=algo.eps_clip,
        eps_clip_high=algo.eps_clip_high,
        eps_clip_c=algo.eps_clip_c,
        mask=mask,
        level=level,
    )
    pg_per_token = terms.loss
    if micro.is_weights is not None:
        pg_per_token = pg_per_token * micro.is_weights
    pg_mask = mask if micro.loss_keep is None else micro.loss_keep
    # Rejected tokens leave the numerator only: denominators are those of `mask` (denom), as slime's.
    pg_loss = aggregate(pg_per_token, pg_mask, denom, mode, norm)
    entropy_loss = aggregate(entropy, mask, denom, mode, norm)
    loss = pg_loss - algo.entropy_coef * entropy_loss
    stats: dict[str, torch.Tensor] = {}
    if algo.kl_loss_coef > 0:
        kl = approx_kl(log_probs, micro.ref_log_probs, algo.kl_loss_type)
        kl_loss = aggregate(kl, mask, denom, mode, norm)
        loss = loss + algo.kl_loss_coef * kl_loss
        stats["kl_loss"] = kl_loss
    # slime compares the engine with the old (pre-update) log-probs, so the figure is the engines'
    # disagreement, not the policy's own drift over the mini-batches; with use_rollout_logprobs the old
    # log-probs are the engine's, and the current ones are compared instead.
    trainer_lp = log_probs if algo.use_rollout_logprobs else micro.log_probs
    stats.update(
        loss=loss,
        pg_loss=pg_loss,
        entropy_loss=entropy_loss,
        pg_clipfrac=reduce(terms.clipped.float(), mask, denom, False),
        ppo_kl=reduce(terms.ppo_kl, mask, denom, False),
        train_rollout_logprob_abs_diff=reduce((trainer_lp - micro.rollout_log_probs).abs(), mask, denom, False),
        ratio_clampfrac=reduce(terms.ratio_clamped, mask, denom, False),
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


def minibatch_steps(
    batch: TrainBatch,
    steps_per_rollout: int,
    micro_batch_size: int,
    *,
    zero_grad,
    micro_step,
    optimizer_step,
    local_rows: Callable[[int], slice] | None = None,
    sum_stats: Callable[[dict[str, float]], dict[str, float]] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    run_micro_batches: Callable[[list[TrainBatch], Denominators], dict[str, float]] | None = None,
) -> dict[str, float]:
    """The optimizer loop every backend shares: consecutive mini-batches, one optimizer step each.

    `micro_step(micro, denom) -> stats` runs forward + objective + backward of one micro-batch;
    `optimizer_step() -> grad_norm` clips and steps, and must leave the weights alone when the norm is
    not finite. A step whose loss or grad norm is NaN/inf is skipped (`skipped` 1.0 in its row; the
    weights never see it). Returns the mean of the applied steps' statistics as `train/*`,
    `train/skipped_steps`, and the first step's ppo_kl / pg_clipfrac / grad_norm (exactly 0, 0, finite
    at step 1).
    `on_step(stats)`, if given, gets each optimizer step's own statistics (unprefixed, grad_norm included),
    for per-step tracking; the mean alone hides a loss spike or a clip storm inside one rollout.

    Data parallel (both None on one rank): `local_rows(mini_size) -> slice` picks this rank's rows of
    each mini-batch, and `sum_stats(stats) -> stats` sums the ranks' shares of the statistics. The
    denominators stay those of the whole mini-batch (every rank holds the whole batch), so the ranks'
    losses add up to the single-rank loss and their gradients must be summed, not averaged.

    `run_micro_batches(micros, denom) -> summed stats`, if given, replaces the per-micro-batch calls of
    `micro_step` with one call over all of this rank's micro-batches of the mini-batch (Megatron's
    pipeline schedule interleaves their forwards and backwards).
    """
    slices = minibatch_slices(batch.size, steps_per_rollout)
    totals: dict[str, float] = {}
    first: dict[str, float] = {}
    applied = skipped = 0
    for rows in slices:
        mini = batch.select(rows)
        if mini.size == 0:
            continue
        denom = Denominators.of(mini)
        if local_rows is not None:
            mini = mini.select(local_rows(mini.size))  # may be empty: the rank still joins the collectives
        zero_grad()
        acc: dict[str, float] = {}
        micros = [
            mini.select(slice(start, start + micro_batch_size)) for start in range(0, mini.size, micro_batch_size)
        ]
        if run_micro_batches is not None:
            acc = dict(run_micro_batches(micros, denom))
        else:
            for micro in micros:
                for key, value in micro_step(micro, denom).items():
                    acc[key] = acc.get(key, 0.0) + value
        if sum_stats is not None:
            acc = sum_stats(acc)
        # Ranks see the same summed loss and global grad norm, so they all skip or all step.
        if math.isfinite(acc.get("loss", 0.0)):
            acc["grad_norm"] = float(optimizer_step())
        else:
            zero_grad()
            acc["grad_norm"] = float("nan")
        acc["skipped"] = float(not (math.isfinite(acc.get("loss", 0.0)) and math.isfinite(acc["grad_norm"])))
        if on_step is not None:
            on_step(dict(acc))
        if not first:
            first = dict(acc)
        if acc["skipped"]:
            skipped += 1
            continue
        applied += 1
        for key, value in acc.items():
            totals[key] = totals.get(key, 0.0) + value
    out = {f"train/{k}": v / applied for k, v in totals.items() if k != "skipped"}
    out.update({f"train/step1_{k}": v for k, v in first.items() if k in ("ppo_kl", "pg_clipfrac", "grad_norm")})
    out["train/skipped_steps"] = float(skipped)
    return out
