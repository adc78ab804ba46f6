"""Rewards from conversation feedback, online (judge on rollouts) and offline (logged conversations).

A judge scores each assistant turn from the turn that follows it (the user's reaction, or the tool's
result): `judge(JudgeRequest) -> float | str` (sync or async; "good"/"bad"/"neutral" mean 1/-1/0). It is
asked `rollout.feedback.votes` times per turn and the majority verdict is the turn's reward (ties: the
mean of the tied verdicts; answers that are no verdict are no votes). Turn rewards go into
`metadata["turns"][i]["reward"]`; the trainer credits them to that turn's tokens
(tasks/train/turn_credit.py); the sample's scalar reward is their mean, and it is also the credit of
loss tokens in turns without a following turn (the last answer).

Online with an engine as the judge: `judge_conversation` at the end of a rollout function asks the
rollout's own engine (`engine_judge`: a judge prompt template, k sampled answers in the same batched
calls), and `judged_turns_reward` is the reward function that reads the turn rewards.

Offline: `logged_conversation` is a rollout function that generates nothing: it turns a record's chat
messages (a JSONL of logged conversations, data.task=dataset, data.input_key=messages,
data.apply_chat_template=true) into one sample, assistant messages as loss tokens, user/tool messages
spliced in with loss mask 0. With rollout.reward=conversation_feedback the judge reads the real users'
next messages, so a deployment trains from its logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections import Counter
from typing import Any, Callable, Optional

from rollflow.artifacts.sample import Sample
from rollflow.tasks.model.tokenizer import decode_response, has_chat_template, is_hf_tokenizer, prompt_token_ids
from rollflow.tasks.rollout.conversation import TURNS_KEY, Conversation, encode_text
from rollflow.tasks.rollout.engine import GenerationOutput, SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem

VERDICTS = {"good": 1.0, "bad": -1.0, "neutral": 0.0, "positive": 1.0, "negative": -1.0}


@dataclasses.dataclass(frozen=True)
class JudgeRequest:
    prompt: Any  # the sample's prompt (text or messages)
    context: str  # the conversation's response text before the judged turn
    assistant: str  # the judged assistant turn
    feedback: str  # the next turn's text: what the user (or tool) answered
    feedback_role: str  # "user" | "tool"
    turn: int  # index of the judged turn in metadata["turns"]


JudgeFn = Callable[[JudgeRequest], Any]


def verdict_value(verdict: Any) -> float:
    """A judge's answer as a number: a number as is, a word of VERDICTS (first word, case-insensitive)."""
    if isinstance(verdict, (int, float)) and not isinstance(verdict, bool):
        return float(verdict)
    words = str(verdict).strip().lower().split()
    first = words[0].strip(".:,!") if words else ""
    if first in VERDICTS:
        return VERDICTS[first]
    try:
        return float(first)  # a judge model asked for a score answers with a number
    except ValueError:
        pass
    raise ValueError(f"judge verdict {verdict!r}: expected a number or one of {sorted(VERDICTS)}")


def majority(votes: list[float]) -> float:
    """The most common vote; a tie between the most common ones gives their mean."""
    counts = Counter(votes)
    top = max(counts.values())
    tied = sorted(v for v, c in counts.items() if c == top)
    return sum(tied) / len(tied)


async def _ask(judge: JudgeFn, request: JudgeRequest) -> Optional[float]:
    """One vote; an answer that is no verdict is no vote (a judge model may ramble), a raising judge is an error."""
    value = judge(request)
    if inspect.isawaitable(value):
        value = await value
    try:
        return verdict_value(value)
    except ValueError:
        return None


async def score_turns(sample: Sample, judge: JudgeFn, votes: int) -> list[Optional[float]]:
    """Judge every assistant turn that has a next turn (`votes` times each, majority); writes the rewards
    into the sample's turns and returns them per turn (None: not judged)."""
    turns = sample.metadata.get(TURNS_KEY) or []
    requests = []
    for i, turn in enumerate(turns[:-1]):
        nxt = turns[i + 1]
        if turn.get("role") != "assistant" or nxt.get("role") not in ("user", "tool"):
            continue
        context = "".join(t.get("text", "") for t in turns[:i])
        requests.append(
            JudgeRequest(
                prompt=sample.prompt,
                context=context,
                assistant=turn.get("text", ""),
                feedback=nxt.get("text", ""),
                feedback_role=nxt["role"],
                turn=i,
            )
        )
    verdicts = await asyncio.gather(*(_ask(judge, r) for r in requests for _ in range(votes)))
    rewards: list[Optional[float]] = [None] * len(turns)
    for j, request in enumerate(requests):
        mine = [v for v in verdicts[j * votes : (j + 1) * votes] if v is not None]
        turns[request.turn]["votes"] = mine
        if mine:  # no valid vote at all: the turn stays unjudged
            rewards[request.turn] = majority(mine)
            turns[request.turn]["reward"] = rewards[request.turn]
    return rewards


def feedback_reward(judge: JudgeFn, votes: int = 3) -> Callable[[Sample], Any]:
    """An async per-sample reward function: judged turn rewards, scalar = their mean (0.0 when none)."""
    if votes < 1:
        raise ValueError(f"rollout.feedback.votes={votes} must be >= 1")

    async def conversation_feedback(sample: Sample) -> float:
        scored = [r for r in await score_turns(sample, judge, votes) if r is not None]
        return sum(scored) / len(scored) if scored else 0.0

    return conversation_feedback


# ---- a judge that is an engine call ------------------------------------------------------------------


def engine_judge(client: Any, template: str, params: SamplingParams) -> JudgeFn:
    """A judge asking an engine: `template` filled with the request's fields ({prompt}, {context},
    {assistant}, {feedback}, {role}), sent through `client` (a TokenClient), the decoded answer is the verdict.
    Votes of one rollout go out in the same batched engine calls as the conversations."""

    async def judge(request: JudgeRequest) -> str:
        prompt = (
            request.prompt
            if isinstance(request.prompt, str)
            else " ".join(str(m.get("content", "")) for m in request.prompt)
        )
        text = template.format(
            prompt=prompt,
            context=request.context,
            assistant=request.assistant,
            feedback=request.feedback,
            role=request.feedback_role,
        )
        out = await client.generate(prompt_token_ids(client.tokenizer, text), params)
        return decode_response(client.tokenizer, out.response_ids)

    return judge


async def judge_conversation(
    client: Any, sample: Sample, template: str, params: SamplingParams, votes: int = 3
) -> Sample:
    """Online feedback inside a rollout function: judge the sample's turns with the engine (`engine_judge`)
    before returning it; `judged_turns_reward` then makes the scalar reward from the turn rewards."""
    await score_turns(sample, engine_judge(client, template, params), votes)
    return sample


def judged_turns_reward(sample: Sample) -> float:
    """Reward function for samples whose turns were judged during the rollout: the mean turn reward (0 if none)."""
    scored = [t["reward"] for t in sample.metadata.get(TURNS_KEY) or [] if t.get("reward") is not None]
    return sum(scored) / len(scored) if scored else 0.0


# ---- offline: logged conversations -----------------------------------------------------------------


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_from_messages(messages: list[dict[str, Any]], tokenizer: Any) -> Conversation:
    """A logged conversation as token ids: everything before the first assistant message is the prompt.

    With a chat template every message's ids are the difference of the rendered prefixes (so role markers
    and end-of-turn tokens land where the template puts them; the assistant's own end-of-turn is a loss
    token). Without one (rollflow's char tokenizer) contents are concatenated, bos first, and assistant
    messages end with eos."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError("logged conversation has no assistant message: nothing to train on")
    chat = is_hf_tokenizer(tokenizer) and has_chat_template(tokenizer)
    if chat:
        prompt_ids = _render(tokenizer, messages[:first], True)
    else:
        bos = getattr(tokenizer, "bos_token_id", None)
        prompt_ids = ([bos] if bos is not None else []) + [
            t for m in messages[:first] for t in encode_text(tokenizer, str(m.get("content", "")))
        ]
    conv = Conversation(prompt_ids, tokenizer)
    for i in range(first, len(messages)):
        role = messages[i].get("role")
        content = str(messages[i].get("content", ""))
        if chat:
            before = conv.ids
            upto = _render(
                tokenizer, messages[: i + 1], i + 1 < len(messages) and messages[i + 1].get("role") == "assistant"
            )
            if upto[: len(before)] != before:
                raise ValueError(
                    f"the chat template does not render message {i} as an extension of the ones "
                    "before it; logged conversations need a prefix-stable template"
                )
            ids = upto[len(before) :]
        else:
            ids = encode_text(tokenizer, content) + ([tokenizer.eos_token_id] if role == "assistant" else [])
        if role == "assistant":
            # Logged text has no engine log-probs: 0.0, and the sample says so (no mismatch metrics or TIS).
            conv.add_model(GenerationOutput(ids, [0.0] * len(ids), "stop"))
            conv.turns[-1].text = content
        else:
            conv.add_tokens("user" if role != "tool" else "tool", ids, text=content)
    return conv


def logged_conversation(client: Any, item: PromptItem, params: SamplingParams, ctx: Any) -> Sample:
    """Rollout function of the offline path: the record's messages as one sample, no generation."""
    if not isinstance(item.prompt, list):
        raise ValueError(
            "logged_conversation needs chat messages: set data.apply_chat_template=true and "
            "data.input_key to the record's messages field"
        )
    conv = conversation_from_messages(item.prompt, client.tokenizer)
    return conv.to_sample(item, rollout_log_probs_missing=True)
