"""Reward functions for tests of `rollflow replay-reward` (importable as tests.reward_fixtures)."""

from __future__ import annotations

import asyncio

from rollflow.artifacts.sample import Sample


def exact(sample: Sample) -> float:
    """The built-in addition reward, re-implemented: 1.0 for the exact answer."""
    return 1.0 if sample.response.strip() == (sample.label or "") else 0.0


def last_digit(sample: Sample) -> float:
    """A changed reward: credit for the right last digit only."""
    label, response = sample.label or "", sample.response.strip()
    return 1.0 if label and response[-1:] == label[-1:] else 0.0


async def last_digit_async(sample: Sample) -> float:
    await asyncio.sleep(0)
    return last_digit(sample)


def as_dict(sample: Sample) -> dict:
    return {"acc": exact(sample), "len": float(sample.response_length)}


def mutating(sample: Sample) -> float:
    """Misbehaves on purpose: edits the sample it scores (replay must score copies)."""
    sample.metadata["touched"] = True
    sample.response = "mutated"
    return 0.5
