"""Advantage estimators over a rollout batch (names as slime's ``--advantage-estimator``).

Samples come in groups of ``group_size`` consecutive samples (all responses of one prompt). Every
estimator returns per-token ``(advantages, returns)`` lists, one tensor per sample with the
sample's response length. Masks choose which tokens enter statistics (group/batch mean and std);
they never zero values, so a masked-out token carries the same affine-transformed value as its
neighbours and losses mask it anyway.

- ``grpo`` / ``gspo``: ``a = (r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` without
  std-normalization), broadcast to every token; ``returns = advantages``. gspo differs from grpo
  in the loss (sequence-level ratio), not in the advantages.
- ``rloo``: ``a_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)``, broadcast.
- ``reinforce_plus_plus``: token rewards ``-kl_coef * kl_t`` plus ``r`` at the last masked token;
  ``returns_t = sum_{k >= t} gamma^(k - t) * reward_k``; ``advantages = whiten(returns)``.
- ``reinforce_plus_plus_baseline``: ``a_t = whiten((r - mean_g) - kl_coef * kl_t)``;
  ``returns = advantages``.
"""

from __future__ import annotations

import torch

from rollflow.tasks.train.returns import discounted_returns, whiten
from rollflow.tasks.train.turn_credit import turn_advantages

ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "gspo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
)

_KL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _check_groups(rewards: torch.Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})")


def _float_rewards(rewards: torch.Tensor) -> torch.Tensor:
    # Integer rewards (0/1 verifiers) would make the mean/std integer-truncated.
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def group_mean_std(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and std of ``rewards`` [N], each of shape [N // group_size].

    ``std`` is the unbiased (Bessel, ``/ (G - 1)``) standard deviation, as slime's grpo uses
    ``Tensor.std()`` with its default ``unbiased=True``; a group of one has std 0 (not NaN).
    """
    _check_groups(rewards, group_size)
    grouped = _float_rewards(rewards).reshape(-1, group_size)
    mean = grouped.mean(dim=-1)
    if group_size == 1:
        return mean, torch.zeros_like(mean)
    return mean, grouped.std(dim=-1, unbiased=True)


def _centered(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``r - mean_g`` per sample (exactly 0 for constant groups) and a per-sample constant flag."""
    grouped = _float_rewards(rewards).reshape(-1, group_size)
    mean, _ = group_mean_std(rewards, group_size)
    centered = grouped - mean[:, None]
    # A float mean of equal values can miss the value by an ulp (3 * 0.1 / 3 != 0.1); dividing that
    # residue by an equally tiny std would turn "no signal" into a spurious +-1 advantage.
    constant = (grouped == grouped[:, :1]).all(dim=-1, keepdim=True).expand_as(grouped)
    centered = torch.where(constant, torch.zeros_like(centered), centered)
    return centered.reshape(-1), constant.reshape(-1)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    response_masks: list[torch.Tensor],
    group_size: int,
    *,
    normalize_std: bool = True,
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
    whiten_eps: float = 1e-8,
    turn_units: list[list[tuple[int, int, float]]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token ``(advantages, returns)`` for ``estimator`` (see the module docstring).

    ``turn_units[i]``: sample i's scored turns (start, end, reward) in response offsets; their tokens are
    credited with the turn's reward instead of the sample's (tasks/train/turn_credit.py).

    ``rewards`` [N] are scalar rewards; ``response_masks[i]`` is sample i's 0/1 loss mask of
    length ``response_length_i``; ``kl[i]`` (same lengths) is the per-token KL used as a reward
    penalty by the reinforce_plus_plus estimators only (``kl_coef``); its masked-out tokens are
    not actions of the policy (e.g. tool output), so they get no penalty. ``normalize_std``
    applies to grpo/gspo. ``eps`` is added to the group std (grpo/gspo); ``whiten_eps`` to the batch
    variance under the square root (whitening of reinforce_plus_plus*; 1e-8 as slime and verl).
    ``gamma`` discounts reinforce_plus_plus returns over every position of the response, masked ones
    included (a masked tool-output span is ``k`` discount steps, as slime's returns are computed over
    the whole response). A reward lands on the last masked token; a sample with an empty mask
    carries no reward and, being fully masked, no loss.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    _check_groups(rewards, group_size)
    n = rewards.numel()
    if len(response_masks) != n:
        raise ValueError(f"response_masks has {len(response_masks)} entries for {n} rewards")
    if eps < 0 or whiten_eps < 0:
        raise ValueError(f"eps and whiten_eps must be >= 0, got {eps}, {whiten_eps}")
    if estimator not in _KL_ESTIMATORS:
        # KL for these estimators belongs in the loss (kl_loss_coef); refusing beats ignoring.
        if kl_coef != 0.0:
            raise ValueError(
                f"kl_coef is a reward penalty used only by {_KL_ESTIMATORS}; "
                f"estimator {estimator!r} takes KL as a loss (kl_loss_coef) instead"
            )
        if gamma != 1.0:
            raise ValueError(f"gamma is used only by reinforce_plus_plus, not {estimator!r}")
    elif estimator == "reinforce_plus_plus_baseline" and gamma != 1.0:
        raise ValueError("gamma is used only by reinforce_plus_plus, not reinforce_plus_plus_baseline")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    for i, m in enumerate(response_masks):
        if m.dim() != 1:
            raise ValueError(f"response_masks[{i}] must be 1-D [response_length], got {tuple(m.shape)}")
    if kl is not None:
        if len(kl) != n:
            raise ValueError(f"kl has {len(kl)} entries for {n} rewards")
        for i, (k, m) in enumerate(zip(kl, response_masks)):
            if k.shape != m.shape:
                raise ValueError(f"kl[{i}] shape {tuple(k.shape)} != response_masks[{i}] shape {tuple(m.shape)}")
    elif kl_coef != 0.0:
        raise ValueError(f"kl_coef={kl_coef} needs kl (per-token KL tensors), got kl=None")

    r = _float_rewards(rewards)
    dtype = r.dtype
    masks = [m.to(dtype) for m in response_masks]

    def penalty(i: int) -> torch.Tensor:
        if kl is None:
            return torch.zeros_like(masks[i])
        return kl_coef * kl[i].to(dtype) * masks[i]

    if turn_units is not None:
        return turn_advantages(
            estimator,
            r,
            masks,
            group_size,
            turn_units,
            normalize_std=normalize_std,
            penalty=[penalty(i) for i in range(n)],
            gamma=gamma,
            eps=eps,
            whiten_eps=whiten_eps,
        )

    if estimator in ("grpo", "gspo", "rloo"):
        if estimator == "rloo" and group_size == 1:
            raise ValueError("rloo needs group_size >= 2 (the baseline is the other samples' mean)")
        per_sample, constant = _centered(r, group_size)
        if estimator == "rloo":
            per_sample = per_sample * (group_size / (group_size - 1))
        elif normalize_std:
            _, std = group_mean_std(r, group_size)
            std = std.repeat_interleave(group_size)
            # Constant groups are already exactly 0; the guard keeps eps=0 from making 0/0.
            per_sample = torch.where(constant, per_sample, per_sample / (std + eps))
        advantages = [per_sample[i] * torch.ones_like(masks[i]) for i in range(n)]
        return advantages, [a.clone() for a in advantages]

    if estimator == "reinforce_plus_plus_baseline":
        per_sample, _ = _centered(r, group_size)
        raw = [per_sample[i] * torch.ones_like(masks[i]) - penalty(i) for i in range(n)]
        advantages = whiten(raw, masks, eps=whiten_eps)
        return advantages, [a.clone() for a in advantages]

    # reinforce_plus_plus
    token_rewards = []
    for i in range(n):
        tr = -penalty(i)
        masked_idx = torch.nonzero(masks[i] > 0).flatten()
        if masked_idx.numel() > 0:
            last = int(masked_idx[-1])
            tr[last] = tr[last] + r[i]
        token_rewards.append(tr)
    returns = discounted_returns(token_rewards, gamma)
    advantages = whiten(returns, masks, eps=whiten_eps)
    return advantages, returns


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over a padded batch: ``(advantages, returns)``.

    All three inputs are [B, T]; ``mask`` marks the policy's own tokens (1) against masked ones (0:
    tool output in multi-turn samples, padding). Over the masked-in tokens t of a row, with ``next(t)``
    the next masked-in token (``V`` and ``A`` past the last one are 0)::

        delta_t   = r_t + gamma * V_next(t) - V_t
        A_t       = delta_t + gamma * lambd * A_next(t)
        returns_t = A_t + V_t

    so a masked span is stepped over: it neither discounts nor adds a TD error (as verl's
    ``compute_gae_advantage_return`` skips observation tokens). Masked-out positions get 0 in both
    outputs; a fully masked row is all 0. With ``gamma = lambd = 1``, ``A_t = sum_{k >= t} r_k - V_t``
    (returns minus values). Computed in float32 at least (bf16 values are upcast); no whitening here.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must be equal [B, T] shapes"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lambd <= 1.0):
        raise ValueError(f"gamma and lambd must be in [0, 1], got gamma={gamma}, lambd={lambd}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    r, v, m = token_rewards.to(dtype), values.to(dtype), (mask > 0)
    advantages = torch.zeros_like(v)
    next_value = v.new_zeros(v.shape[0])
    next_adv = v.new_zeros(v.shape[0])
    # One step per position, vectorised over rows; a masked position leaves the carried state untouched.
    for t in range(v.shape[1] - 1, -1, -1):
        on = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lambd * next_adv
        next_adv = torch.where(on, adv, next_adv)
        next_value = torch.where(on, v[:, t], next_value)
        advantages[:, t] = torch.where(on, adv, torch.zeros_like(adv))
    returns = torch.where(m, advantages + v, torch.zeros_like(v))
    return advantages, returns


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scalar rewards placed on each row's last masked-in token of ``mask`` [B, T] (0 elsewhere; a fully
    masked row gets none), the token-level rewards GAE takes for outcome rewards."""
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards [B] and mask [B, T] expected, got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    on = mask > 0
    out = torch.zeros(mask.shape, dtype=_float_rewards(rewards).dtype)
    has_any = on.any(dim=1)
    # index of the last True per row: argmax over a position-weighted mask
    positions = torch.arange(1, mask.shape[1] + 1).expand_as(on)
    last = torch.where(on, positions, torch.zeros_like(positions)).argmax(dim=1)
    rows = torch.nonzero(has_any).flatten()
    out[rows, last[rows]] = _float_rewards(rewards)[rows].to(out.dtype)
    return out


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lambd: float, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """ppo's estimator on a dense [B, T] layout: outcome rewards on the last masked-in token, `gae`, then the
    advantages whitened over all masked-in tokens (``(A - mean) / sqrt(var + eps)``, unbiased var, eps 1e-8
    inside the square root as slime and verl). ``returns`` (the critic's targets) are not whitened."""
    token_rewards = last_token_rewards(rewards, mask)
    advantages, returns = gae(token_rewards, values, mask, gamma=gamma, lambd=lambd)
    on = mask > 0
    flat_on = on.reshape(-1).to(advantages.dtype)
    whitened = whiten([advantages.reshape(-1)], [flat_on], eps=eps)[0].reshape(advantages.shape)
    return torch.where(on, whitened, torch.zeros_like(whitened)), returns
