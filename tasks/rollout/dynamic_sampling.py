"""Dynamic sampling (DAPO; slime's --dynamic-sampling-filter-path + over-sampling): keep prompt groups that
pass a filter, generate more prompts until the batch has its number of groups, keep the rest marked.

A group filter is a plain function `(group: list[Sample]) -> bool` (rewards already set), named by a
'module:function' path. Over-sampled prompts come from their own deterministic stream per
(rollout id, attempt), so a rerun of the same rollout draws the same prompts and seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from rollflow.artifacts.pipeline_meta import mark_filtered
from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.addition import addition_prompts
from rollflow.tasks.rollout.dataset import train_items
from rollflow.tasks.rollout.dotted import load_callable
from rollflow.tasks.rollout.prompts import PromptItem

GroupFilter = Callable[[list[Sample]], bool]
# Over-sampled addition prompts: seeds far from the train rollouts' (data.seed + rollout_id) and eval's.
OVERSAMPLE_SEED_OFFSET = 500_000_000
ATTEMPT_STRIDE = 1_000


def reward_not_constant(group: list[Sample]) -> bool:
    """DAPO's default: a group whose rewards are all equal has zero advantages; drop it."""
    rewards = [s.scalar_reward() for s in group]
    return max(rewards) > min(rewards)


def load_filter(path: str) -> GroupFilter:
    return load_callable("pipeline.dynamic_sampling.filter_path", path)


def oversample_prompts(data, rollout_id: int, attempt: int) -> list[PromptItem]:
    """Prompts of over-sampling attempt `attempt` (>= 1) of rollout `rollout_id`: data.prompts_per_rollout more.

    addition: a seed stream of its own. dataset: records from the epochs after the run's horizon, so
    they are not the next rollouts' prompts (the data cursor of train rollouts is unchanged)."""
    if attempt < 1:
        raise ValueError("attempt 0 is the rollout's own prompts (prompts_for)")
    if getattr(data, "task", "addition") == "dataset":
        return train_items(data, OVERSAMPLE_SEED_OFFSET + rollout_id * ATTEMPT_STRIDE + attempt)
    return addition_prompts(
        data.prompts_per_rollout,
        seed=data.seed + OVERSAMPLE_SEED_OFFSET + rollout_id * ATTEMPT_STRIDE + attempt,
        digits=data.digits,
    )


def split_groups(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    """Consecutive runs of one group_index (a generate call's order); every group has `group_size` samples."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    bad = [len(g) for g in groups if len(g) != group_size]
    if bad:
        raise ValueError(f"prompt groups of sizes {sorted(set(bad))}, expected n_samples_per_prompt={group_size}")
    return groups


@dataclasses.dataclass(frozen=True)
class GroupSelection:
    """Every group generated for one rollout, in generation order, the ones not trained marked `filtered`."""

    groups: list[list[Sample]]
    passed: int  # groups that passed the filter (trained ones first, then surplus)
    short: int  # groups missing from the batch after the last try (0 when full)

    def samples(self) -> list[Sample]:
        """Flat, with group_index and index renumbered (unique across attempts)."""
        out: list[Sample] = []
        for g, group in enumerate(self.groups):
            for s in group:
                out.append(dataclasses.replace(s, group_index=g, index=len(out)))
        return out


def select_groups(
    groups: list[list[Sample]], keep: list[bool], target: int, already_marked: list[bool] | None = None
) -> GroupSelection:
    """Train the first `target` groups that passed; mark the others `filter` / `surplus`. When fewer than
    `target` passed, the first failing groups are trained too (their advantages are zero under GRPO), so
    every trained batch has `target` groups; `short` says how many were missing.

    `already_marked`: groups that carry a reason of their own (partial rollouts) and are neither counted
    nor re-marked."""
    marked = already_marked or [False] * len(groups)
    eligible = [i for i in range(len(groups)) if not marked[i]]
    passing = [i for i in eligible if keep[i]]
    failing = [i for i in eligible if not keep[i]]
    trained = set(passing[:target])
    short = max(0, target - len(trained))
    trained |= set(failing[:short])
    out = []
    for i, group in enumerate(groups):
        if marked[i] or i in trained:
            out.append(group)
        else:
            out.append(mark_filtered(group, "filter" if not keep[i] else "surplus"))
    return GroupSelection(groups=out, passed=len(passing), short=short)
