"""The embedded default task: zero-padded fixed-width addition with a verifiable answer.

"012+345=" -> "0357". Fixed widths keep every prompt the same length, so the demo needs no padding
at generation time, and the answer is checkable by string comparison.
"""

from __future__ import annotations

import random

from rollflow.tasks.rollout.prompts import PromptItem


def addition_item(a: int, b: int, digits: int = 3) -> PromptItem:
    return PromptItem(prompt=f"{a:0{digits}d}+{b:0{digits}d}=", label=f"{a + b:0{digits + 1}d}")


def addition_prompts(n: int, *, seed: int, digits: int = 3) -> list[PromptItem]:
    rng = random.Random(seed)
    hi = 10**digits - 1
    return [addition_item(rng.randint(0, hi), rng.randint(0, hi), digits) for _ in range(n)]


def addition_reward(response: str, label: str) -> float:
    """1.0 for the exact answer, else 0.0."""
    return 1.0 if response.strip() == label else 0.0
