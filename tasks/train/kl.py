"""Per-token KL estimators between the policy and a reference policy (names as slime's).

With ``log_ratio = log_probs - ref_log_probs`` (log pi(x) - log pi_ref(x), x sampled from pi):

- ``k1``: ``log_ratio``                                  (unbiased, high variance, can be < 0)
- ``k2``: ``0.5 * log_ratio**2``                         (biased, >= 0)
- ``k3``: ``exp(-log_ratio) - 1 + log_ratio``            (unbiased, >= 0; Schulman's k3), with
  ``log_ratio`` clamped to [-20, 20] first so ``exp`` cannot overflow (e^94 is inf in fp32)
- ``low_var_kl``: ``k3`` clamped to ``[-10, 10]``         (bounded, for ``kl_loss_type``)
"""

from __future__ import annotations

import torch

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")

LOW_VAR_KL_BOUND = 10.0
# k3 is monotone on each side of 0 and already exceeds LOW_VAR_KL_BOUND at |log_ratio| = 20
# (k3(-20) = e^20 - 21, k3(20) ~ 19), so clamping log_ratio cannot change a low_var_kl result;
# for k3 it changes only values past e^20 and keeps exp() (and its gradient) finite.
_LOG_RATIO_BOUND = 20.0


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate, same shape as the inputs.

    ``log_ratio = log_probs - ref_log_probs``; ``k1 = log_ratio``; ``k2 = log_ratio**2 / 2``;
    ``k3 = exp(-log_ratio) - 1 + log_ratio``; ``low_var_kl = clamp(k3, -10, 10)``; both computed with
    ``log_ratio`` clamped to ``[-20, 20]`` first (no low_var_kl value changes; k3 saturates at
    e^20 - 21 instead of overflowing to inf, whose gradient makes the loss NaN).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    if kind == "low_var_kl":
        return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    return k3
