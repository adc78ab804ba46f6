"""The `RolloutEngine` protocol: token ids in, token ids + log-probs out (as SGLang's /generate)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = full softmax (the distribution the trainer scores)
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    n: int = 1  # samples for this prompt


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    response_ids: list[int]
    log_probs: list[float]  # log-prob of every response token under the sampling distribution
    finish_reason: str  # "stop" | "length" | "abort"
    # MoE routing replay: top-k expert ids [prompt + response - 1, layers, k] (tasks/model/routing.py).
    routes: Optional[np.ndarray] = None


class RolloutEngine(Protocol):
    """What every engine does (HFEngine, SGLangEngine). What only some do (abort, offload, sessions, weight
    groups, ...) are the capability protocols of tasks/rollout/capabilities.py, asked with `isinstance`."""

    weight_version: int

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        """One list of `n` outputs per request, in request order."""
        ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], weight_version: int) -> None: ...

    def named_weights(self) -> dict[str, torch.Tensor]: ...

    def describe(self) -> dict[str, str]: ...

    # colocation: free / bring back GPU memory around the trainer's turn (tags as SGLang's: weights, kv_cache)
    def release_memory(self, tags: list[str] | None = None) -> None: ...

    def resume_memory(self, tags: list[str] | None = None) -> None: ...


def sample_seed(call_seed: int, sample: int) -> int:
    """The sampling seed of the `sample`-th sample of one generate call (flat over requests x n).

    Engines with seeded (deterministic) sampling must give every sample its own seed: with one seed per
    prompt, the n samples of a group are identical and every GRPO advantage is 0. Distinct for distinct
    `sample` (< 1000003) of one call."""
    return (call_seed * 1_000_003 + sample) % (2**63)


def next_weight_version(current: int, new: int) -> int:
    """Weight versions move by exactly one per sync; anything else means a lost or doubled update."""
    if new != current + 1:
        raise ValueError(
            f"weight_version {new} does not follow the engine's current version {current}: a sync was "
            "skipped or repeated; restart the engine from the matching checkpoint"
        )
    return new
