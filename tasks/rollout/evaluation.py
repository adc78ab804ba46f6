"""Eval metrics of an eval rollout: mean reward ("accuracy") and unbiased pass@k.

pass@k of one prompt with n samples of which c are correct is the probability that k samples drawn
without replacement from the n contain a correct one: 1 - C(n - c, k) / C(n, k) (the unbiased
estimator of Chen et al., 2021), averaged over prompts. It needs k <= n.
"""

from __future__ import annotations

from typing import Any

from rollflow.artifacts.sample import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), computed as a product (no huge binomials)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} correct of n={n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n} samples per prompt")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def eval_summary(
    samples: list[Sample],
    *,
    ks: list[int] | tuple[int, ...] = (),
    threshold: float = 1.0,
    reward_key: str | None = None,
) -> dict[str, Any]:
    """`eval/accuracy` (mean scalar reward over samples), `eval/pass@k` for each k, and counts.

    `reward_key`: the field of dict rewards (the run's `rollout.eval_reward_key`, else `rollout.reward_key`)."""
    if not samples:
        raise ValueError("eval rollout has no samples")
    rewards = [s.scalar_reward(reward_key) for s in samples]
    out: dict[str, Any] = {"eval/accuracy": sum(rewards) / len(rewards)}
    if ks:
        groups: dict[int, list[float]] = {}
        for s, r in zip(samples, rewards):
            groups.setdefault(s.group_index, []).append(r)
        sizes = {len(g) for g in groups.values()}
        n = min(sizes)
        for k in ks:
            if k > n:
                raise ValueError(f"eval/pass@{k}: a prompt has only {n} samples")
            out[f"eval/pass@{k}"] = sum(
                pass_at_k(len(g), sum(r >= threshold for r in g), k) for g in groups.values()
            ) / len(groups)
        out["eval/n_prompts"] = float(len(groups))
        out["eval/n_samples_per_prompt"] = float(n)
    return out
