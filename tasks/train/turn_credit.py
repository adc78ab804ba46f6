"""Turn-level credit: per-turn rewards (conversation feedback) credited to that turn's tokens.

A multi-turn sample records its turns in `metadata["turns"]` (tasks/rollout/conversation.py): response
offsets `start`/`end` (end exclusive) and, once a feedback reward scored it, a `reward`. A scored turn is
one credit unit: its loss tokens carry its reward. Loss tokens outside every scored turn form one more
unit carrying the sample's scalar reward. The estimators then work on units instead of samples:

- grpo / gspo: a token's advantage is (its unit's reward - mean of the group's units) / (their std + eps);
- reinforce_plus_plus_baseline: unit reward - group mean of units, minus the KL penalty, whitened;
- reinforce_plus_plus: each unit's reward lands on its last loss token, then discounted returns over the
  span (a later turn's reward also reaches earlier turns, discounted by gamma) and whitening.
rloo and ppo take sample-level rewards only (refused with turn rewards).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from rollflow.tasks.train.returns import discounted_returns, whiten

Unit = tuple[int, int, float]  # start, end (exclusive, response offsets), reward
TURN_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def units_from_metadata(metadata: dict[str, Any]) -> list[Unit]:
    return [
        (int(t["start"]), int(t["end"]), float(t["reward"]))
        for t in metadata.get("turns") or []
        if isinstance(t, dict) and t.get("reward") is not None
    ]


def turn_units(samples: Any) -> list[list[Unit]] | None:
    """Per sample, its scored turns; None when no sample of the rollout has a turn reward (the usual case).

    `samples`: a list of Samples or an artifact's SampleColumns (metadata parsed only for rows with turns)."""
    if isinstance(samples, Sequence) and not hasattr(samples, "table"):
        units = [units_from_metadata(s.metadata or {}) for s in samples]
    else:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        column = samples.table.column("metadata")
        rows = np.flatnonzero(pc.match_substring(column, '"reward"').to_numpy(zero_copy_only=False))
        units = [[] for _ in range(len(samples))]
        for row, text in zip(rows, column.take(pa.array(rows, pa.int64())).to_pylist()):
            units[int(row)] = units_from_metadata(json.loads(text))
    return units if any(units) else None


def _token_rewards(
    reward: float, mask: torch.Tensor, units: list[Unit]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, float]]]:
    """The per-token reward of one sample and its credit units as (loss-token indices, reward)."""
    tokens = torch.full_like(mask, reward)
    covered = torch.zeros(mask.shape, dtype=torch.bool)
    out = []
    for start, end, value in units:
        tokens[start:end] = value
        covered[start:end] = True
        idx = torch.nonzero(mask[start:end] > 0).flatten() + start
        if idx.numel():
            out.append((idx, value))
    rest = torch.nonzero((mask > 0) & ~covered).flatten()
    if rest.numel():
        out.append((rest, reward))
    return tokens, out


def turn_advantages(
    estimator: str,
    rewards: torch.Tensor,
    masks: list[torch.Tensor],
    group_size: int,
    units: list[list[Unit]],
    *,
    normalize_std: bool,
    penalty: list[torch.Tensor],
    gamma: float,
    eps: float,
    whiten_eps: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`compute_advantages` with turn rewards (masks in the rewards' dtype; `penalty` the per-token KL penalty)."""
    if estimator not in TURN_ESTIMATORS:
        raise ValueError(
            f"turn-level rewards (metadata turns with 'reward') work with {TURN_ESTIMATORS}, not "
            f"algo.advantage_estimator={estimator!r}; pick one of those"
        )
    if len(units) != len(masks):
        raise ValueError(f"turn units for {len(units)} samples, {len(masks)} masks")
    per_sample = [_token_rewards(float(rewards[i]), masks[i], units[i]) for i in range(len(masks))]
    if estimator == "reinforce_plus_plus":
        token_rewards = []
        for i, (_, credit) in enumerate(per_sample):
            tr = -penalty[i]
            for idx, value in credit:
                tr[int(idx[-1])] += value
            token_rewards.append(tr)
        returns = discounted_returns(token_rewards, gamma)
        return whiten(returns, masks, eps=whiten_eps), returns
    advantages = []
    for g in range(0, len(masks), group_size):
        values = torch.tensor(
            [v for _, credit in per_sample[g : g + group_size] for _, v in credit], dtype=rewards.dtype
        )
        constant = values.numel() == 0 or bool((values == values[0]).all())
        mean = values[0] if constant else values.mean()
        std = values.std(unbiased=True) if values.numel() > 1 else values.new_zeros(())
        for i in range(g, g + group_size):
            tokens, _ = per_sample[i]
            adv = (tokens - mean) if not constant else torch.zeros_like(tokens)
            if estimator in ("grpo", "gspo") and normalize_std and not constant:
                adv = adv / (std + eps)
            advantages.append(adv * (masks[i] > 0) if estimator != "reinforce_plus_plus_baseline" else adv - penalty[i])
    if estimator == "reinforce_plus_plus_baseline":
        advantages = whiten(advantages, masks, eps=whiten_eps)
    return advantages, [a.clone() for a in advantages]
