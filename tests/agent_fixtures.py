"""Rollout functions, tools and judges for tests/test_agents.py (importable by Ray workers as tests.agent_fixtures)."""

from __future__ import annotations

import asyncio
import time

from rollflow.tasks.rollout.agent import ToolCall, tool_loop
from rollflow.tasks.rollout.conversation import encode_text

TOOL_OUTPUT = "99"


async def always_tool(client, item, params, ctx):
    """Model turn, then the tool's "99" spliced in, then a second model turn: every sample has a hole."""
    conv = ctx.conversation()
    conv.add_model(await client.generate(conv.ids, params))
    conv.add_tokens("tool", encode_text(client.tokenizer, TOOL_OUTPUT), text=TOOL_OUTPUT, name="echo", ok=True)
    conv.add_model(await client.generate(conv.ids, params))
    return conv.to_sample(item)


def always_tool_sync(client, item, params, ctx):
    """The same conversation from a sync function (runs in a worker thread, calls generate_sync)."""
    conv = ctx.conversation()
    conv.add_model(client.generate_sync(conv.ids, params))
    conv.add_tokens("tool", encode_text(client.tokenizer, TOOL_OUTPUT), text=TOOL_OUTPUT, name="echo", ok=True)
    conv.add_model(client.generate_sync(conv.ids, params))
    return conv.to_sample(item)


def boom(arguments: str) -> str:
    raise RuntimeError(f"boom on {arguments!r}")


async def slow(arguments: str) -> str:
    await asyncio.sleep(30)
    return "1"


def call_every_turn(text: str) -> ToolCall:
    return ToolCall("boom", text)


async def raising_tool_agent(client, item, params, ctx):
    return await tool_loop(client, item, params, ctx, tools={"boom": boom}, parse_call=lambda t: ToolCall("boom", t))


async def slow_tool_agent(client, item, params, ctx):
    return await tool_loop(client, item, params, ctx, tools={"slow": slow}, parse_call=lambda t: ToolCall("slow", t))


async def raises(client, item, params, ctx):
    raise KeyError("no such thing")


async def hangs(client, item, params, ctx):
    await asyncio.sleep(30)


def hangs_sync(client, item, params, ctx):
    time.sleep(3)


def feedback_judge(request) -> str:
    """A fake judge: the user's reply '1' means good, '0' bad; its first vote on every turn dissents,
    so only a majority over k >= 3 votes gives the intended verdict."""
    key = (request.context, request.assistant, request.feedback)
    n = _VOTES.get(key, 0)
    _VOTES[key] = n + 1
    good = request.feedback.strip() == "1"
    if n % 3 == 0:
        good = not good
    return "good" if good else "bad"


_VOTES: dict = {}


JUDGE_TEMPLATE = "{assistant}+{feedback}="  # the tiny model's alphabet: it "adds" the turn and the feedback


async def judged_always_tool(client, item, params, ctx):
    """always_tool, then every assistant turn judged by the engine itself (3 votes)."""
    from rollflow.tasks.rollout.engine import SamplingParams
    from rollflow.tasks.rollout.feedback import judge_conversation

    sample = await always_tool(client, item, params, ctx)
    return await judge_conversation(client, sample, JUDGE_TEMPLATE, SamplingParams(max_new_tokens=5, seed=3), votes=3)
