"""Per-token returns and batch whitening: the pieces the advantage estimators share (advantages.py, and the
turn-level credit of turn_credit.py)."""

from __future__ import annotations

import torch


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor], *, eps: float = 1e-8) -> list[torch.Tensor]:
    """Batch whitening: ``(v - mean) / sqrt(var + eps)`` with mean/var over all masked tokens.

    ``var`` is unbiased (``/ (n - 1)``), as slime's masked whitening applies the Bessel
    correction. Every position, masked or not, gets the same affine transform. With fewer than
    two masked tokens, or all masked values equal, there is no spread to measure, so values are
    only centered (not scaled by ``1 / sqrt(eps)``, which would blow up unmasked positions).
    """
    if len(values) != len(masks):
        raise ValueError(f"values ({len(values)}) and masks ({len(masks)}) differ in length")
    if not values:
        return []
    for i, (v, m) in enumerate(zip(values, masks)):
        if v.shape != m.shape:
            raise ValueError(f"values[{i}] shape {tuple(v.shape)} != masks[{i}] shape {tuple(m.shape)}")
    flat_v = torch.cat([v.reshape(-1) for v in values])
    flat_m = torch.cat([m.reshape(-1) for m in masks]).to(flat_v.dtype)
    count = flat_m.sum()
    mean = (flat_v * flat_m).sum() / count.clamp(min=1)
    sq = ((flat_v - mean).square() * flat_m).sum()
    if count < 2 or sq == 0:
        return [v - mean for v in values]
    scale = torch.rsqrt(sq / (count - 1) + eps)
    return [(v - mean) * scale for v in values]


def discounted_returns(token_rewards: list[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """``R_t = reward_t + gamma * R_{t+1}`` per sample, ``R`` past the end is 0."""
    if not token_rewards:
        return []
    lengths = [t.numel() for t in token_rewards]
    # Right-padding with zeros is exact: padding only follows a sample's tokens and adds 0.
    padded = torch.nn.utils.rnn.pad_sequence(token_rewards, batch_first=True)
    if gamma == 1.0:
        out = padded.flip(-1).cumsum(-1).flip(-1)
    else:
        # One step per position, vectorised over samples (gamma^-t rescaling would underflow).
        out = torch.empty_like(padded)
        running = padded.new_zeros(padded.shape[0])
        for t in range(padded.shape[1] - 1, -1, -1):
            running = padded[:, t] + gamma * running
            out[:, t] = running
    return [out[i, :length] for i, length in enumerate(lengths)]
