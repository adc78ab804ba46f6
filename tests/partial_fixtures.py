"""A rollout function for the flow-level partial rollout tests in tests/test_partial_flow.py (importable by Ray
workers as tests.partial_fixtures).

Whether the flow's abort at sync finds a generation in flight depends on timing (docs/async.md); the builtin
model answers in a few tokens, faster than a train step. This function makes the in-flight generation certain:
in rollout HELD_ROLLOUT the samples of group 0 generate one real token and then wait until the engine answers
"abort", which it does once the flow's abort-generation task has run after the train step. Every other slot
is plain single-turn generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.tokenizer import decode_response
from rollflow.tasks.rollout.generate import FINISH_TO_STATUS

HELD_ROLLOUT = 1
HELD_GROUP = 0
HOLD_LIMIT_S = 60.0  # a lost abort then shows up as failed samples, not as a hung test
SEED_STRIDE = 1_000_003  # rollout.seed: "seed * 1000003 + rollout_id" (tasks/rollout/settings.py)


async def held_at_sync(client, item, params, ctx):
    ids = ctx.prompt_ids
    if params.seed % SEED_STRIDE != HELD_ROLLOUT or ctx.group_index != HELD_GROUP:
        out = await client.generate(ids, params)
        return _sample(client, item, ids, out.response_ids, out.log_probs, FINISH_TO_STATUS[out.finish_reason])
    one = dataclasses.replace(params, max_new_tokens=1)
    first = await client.generate(ids, one)
    if first.finish_reason != "length":  # eos at once, or cut already: nothing left to hold
        return _sample(client, item, ids, first.response_ids, first.log_probs, FINISH_TO_STATUS[first.finish_reason])
    held = ids + list(first.response_ids)
    deadline = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        # The engine's abort stays in force until its next rollout, so a one-token request answers "abort"
        # (no token) once it came; before that its token is thrown away and the sample keeps waiting.
        probe = await client.generate(held, one)
        if probe.finish_reason == "abort":
            return _sample(client, item, ids, first.response_ids, first.log_probs, Status.ABORTED)
    return _sample(client, item, ids, first.response_ids, first.log_probs, Status.FAILED, error="no abort came")


def _sample(client, item, prompt_ids, response_ids, log_probs, status: Status, **metadata) -> Sample:
    response_ids = list(response_ids)
    return Sample(
        group_index=0,
        index=0,
        prompt=item.prompt,
        tokens=list(prompt_ids) + response_ids,
        response=decode_response(client.tokenizer, response_ids),
        response_length=len(response_ids),
        loss_mask=[1] * len(response_ids),
        rollout_log_probs=list(log_probs),
        label=item.label,
        status=status,
        metadata={**item.metadata, **metadata},
    )
