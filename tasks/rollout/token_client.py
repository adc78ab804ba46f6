"""`TokenClient`: the engine as rollout functions see it, token ids in, token ids + log-probs out.

A rollout function (tasks/rollout/agent.py) holds one conversation; many run at once as asyncio tasks.
Each `await client.generate(ids, params)` is one engine call of one sequence, but engines want batches
(the hf engine runs one `generate` over many rows; SGLang takes many requests at once), so the client
collects the requests of every conversation that is waiting and sends them as one batched call. The
ids a function gets back are exactly the engine's (no decode/encode round trip), so a multi-turn
sample's tokens are the concatenation of what the engine produced and what the function spliced in.

Determinism: requests of one batch are ordered by the slot (prompt, sample) that made them, and every
batch gets its own seed derived from the rollout's seed and the batch's number, so a rollout whose
tools are deterministic draws the same tokens every time, whatever order the tasks woke up in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
from typing import Any

from rollflow.tasks.rollout.engine import (
    GenerationOutput,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    sample_seed,
)

# The (group, sample) slot of the conversation a request belongs to; set by the runner per task.
SLOT: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("rollflow_rollout_slot", default=(0, 0))


@dataclasses.dataclass
class _Pending:
    slot: tuple[int, int]
    order: int
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


class TokenClient:
    """Batched token-in/token-out generation over any `RolloutEngine` (hf, sglang).

    `tokenizer` is the engine's, for functions that encode tool output or decode model text."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self.calls = 0  # batched engine calls so far (metadata for perf, and the per-batch seed)
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._order = 0
        # The engine's own thread: sync rollout functions waiting in the shared pool can never starve it.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollflow-engine")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the runner runs conversations on (generate_sync submits to it from worker threads)."""
        self._loop = loop

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """One continuation of `input_ids`: its token ids, their log-probs and the finish reason."""
        if not input_ids:
            raise ValueError("TokenClient.generate: input_ids is empty (a continuation needs at least one token)")
        loop = asyncio.get_running_loop()
        self._loop = loop
        future = loop.create_future()
        self._order += 1
        self._pending.append(_Pending(SLOT.get(), self._order, [int(t) for t in input_ids], params, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_when_quiet())
        return await future

    def generate_sync(self, input_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """`generate` for a sync rollout function (the runner runs those in worker threads)."""
        if self._loop is None:
            raise RuntimeError("TokenClient.generate_sync is for sync rollout functions run by the rollout runner")
        return asyncio.run_coroutine_threadsafe(self.generate(input_ids, params), self._loop).result()

    async def _flush_when_quiet(self) -> None:
        # Let every runnable conversation reach its next await first: one engine call then serves them all.
        seen = -1
        while seen != len(self._pending):
            seen = len(self._pending)
            for _ in range(3):
                await asyncio.sleep(0)
        batch, self._pending = self._pending, []
        live = [p for p in batch if not p.future.done()]  # a timed-out conversation cancelled its future
        if not live:
            return
        by_params: dict[SamplingParams, list[_Pending]] = {}
        for p in sorted(live, key=lambda p: (p.slot, p.order)):
            by_params.setdefault(p.params, []).append(p)
        loop = asyncio.get_running_loop()
        for params, group in by_params.items():
            self.calls += 1
            if params.seed is not None:
                params = dataclasses.replace(params, seed=sample_seed(params.seed, self.calls))
            requests = [GenerationRequest(prompt_ids=p.input_ids, n=1) for p in group]
            try:
                # In a thread: the loop keeps serving tool calls and timeouts while the engine runs.
                outputs = await loop.run_in_executor(self._executor, self.engine.generate, requests, params)
            except Exception as exc:  # noqa: BLE001 - every waiting conversation gets the engine's error
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, outs in zip(group, outputs):
                if not p.future.done():
                    p.future.set_result(outs[0])
        if self._pending:  # requests made while the engine ran: the next batch
            self._flusher = loop.create_task(self._flush_when_quiet())
