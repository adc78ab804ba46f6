"""The multi-turn example on the embedded default: addition with a `calc` tool.

The built-in model writes only digits, '+' and '=' (its tokenizer has no other characters), so the
tool call is written in that alphabet: a model turn that ends with '=' (a stop token here) is a call of
`calc` on the text before it, e.g. "12+45=" -> the tool turn "57" (token ids, loss mask 0), and the
model continues. A turn that ends with eos is the final answer; the reward is 1.0 when it equals the
label. So a conversation is "012+345=" | model "45+12=" | tool "57" | model "0357". Malformed calls
("=", "1++2=") make the tool raise: a failed tool turn (error recorded), and the model goes on.

    rollflow demo --set rollout.function=rollflow.tasks.rollout.calc_agent:calc_rollout \\
                  --set rollout.reward=rollflow.tasks.rollout.calc_agent:calc_reward
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.agent import RolloutContext, ToolCall, tool_loop
from rollflow.tasks.rollout.conversation import encode_text, turns_of
from rollflow.tasks.rollout.engine import SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem
from rollflow.tasks.rollout.token_client import TokenClient


def calc(expression: str) -> str:
    """'12+45' -> '57': a sum of non-negative integers; anything else raises ValueError."""
    parts = expression.split("+")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"calc: {expression!r} is not a sum like '12+45'")
    return str(sum(int(p) for p in parts))


def parse_calc_call(text: str) -> Optional[ToolCall]:
    return ToolCall("calc", text[:-1]) if text.endswith("=") else None


async def calc_rollout(client: TokenClient, item: PromptItem, params: SamplingParams, ctx: RolloutContext) -> Sample:
    """Up to rollout.agent.max_turns model turns; '=' ends a turn as a calc call."""
    stops = tuple(encode_text(client.tokenizer, "="))
    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + stops)
    return await tool_loop(client, item, params, ctx, tools={"calc": calc}, parse_call=parse_calc_call)


def final_answer(sample: Sample) -> str:
    """The last model turn's text (the whole response for a single-turn sample)."""
    turns = [t for t in turns_of(sample) if t.role == "assistant"]
    return (turns[-1].text if turns else sample.response).strip()


def calc_reward(sample: Sample) -> float:
    """1.0 when the final answer equals the label (a conversation ending in a tool call has none)."""
    if sample.status.value != "completed":
        return 0.0
    return 1.0 if final_answer(sample) == (sample.label or "") else 0.0
