"""Rollout functions: the extension point for multi-turn agents (slime's --custom-generate-function-path).

A rollout function is named by `rollout.function` (a dotted path 'pkg.mod:fn'; the default
'single_turn' is the built-in batched generate of tasks/rollout/generate.py). Its signature:

    def fn(client: TokenClient, item: PromptItem, params: SamplingParams, ctx: RolloutContext)
        -> Sample | list[Sample]                      # or `async def` returning the same

It is called `rollout.n_samples_per_prompt` times per prompt (`ctx.sample_index` says which), and the
samples it returns, all of them together per prompt, form that prompt's group (a group must end up
with n_samples_per_prompt samples). `client.generate(ids, params)` is token-in/token-out: the exact
ids and log-probs the engine produced. Build the sample with `Conversation` (tasks/rollout/conversation.py):
model turns keep loss mask 1, spliced tool/user turns 0. The runner sets group_index, index and
weight_version, and enforces the limits: `rollout.agent.sample_timeout_s` per call (then, and when the
function raises, the slot becomes a `failed` sample with the error in metadata, never a crashed
rollout) and `rollout.agent.max_total_tokens` (a longer response is cut and marked truncated).
`async def` functions run concurrently on one event loop (prefer them: their engine calls are batched
together); sync functions run in worker threads and call `client.generate_sync`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import functools
import inspect
import re
from typing import Any, Awaitable, Callable, Optional, Union

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.tokenizer import prompt_token_ids
from rollflow.tasks.rollout.conversation import TURNS_KEY, Conversation
from rollflow.tasks.rollout.dotted import load_callable
from rollflow.tasks.rollout.engine import RolloutEngine, SamplingParams
from rollflow.tasks.rollout.generate import warn_identical_groups
from rollflow.tasks.rollout.prompts import PromptItem
from rollflow.tasks.rollout.token_client import SLOT, TokenClient

RolloutResult = Union[Sample, list[Sample]]
RolloutFn = Callable[..., Union[RolloutResult, Awaitable[RolloutResult]]]


@dataclasses.dataclass(frozen=True)
class AgentLimits:
    """rollout.agent as the runner and rollout functions see it (tasks/rollout/settings.py: AgentConfig)."""

    max_turns: int = 4
    max_total_tokens: Optional[int] = None
    tool_timeout_s: float = 5.0
    sample_timeout_s: Optional[float] = 600.0


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    group_index: int
    sample_index: int  # 0 .. n_samples_per_prompt - 1 within the group
    item: PromptItem
    tokenizer: Any
    limits: AgentLimits

    @functools.cached_property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (chat template / bos applied once, as the single-turn path)."""
        return prompt_token_ids(self.tokenizer, self.item.prompt)

    def conversation(self, tokenizer: Any = None) -> Conversation:
        return Conversation(self.prompt_ids, tokenizer or self.tokenizer, max_total_tokens=self.limits.max_total_tokens)


def resolve_rollout_fn(spec: str) -> RolloutFn:
    """`pkg.mod:fn` or `pkg.mod.fn`; 'single_turn' has no function (the batched built-in path)."""
    return load_callable("rollout.function", spec, "'single_turn' or a dotted path like 'my_pkg.agents:rollout'")


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (async __call__)


def failed_sample(item: PromptItem, prompt_ids: list[int], error: str, status: Status = Status.FAILED) -> Sample:
    """The sample of a slot whose function raised or timed out: the prompt, no response (no loss)."""
    return Sample(
        group_index=0,
        index=0,
        prompt=item.prompt,
        tokens=list(prompt_ids),
        response="",
        response_length=0,
        loss_mask=[],
        rollout_log_probs=[],
        label=item.label,
        status=status,
        metadata={**item.metadata, "error": error},
    )


def _prompt_or_bos(ctx: RolloutContext) -> list[int]:
    """A failed slot's tokens: its prompt, or a lone bos when even the prompt cannot be tokenised."""
    try:
        return ctx.prompt_ids
    except Exception:  # noqa: BLE001 - the error that matters is already in the failed sample
        tok = ctx.tokenizer
        return [next(t for t in (getattr(tok, "bos_token_id", None), tok.eos_token_id) if t is not None)]


def cap_tokens(sample: Sample, max_total_tokens: Optional[int]) -> Sample:
    """A response longer than the budget is cut to it and marked truncated (functions may ignore the budget)."""
    if max_total_tokens is None or sample.response_length <= max_total_tokens:
        return sample
    cut = sample.response_length - max_total_tokens
    sample.tokens = sample.tokens[:-cut]
    sample.loss_mask = sample.loss_mask[:max_total_tokens]
    sample.rollout_log_probs = sample.rollout_log_probs[:max_total_tokens]
    sample.response_length = max_total_tokens
    sample.status = Status.TRUNCATED
    turns = sample.metadata.get(TURNS_KEY)
    if turns:  # turn records end where the tokens now end
        sample.metadata[TURNS_KEY] = [
            {**t, "end": min(t["end"], max_total_tokens)} for t in turns if t["start"] < max_total_tokens
        ]
    return sample


async def _call(
    fn: RolloutFn,
    client: TokenClient,
    item: PromptItem,
    params: SamplingParams,
    ctx: RolloutContext,
    pool: concurrent.futures.Executor,
) -> RolloutResult:
    if _is_async(fn):
        return await fn(client, item, params, ctx)
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()  # the slot travels into the thread (batch order, seeds)
    result = await loop.run_in_executor(pool, lambda: context.run(fn, client, item, params, ctx))
    return await result if inspect.isawaitable(result) else result


def run_rollout_function(
    fn: RolloutFn,
    engine: RolloutEngine,
    tokenizer: Any,
    items: list[PromptItem],
    params: SamplingParams,
    n_samples_per_prompt: int,
    limits: AgentLimits,
) -> list[Sample]:
    """Every (prompt, sample) slot through `fn`, concurrently; samples ordered by group, then slot."""
    client = TokenClient(engine, tokenizer)
    name = getattr(fn, "__name__", repr(fn))

    async def one(group: int, k: int, item: PromptItem, pool: concurrent.futures.Executor) -> list[Sample]:
        SLOT.set((group, k))
        ctx = RolloutContext(group_index=group, sample_index=k, item=item, tokenizer=tokenizer, limits=limits)
        try:
            result = await asyncio.wait_for(_call(fn, client, item, params, ctx, pool), limits.sample_timeout_s)
        except asyncio.TimeoutError:
            return [
                failed_sample(
                    item, _prompt_or_bos(ctx), f"rollout function {name} timed out after {limits.sample_timeout_s}s"
                )
            ]
        except Exception as exc:  # noqa: BLE001 - one failing conversation never ends the rollout
            return [
                failed_sample(item, _prompt_or_bos(ctx), f"rollout function {name} raised {type(exc).__name__}: {exc}")
            ]
        samples = [result] if isinstance(result, Sample) else list(result)
        for s in samples:
            if not isinstance(s, Sample):
                error = f"rollout function {name} returned {type(s).__name__}, expected Sample or list[Sample]"
                return [failed_sample(item, _prompt_or_bos(ctx), error)]
        samples = [cap_tokens(s, limits.max_total_tokens) for s in samples]
        try:
            for s in samples:
                s.status = Status.parse(s.status)
                s.validate()
        except ValueError as exc:  # a malformed sample is that slot's failure, not the rollout's
            return [failed_sample(item, _prompt_or_bos(ctx), f"rollout function {name} returned a bad sample: {exc}")]
        return samples

    async def everything() -> list[list[Sample]]:
        client.attach(asyncio.get_running_loop())
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="rollflow-rollout-fn")
        try:
            return list(
                await asyncio.gather(
                    *(one(g, k, item, pool) for g, item in enumerate(items) for k in range(n_samples_per_prompt))
                )
            )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a timed-out sync function is left to finish alone

    try:
        per_slot = _run(everything())
    finally:
        client.close()
    samples: list[Sample] = []
    for slot, group_samples in enumerate(per_slot):
        for s in group_samples:
            s.group_index = slot // n_samples_per_prompt
            s.index = len(samples)
            s.weight_version = engine.weight_version
            samples.append(s)
    warn_identical_groups(samples, n_samples_per_prompt, params)
    sizes = {g: sum(s.group_index == g for s in samples) for g in range(len(items))}
    wrong = {g: c for g, c in sizes.items() if c != n_samples_per_prompt}
    if wrong:
        g, c = next(iter(wrong.items()))
        raise ValueError(
            f"rollout function {name} gave prompt {g} {c} samples; every prompt's group needs "
            f"rollout.n_samples_per_prompt={n_samples_per_prompt} (return one Sample per call)"
        )
    return samples


def _run(coro: Any) -> Any:
    """asyncio.run, also when the caller's thread already runs a loop (then in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        return helper.submit(asyncio.run, coro).result()


# ---- tools ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str
    error: Optional[str] = None


async def call_tool(fn: Callable[[str], Any], arguments: str, timeout_s: Optional[float]) -> ToolResult:
    """Run one tool (sync or async) under a timeout; a raise or a timeout is a failed result, never an error."""
    try:
        if _is_async(fn):
            value = await asyncio.wait_for(fn(arguments), timeout_s)
        else:
            loop = asyncio.get_running_loop()
            value = await asyncio.wait_for(loop.run_in_executor(None, fn, arguments), timeout_s)
        return ToolResult(ok=True, output=str(value))
    except asyncio.TimeoutError:
        return ToolResult(ok=False, output="", error=f"timeout after {timeout_s}s")
    except Exception as exc:  # noqa: BLE001 - the tool's failure is data for the sample
        return ToolResult(ok=False, output="", error=f"{type(exc).__name__}: {exc}")


async def tool_loop(
    client: TokenClient,
    item: PromptItem,
    params: SamplingParams,
    ctx: RolloutContext,
    *,
    tools: dict[str, Callable[[str], Any]],
    parse_call: Callable[[str], Optional[ToolCall]],
    observation: Callable[[ToolResult], str] = lambda r: r.output,
) -> Sample:
    """The common agent loop: model turn; if it is a tool call (`parse_call` of its text), run the tool and
    splice `observation(result)` in as a tool turn; until a turn is no call, the turns run out
    (truncated) or the token budget does. Unknown tool names are failed tool turns."""
    conv = ctx.conversation(client.tokenizer)
    for _ in range(ctx.limits.max_turns):
        turn_params = conv.sampling(params)
        if turn_params is None:
            break
        out = await client.generate(conv.ids, turn_params)
        turn = conv.add_model(out)
        call = parse_call(turn.text) if out.finish_reason == "stop" else None
        if call is None:
            return conv.to_sample(item)
        tool = tools.get(call.name)
        result = (
            await call_tool(tool, call.arguments, ctx.limits.tool_timeout_s)
            if tool is not None
            else ToolResult(ok=False, output="", error=f"unknown tool {call.name!r}")
        )
        conv.add_text(
            "tool", observation(result), name=call.name, arguments=call.arguments, ok=result.ok, error=result.error
        )
    conv.truncated = True  # the last turn asked for a tool: no final answer within the limits
    return conv.to_sample(item)


async def single_turn(client: TokenClient, item: PromptItem, params: SamplingParams, ctx: RolloutContext) -> Sample:
    """The default's behaviour as a rollout function (a template; the default itself is the batched path)."""
    conv = ctx.conversation(client.tokenizer)
    turn_params = conv.sampling(params)
    if turn_params is not None:
        conv.add_model(await client.generate(conv.ids, turn_params))
    return conv.to_sample(item)


_CALL = re.compile(r"^(?P<name>\w+)\((?P<args>.*)\)$", re.S)


def parse_function_call(text: str) -> Optional[ToolCall]:
    """'name(args)' (a whole turn) -> ToolCall; anything else is not a call."""
    m = _CALL.match(text.strip())
    return ToolCall(m.group("name"), m.group("args")) if m else None
