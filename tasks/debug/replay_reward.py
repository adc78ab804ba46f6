"""Rerun a reward function over stored samples and diff the rewards (slime's `replay_reward_fn`).

Use it after changing a reward function: which samples would now score differently, and by how
much? The loaded samples are never modified: copies are scored.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.rewards import RewardFn, resolve_reward_fn, score_samples


@dataclasses.dataclass
class ReplayRewardReport:
    n_samples: int
    old: list[float | None]  # stored scalar reward per sample (None: not scored)
    new: list[float]  # scalar reward of the replayed function
    changed: list[int]  # positions (in the given order) whose reward changed
    mean_old: float | None  # over samples that had a reward
    mean_new: float | None
    max_abs_diff: float | None  # over samples scored both times
    rescored: list[Sample] = dataclasses.field(repr=False, default_factory=list)  # the scored copies

    @property
    def n_changed(self) -> int:
        return len(self.changed)

    def to_dict(self, *, with_rewards: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "n_samples": self.n_samples,
            "n_changed": self.n_changed,
            "changed": list(self.changed),
            "mean_old": self.mean_old,
            "mean_new": self.mean_new,
            "max_abs_diff": self.max_abs_diff,
        }
        if with_rewards:
            out["old"] = list(self.old)
            out["new"] = list(self.new)
        return out


def _old_reward(sample: Sample, reward_key: str | None) -> float | None:
    if sample.reward is None:
        return None
    if isinstance(sample.reward, dict):
        key = reward_key or sample.reward_key  # the run's key wins (slime's --reward-key)
        if key is None or key not in sample.reward:
            return None
        return float(sample.reward[key])
    return float(sample.reward)


def replay_reward(
    samples: Sequence[Sample], fn: RewardFn | str, reward_key: str | None = None, *, atol: float = 0.0
) -> ReplayRewardReport:
    """Score copies of `samples` with `fn` (a callable, sync or async, or a spec for
    `resolve_reward_fn`) and compare with the stored rewards.

    A dict-returning function needs `reward_key`; when omitted, the samples' own reward_key is used.
    A sample counts as changed when it was unscored before, or |new - old| > atol.
    """
    if isinstance(fn, str):
        fn = resolve_reward_fn(fn)
    originals = list(samples)
    if reward_key is None:
        reward_key = next((s.reward_key for s in originals if s.reward_key), None)
    copies = [copy.deepcopy(s) for s in originals]
    score_samples(copies, fn, reward_key=reward_key)

    old = [_old_reward(s, reward_key) for s in originals]
    new = [c.scalar_reward(reward_key) for c in copies]
    changed, diffs = [], []
    for position, (a, b) in enumerate(zip(old, new)):
        if a is None:
            changed.append(position)
            continue
        diff = abs(b - a)
        if math.isnan(diff):
            diff = 0.0 if (math.isnan(a) and math.isnan(b)) else math.inf
        diffs.append(diff)
        if diff > atol:
            changed.append(position)
    scored_old = [a for a in old if a is not None]
    return ReplayRewardReport(
        n_samples=len(originals),
        old=old,
        new=new,
        changed=changed,
        mean_old=sum(scored_old) / len(scored_old) if scored_old else None,
        mean_new=sum(new) / len(new) if new else None,
        max_abs_diff=max(diffs) if diffs else None,
        rescored=copies,
    )
