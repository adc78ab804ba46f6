"""Per-token policy-loss kernels: PPO clip (asymmetric + dual clip), reductions, entropy, and
train/rollout importance correction (TIS / icepop). Plain tensor in, tensor out; callers mask and
reduce with ``masked_mean``, the one masked mean of the package (the `rollout/*` metrics of
tasks/train/step.py and the alignment checks use it; objective.py's ``reduce`` is a micro-batch's share
of a mini-batch mean, with the mini-batch's denominators).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch


@dataclasses.dataclass
class PolicyLossTerms:
    """Per-token tensors, all of the shape of ``log_probs``.

    ``loss``: the clipped surrogate to minimise. ``clipped``: 1.0 where the PPO clip branch was
    active (``pg2 > pg1``; for ``train/pg_clipfrac``). ``dual_clipped``: 1.0 where the dual-clip
    bound ``-A * eps_clip_c`` replaced the loss (all 0 without dual clip). ``ppo_kl``:
    ``old_log_probs - log_probs`` (k1 of old vs new). ``ratio``: ``exp(log_probs - old_log_probs)``.
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    ppo_kl: torch.Tensor
    ratio: torch.Tensor


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate, per token.

    ``ratio = exp(log_probs - old_log_probs)``; ``pg1 = -A * ratio``;
    ``pg2 = -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)`` (``eps_clip_high`` defaults to
    ``eps_clip``); ``loss = max(pg1, pg2)``. Dual clip (``eps_clip_c > 1``): where ``A < 0``,
    ``loss = min(loss, -A * eps_clip_c)``, which bounds the loss (and zeroes the gradient) of
    negative-advantage tokens whose ratio has run above ``eps_clip_c``.
    """
    if eps_clip < 0:
        raise ValueError(f"eps_clip must be >= 0, got {eps_clip}")
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if high < 0:
        raise ValueError(f"eps_clip_high must be >= 0, got {eps_clip_high}")
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c must be > 1 (a lower bound of 1 + ... on the ratio), got {eps_clip_c}")
    if not (log_probs.shape == old_log_probs.shape == advantages.shape):
        raise ValueError(
            "log_probs, old_log_probs and advantages must share a shape, got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(advantages.shape)}"
        )
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(loss.dtype)
    if eps_clip_c is None:
        dual_clipped = torch.zeros_like(loss)
    else:
        pg3 = -advantages * eps_clip_c
        dual_active = (advantages < 0) & (pg3 < loss)
        loss = torch.where(dual_active, pg3, loss)
        dual_clipped = dual_active.to(loss.dtype)
    return PolicyLossTerms(
        loss=loss,
        clipped=clipped.detach(),
        dual_clipped=dual_clipped.detach(),
        ppo_kl=old_log_probs - log_probs,
        ratio=ratio,
    )


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    per_sample: bool = False,
    sample_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar mean of ``values`` over ``mask``.

    Per token (default): ``sum(v * m) / sum(m)``. Per sample (``per_sample=True``): each sample's
    ``sum(v * m) / sum(m)``, then the plain mean over samples whose mask is non-empty; a sample is
    a row of 2-D ``values`` [B, T], or, for packed 1-D batches, the tokens sharing a
    ``sample_ids`` value. An empty mask gives 0, not NaN.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    if sample_ids is not None and not per_sample:
        raise ValueError("sample_ids is only used with per_sample=True")
    mask = mask.to(values.dtype)
    # Masked-out slots (padding) may hold inf/NaN log-probs; v * 0 would still be NaN.
    weighted = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    if not per_sample:
        return weighted.sum() / mask.sum().clamp(min=1)
    if sample_ids is not None:
        if sample_ids.shape != values.shape:
            raise ValueError(
                f"sample_ids shape {tuple(sample_ids.shape)} != values shape {tuple(values.shape)}"
            )
        _, inverse = torch.unique(sample_ids.reshape(-1), return_inverse=True)
        n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
        sums = weighted.new_zeros(n_groups).index_add(0, inverse, weighted.reshape(-1))
        counts = mask.new_zeros(n_groups).index_add(0, inverse, mask.reshape(-1))
    else:
        if values.dim() != 2:
            raise ValueError(
                f"per_sample=True needs values shaped [B, T] or sample_ids, got shape {tuple(values.shape)}"
            )
        sums = weighted.sum(dim=-1)
        counts = mask.sum(dim=-1)
    present = counts != 0
    per = sums[present] / counts[present]
    if per.numel() == 0:
        return weighted.sum() * 0  # keeps the graph and dtype
    return per.mean()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``H = -sum_v p_v * log p_v``.

    Computed from ``log_softmax`` (no overflow for large logits); ``0 * log 0`` is taken as 0, so
    ``-inf`` logits (masked vocab, one-hot) give exact zeros and finite gradients.
    """
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    # Replace -inf before the product: where() alone still back-propagates 0 * -inf = NaN.
    safe_log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))
    return -(p * safe_log_p).sum(dim=-1)


def importance_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: Literal["tis", "icepop"],
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights correcting for the rollout engine's (off-)policy, and where they clipped.

    ``ratio = exp(old_log_probs - rollout_log_probs)`` (trainer vs engine probability of the same
    token). ``tis``: ``w = clamp(ratio, low, high)`` (truncated importance sampling). ``icepop``:
    ``w = ratio`` if ``low <= ratio <= high`` else 0 (tokens with a train/rollout mismatch are
    dropped). ``clipped_mask`` = ``mask`` and ratio outside ``[low, high]`` (for
    ``train/tis_clipfrac``). Weights are detached: they rescale the gradient, they are not
    optimised.
    """
    if mode not in ("tis", "icepop"):
        raise ValueError(f"mode must be 'tis' or 'icepop', got {mode!r}")
    if not 0.0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    if not (old_log_probs.shape == rollout_log_probs.shape == mask.shape):
        raise ValueError(
            "old_log_probs, rollout_log_probs and mask must share a shape, got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(mask.shape)}"
        )
    ratio = torch.exp(old_log_probs.detach() - rollout_log_probs.detach())
    outside = (ratio < low) | (ratio > high)
    if mode == "tis":
        weights = ratio.clamp(low, high)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    clipped_mask = (outside & (mask != 0)).to(ratio.dtype)
    return weights, clipped_mask
