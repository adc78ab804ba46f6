"""Per-token policy-loss kernels: PPO clip (asymmetric + dual clip) of a token-level or GSPO
sequence-level ratio, bounded exponentials, reductions and entropy (train/rollout importance weights
live in mismatch.py). Plain tensor in, tensor out; callers mask and
reduce with ``masked_mean``, the one masked mean of the package (the `rollout/*` metrics of
tasks/train/step.py and the alignment checks use it; objective.py's ``reduce`` is a micro-batch's share
of a mini-batch mean, with the mini-batch's denominators).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

LOG_RATIO_BOUND = 20.0
"""Every log-ratio is clamped to [-20, 20] before ``exp`` (as verl and slime's MIS do): e^20 ~ 4.9e8
is finite in fp16/bf16/fp32 and far beyond any clip range, so only overflow cases change."""


def bounded_exp(log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(clamp(log_ratio, -20, 20))`` and a 0/1 tensor of where the clamp was active.

    A NaN log-ratio stays NaN (clamp keeps NaN): it is a bug upstream, not an overflow."""
    clamped = (log_ratio.abs() > LOG_RATIO_BOUND).detach()
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), clamped.to(log_ratio.dtype)


def token_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``log_probs - old_log_probs``, set to 0 where ``mask`` is 0.

    Zeroing masked slots before any ``exp`` keeps padding (which may hold -inf or garbage log-probs)
    from producing inf/NaN values whose gradient, even behind a mask, is ``0 * inf = NaN``."""
    if log_probs.shape != old_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != old_log_probs shape {tuple(old_log_probs.shape)}"
        )
    diff = log_probs - old_log_probs
    if mask is None:
        return diff
    return torch.where(mask != 0, diff, torch.zeros_like(diff))


def gspo_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's per-token log-ratio (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token).

    With ``s_i = exp(mean_{t in loss tokens of i} (log_probs - old_log_probs))`` (the sequence-level,
    length-normalised importance ratio), token t of sample i gets
    ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, i.e. the log-ratio
    ``sg[log s_i] + log_probs_t - sg[log_probs_t]``: its value is ``log s_i`` on every token of the
    sample, and its gradient is that of ``log_probs_t``, so each token's gradient is scaled by the
    sequence ratio. With seq-mean-token-mean aggregation the clipped objective then equals the
    sequence-level GSPO objective ``mean_i max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps_high))`` in
    value and gradient. Rows are samples ([B, T]); a row with an empty mask gets 0.
    """
    if log_probs.dim() != 2:
        raise ValueError(f"gspo needs [B, T] log-probs (one row per sample), got shape {tuple(log_probs.shape)}")
    diff = token_log_ratio(log_probs, old_log_probs, mask)
    m = (mask != 0).to(diff.dtype)
    seq = (diff * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    return seq.detach() + log_probs - log_probs.detach()


@dataclasses.dataclass
class PolicyLossTerms:
    """Per-token tensors, all of the shape of ``log_probs``.

    ``loss``: the clipped surrogate to minimise. ``clipped``: 1.0 where the PPO clip branch was
    active (``pg2 > pg1``; for ``train/pg_clipfrac``). ``dual_clipped``: 1.0 where the dual-clip
    bound ``-A * eps_clip_c`` replaced the loss (all 0 without dual clip). ``ppo_kl``:
    ``-log_ratio`` (k1 of old vs new; the sequence value for gspo). ``ratio``: ``exp(log_ratio)``
    with the log-ratio clamped to +-20. ``ratio_clamped``: 1.0 where that clamp was active.
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    ppo_kl: torch.Tensor
    ratio: torch.Tensor
    ratio_clamped: torch.Tensor


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate of a per-token log-ratio (token-level or gspo's sequence-level).

    ``ratio = exp(clamp(log_ratio, -20, 20))``; ``pg1 = -A * ratio``;
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
    if log_ratio.shape != advantages.shape:
        raise ValueError(f"log_ratio shape {tuple(log_ratio.shape)} != advantages shape {tuple(advantages.shape)}")
    ratio, ratio_clamped = bounded_exp(log_ratio)
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
        ppo_kl=-log_ratio.detach(),
        ratio=ratio,
        ratio_clamped=ratio_clamped,
    )


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    mask: torch.Tensor | None = None,
    level: Literal["token", "sequence"] = "token",
) -> PolicyLossTerms:
    """PPO clipped surrogate, per token: ``clipped_surrogate`` of ``token_log_ratio`` (level
    ``token``, PPO/GRPO) or of ``gspo_log_ratio`` (level ``sequence``, GSPO; needs ``mask``)."""
    if not (log_probs.shape == old_log_probs.shape == advantages.shape):
        raise ValueError(
            "log_probs, old_log_probs and advantages must share a shape, got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(advantages.shape)}"
        )
    if level == "sequence":
        if mask is None:
            raise ValueError("level='sequence' (gspo) needs the loss mask: the ratio is a mean over loss tokens")
        log_ratio = gspo_log_ratio(log_probs, old_log_probs, mask)
    elif level == "token":
        log_ratio = token_log_ratio(log_probs, old_log_probs, mask)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return clipped_surrogate(
        log_ratio, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c
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
            raise ValueError(f"sample_ids shape {tuple(sample_ids.shape)} != values shape {tuple(values.shape)}")
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
