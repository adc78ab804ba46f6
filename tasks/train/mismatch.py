"""Train/rollout mismatch: its metrics, and the importance weights and rejections that correct for it.

The rollout engine samples from pi_rollout; the trainer's old policy pi_old scores the same tokens
(same weights, other kernels). With ``r = old_log_probs - rollout_log_probs`` per loss token:

- importance weights (``use_tis``) at three levels, as slime's MIS helper: ``token`` ``w_t = e^{r_t}``;
  ``sequence`` ``w = e^{sum_t r_t}`` (unbiased, high variance); ``geometric`` ``w = e^{mean_t r_t}``
  (biased, low variance); then ``truncate`` ``min(w, upper)``, ``clip`` ``clamp(w, lower, upper)`` or
  ``mask`` (``w`` kept, tokens with ``w`` outside ``[lower, upper]`` rejected: icepop at token level);
  optionally normalised to mean 1 over the rollout (``tis_batch_normalize``);
- rejection (``use_rs``): tokens (or whole samples, for sequence/geometric) whose ratio is outside
  ``[rs_lower, rs_upper]`` are rejected; veto (``rs_veto_threshold``): a sample with any token
  ``e^{r_t} < threshold`` is rejected whole.

Rejected tokens leave the loss numerator only; the loss denominators stay those of the original mask
(as slime's), so rejecting tokens does not inflate the others' weight. Every ``exp`` takes a log-ratio
clamped to +-20. Weights are detached: they rescale gradients, they are not optimised.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rollflow.tasks.train.losses import LOG_RATIO_BOUND, bounded_exp
from rollflow.tasks.train.settings import AlgoConfig


@dataclasses.dataclass
class Correction:
    """``weights`` [B, T]: importance weights (1 without IS, 0 on masked slots); ``keep`` [B, T]: the
    loss mask with rejected tokens set to 0; ``metrics``: ``mismatch/*`` fractions and weight stats."""

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]


def _rows_present(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=1) > 0


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask != 0, values * mask, torch.zeros_like(values)).sum(dim=1)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _row_sum(values, mask) / mask.sum(dim=1).clamp(min=1)


def _sample_mean(per_row: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over samples with at least one loss token (0 when none)."""
    present = _rows_present(mask)
    return float(per_row[present].mean()) if bool(present.any()) else 0.0


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask != 0
    return float(values[m].double().mean()) if bool(m.any()) else 0.0


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T] log-ratio at ``level``: ``token`` as is; ``sequence`` the row's masked sum, ``geometric``
    the row's masked mean, broadcast to every token of the row."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return _row_sum(log_ratio, mask)[:, None].expand_as(log_ratio)
    if level == "geometric":
        return _row_mean(log_ratio, mask)[:, None].expand_as(log_ratio)
    raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")


def effective_sample_size(weights: torch.Tensor) -> float:
    """Normalised ESS of a set of weights: ``(sum w)^2 / (n * sum w^2)``, in (0, 1]; 1 = all equal."""
    if weights.numel() == 0:
        return 1.0
    w = weights.double()
    denom = w.numel() * w.square().sum()
    return float(w.sum().square() / denom) if float(denom) > 0 else 0.0


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """``mismatch/*``: how far the trainer's old policy is from the engine on the sampled tokens.

    Per sample, then averaged over samples (slime's sum-of-sample-mean; names as slime's
    ``mismatch_*`` / MIS metrics): ``training_log_ppl = -mean_t old``, ``rollout_log_ppl =
    -mean_t rollout``, ``log_ppl_diff = training_log_ppl - rollout_log_ppl`` (and its abs),
    ``ppl_ratio = e^{log_ppl_diff}``, ``kl = mean_t (rollout - old)`` (k1 of KL(rollout || train)),
    ``k3_kl = mean_t (e^r - r - 1)``, ``chi2_token = mean_t e^{2r} - 1``, ``chi2_seq = e^{2 sum_t r} - 1``,
    ``tis = mean_t e^r`` (the raw, unbounded mean ratio; slime's ``tis``), with ``r = old - rollout``
    clamped to +-20 inside each exp. Over all loss tokens: ``ess_token`` (normalised ESS of ``e^r``),
    ``ess_seq`` (of the sequence ratios), ``max_abs_log_ratio``, ``log_ratio_clampfrac``.
    """
    if not (old_log_probs.shape == rollout_log_probs.shape == mask.shape):
        raise ValueError(
            "old_log_probs, rollout_log_probs and mask must share a shape, got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(mask.shape)}"
        )
    # float64: these are figures of tiny gaps (1e-7 per token between fp32 engines), which fp32 round-off in
    # e^r - r - 1 would turn negative.
    dtype = torch.float64
    old, rollout, mask = old_log_probs.detach().to(dtype), rollout_log_probs.detach().to(dtype), mask.to(dtype)
    r = torch.where(mask != 0, old - rollout, torch.zeros_like(old))
    ratio, clamped = bounded_exp(r)
    train_lp, rollout_lp = _row_mean(old, mask), _row_mean(rollout, mask)
    log_ppl_diff = rollout_lp - train_lp  # = training_log_ppl - rollout_log_ppl
    seq_r = _row_sum(r, mask)
    seq_ratio, _ = bounded_exp(seq_r)
    present = _rows_present(mask)
    on = mask != 0
    out = {
        "training_log_ppl": _sample_mean(-train_lp, mask),
        "rollout_log_ppl": _sample_mean(-rollout_lp, mask),
        "training_ppl": _sample_mean(bounded_exp(-train_lp)[0], mask),
        "rollout_ppl": _sample_mean(bounded_exp(-rollout_lp)[0], mask),
        "log_ppl_diff": _sample_mean(log_ppl_diff, mask),
        "log_ppl_abs_diff": _sample_mean(log_ppl_diff.abs(), mask),
        "ppl_ratio": _sample_mean(bounded_exp(log_ppl_diff)[0], mask),
        "kl": _sample_mean(_row_mean(-r, mask), mask),
        # expm1(r) - r: the same e^r - r - 1 without cancelling a 1 first
        "k3_kl": _sample_mean(
            _row_mean(
                torch.expm1(r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) - r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND),
                mask,
            ),
            mask,
        ),
        "chi2_token": _sample_mean(_row_mean(ratio.square(), mask) - 1, mask),
        "chi2_seq": _sample_mean(bounded_exp(2 * seq_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))[0] - 1, mask),
        "tis": _sample_mean(_row_mean(ratio, mask), mask),
        "ess_token": effective_sample_size(ratio[on]),
        "ess_seq": effective_sample_size(seq_ratio[present]),
        "max_abs_log_ratio": float(r[on].abs().max()) if bool(on.any()) else 0.0,
        "log_ratio_clampfrac": _token_mean(clamped, mask),
    }
    return {f"mismatch/{k}": v for k, v in out.items()}


def correction(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, algo: AlgoConfig
) -> Correction:
    """Importance weights and rejections for one rollout batch (see the module docstring).

    ``mismatch/*`` metrics out: ``tis_clipfrac`` (tokens whose weight truncate/clip changed),
    ``tis_maskfrac`` (rejected by tis_mode=mask), ``rs_maskfrac`` (rejected by RS), ``veto_seqfrac``
    (samples vetoed), ``rejected_frac`` (all rejections together), ``is_weight_mean`` /
    ``is_weight_min`` / ``is_weight_max`` (final weights on kept tokens), ``batch_norm_factor``.
    Fractions are over the loss tokens (samples for ``veto_seqfrac``) before any rejection.
    """
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    mask = mask.to(dtype)
    on = mask != 0
    r = torch.where(on, old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype), torch.zeros_like(mask))
    weights = torch.ones_like(mask)
    keep = mask.clone()
    metrics: dict[str, float] = {}
    if algo.use_tis:
        low, high = algo.tis_bounds
        raw, _ = bounded_exp(level_log_ratio(r, mask, algo.tis_level))
        if algo.tis_mode == "truncate":
            weights = raw.clamp(max=high)
            metrics["tis_clipfrac"] = _token_mean((raw > high).float(), mask)
        elif algo.tis_mode == "clip":
            weights = raw.clamp(low, high)
            metrics["tis_clipfrac"] = _token_mean(((raw < low) | (raw > high)).float(), mask)
        else:  # mask
            outside = (raw < low) | (raw > high)
            weights = raw
            keep = keep * (~outside).float()
            metrics["tis_maskfrac"] = _token_mean(outside.float(), mask)
        if algo.tis_batch_normalize:
            if algo.tis_level == "token":
                mean = weights[on].mean() if bool(on.any()) else weights.new_tensor(1.0)
            else:  # one weight per sample
                present = _rows_present(mask)
                mean = _row_mean(weights, mask)[present].mean() if bool(present.any()) else weights.new_tensor(1.0)
            factor = float(mean) if float(mean) > 1e-8 else 1.0
            weights = weights / factor
            metrics["batch_norm_factor"] = factor
    if algo.use_rs:
        low, high = algo.rs_bounds
        raw, _ = bounded_exp(level_log_ratio(r, mask, algo.rs_level))
        outside = ((raw < low) | (raw > high)) & on
        metrics["rs_maskfrac"] = _token_mean(outside.float(), mask)
        keep = keep * (~outside).float()
    if algo.rs_veto_threshold is not None:
        vetoed = ((r < math.log(algo.rs_veto_threshold)) & on).any(dim=1)
        present = _rows_present(mask)
        metrics["veto_seqfrac"] = float(vetoed[present].float().mean()) if bool(present.any()) else 0.0
        keep = keep * (~vetoed).float()[:, None]
    weights = torch.where(on, weights, torch.zeros_like(weights))
    kept = keep != 0
    metrics["rejected_frac"] = _token_mean((~kept).float(), mask)
    if bool(kept.any()):
        metrics.update(
            is_weight_mean=float(weights[kept].mean()),
            is_weight_min=float(weights[kept].min()),
            is_weight_max=float(weights[kept].max()),
        )
    return Correction(
        weights=weights.detach(), keep=keep.detach(), metrics={f"mismatch/{k}": v for k, v in metrics.items()}
    )


def corrects(algo: AlgoConfig) -> bool:
    """Whether ``algo`` changes the loss with weights or rejections (else metrics only)."""
    return algo.use_tis or algo.use_rs or algo.rs_veto_threshold is not None
