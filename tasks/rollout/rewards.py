"""Reward functions: the built-in task rewards, and any function named by a dotted path.

A reward function takes one `Sample` and returns a float or a dict (then `reward_key` picks the
field used for training). It may be `async def`; many async calls run concurrently.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any, Callable

from artifacts.sample import Sample
from tasks.rollout.addition import addition_reward

RewardFn = Callable[[Sample], Any]


def _addition(sample: Sample) -> float:
    return addition_reward(sample.response, sample.label or "")


BUILTIN_REWARDS: dict[str, RewardFn] = {"addition": _addition}


def resolve_reward_fn(spec: str) -> RewardFn:
    """`addition` (built-in) or `package.module:function` / `package.module.function`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"rollout.reward={spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor a dotted path "
            "like 'my_pkg.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"rollout.reward={spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward={spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def score_samples(samples: list[Sample], fn: RewardFn, *, reward_key: str | None = None) -> list[Sample]:
    """Set `reward` (and `reward_key`) on every sample in place; returns the same list."""
    if inspect.iscoroutinefunction(fn):
        async def run_all() -> list[Any]:
            return await asyncio.gather(*(fn(s) for s in samples))

        rewards = asyncio.run(run_all())
    else:
        rewards = []
        for s in samples:
            value = fn(s)
            if inspect.isawaitable(value):  # a sync wrapper that returned a coroutine
                value = asyncio.run(_await(value))
            rewards.append(value)
    for sample, reward in zip(samples, rewards):
        if isinstance(reward, dict):
            if reward_key is None or reward_key not in reward:
                raise ValueError(
                    f"reward function returned a dict with keys {sorted(reward)}; set rollout.reward_key to one of them"
                )
            sample.reward = reward
            sample.reward_key = reward_key
        else:
            sample.reward = float(reward)
    return samples


async def _await(value: Any) -> Any:
    return await value
