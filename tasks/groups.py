"""Prompt groups whose samples are all identical.

GRPO (and RLOO, GSPO) compare the samples of one prompt with each other: a group of n identical
samples has one reward, so every advantage in it is 0 and it teaches nothing. A few such groups are a
confident policy; all of them at once is the deterministic-sampling trap (every sample of a group
sampled with the same seed). Used by the rollout side (a warning) and the train side
(`rollout/identical_groups`), hence here, below both.
"""

from __future__ import annotations

from typing import Sequence


def identical_groups(sequences: Sequence[Sequence[int]], group_size: int) -> list[int]:
    """Indices of the groups (consecutive runs of `group_size` sequences) whose sequences are all equal.

    Groups of one sample never count (nothing to compare)."""
    if group_size <= 1:
        return []
    out = []
    for g, start in enumerate(range(0, len(sequences) - group_size + 1, group_size)):
        first = list(sequences[start])
        if all(list(seq) == first for seq in sequences[start + 1 : start + group_size]):
            out.append(g)
    return out


def identical_group_fraction(sequences: Sequence[Sequence[int]], group_size: int) -> float:
    """Share of groups whose samples are all identical (0.0 without groups of 2 or more)."""
    n_groups = len(sequences) // group_size if group_size > 1 else 0
    return len(identical_groups(sequences, group_size)) / n_groups if n_groups else 0.0


def identical_groups_warning(n_identical: int, n_groups: int, group_size: int) -> str:
    """One line for the log: how many groups are all-identical and what it likely means."""
    # The rollout side does not know the estimator: say which ones get nothing from these groups (a critic, ppo,
    # still learns from them), instead of calling every run's advantages GRPO's.
    line = (
        f"{n_identical} of {n_groups} prompt groups have {group_size} identical samples: group-relative "
        "estimators (grpo, gspo, rloo, reinforce_plus_plus_baseline) give them advantage 0"
    )
    if n_identical == n_groups:
        line += (
            " (every group: sampling is deterministic per prompt; give each sample of a group its own "
            "seed, e.g. rollout.sglang.n_mode='repeat', or raise rollout.temperature above 0)"
        )
    return line
