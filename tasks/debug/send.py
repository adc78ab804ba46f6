"""Send stored prompts to an engine again and compare (slime's `send_to_sglang`).

Token in, token out: each sample's prompt token ids (``tokens[:prompt_length]``) go to any
`RolloutEngine` unchanged (no re-tokenization), and the new response tokens and log-probs are
compared with the stored ones. With greedy decoding and the same weights an engine should
reproduce its own artifact exactly; a mismatch points at changed weights, a different engine
config, or nondeterminism. Log-probs are compared on the common token prefix of stored and new
responses (where both scored the same tokens). Engines report log-probs of their sampling
distribution (temperature-scaled), so send with the temperature the artifact was generated with
(greedy counts as temperature 1 in the hf engine) when the log-prob numbers matter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rollflow.artifacts.sample import Sample
from rollflow.tasks.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams

LOGPROBS_MISSING_KEY = "rollout_log_probs_missing"


@dataclasses.dataclass
class SampleComparison:
    position: int  # in the list that was sent
    group_index: int
    index: int
    identical: bool
    common_prefix: int  # leading response tokens equal in stored and new
    stored_length: int
    new_length: int
    logprob_abs_diff_max: float | None  # over the common prefix (None: nothing comparable)
    logprob_worst_token: int | None  # response position of that max
    new_response_ids: list[int] = dataclasses.field(repr=False, default_factory=list)
    new_log_probs: list[float] = dataclasses.field(repr=False, default_factory=list)
    finish_reason: str = ""


@dataclasses.dataclass
class SendReport:
    n_samples: int
    n_identical: int
    identical_fraction: float | None
    n_tokens_compared: int
    logprob_abs_diff_mean: float | None
    logprob_abs_diff_max: float | None
    logprob_tol: float
    logprob_exceeding: list[int]  # positions whose max |diff| > logprob_tol
    first_mismatch: dict[str, Any] | None  # first sample whose response tokens differ
    worst_logprob: dict[str, Any] | None  # the token with the largest |diff|
    params: dict[str, Any]
    comparisons: list[SampleComparison] = dataclasses.field(repr=False, default_factory=list)

    def to_dict(self, *, with_samples: bool = False) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "comparisons"}
        if with_samples:
            out["comparisons"] = [dataclasses.asdict(c) for c in self.comparisons]
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def default_params(
    samples: Sequence[Sample], *, greedy: bool = True, temperature: float = 1.0, seed: int | None = 0
) -> SamplingParams:
    """Sampling params that can reproduce the samples: max_new_tokens = the longest stored response."""
    longest = max((s.response_length for s in samples), default=1)
    return SamplingParams(temperature=0.0 if greedy else temperature, max_new_tokens=max(1, longest), seed=seed)


def send_samples(
    samples: Sequence[Sample], engine: RolloutEngine, params: SamplingParams, *, logprob_tol: float = 1e-4
) -> SendReport:
    """Regenerate every sample's response from its prompt token ids and compare with the stored one."""
    samples = list(samples)
    requests = [GenerationRequest(prompt_ids=list(s.tokens[: s.prompt_length]), n=1) for s in samples]
    outputs = engine.generate(requests, params) if requests else []
    if len(outputs) != len(samples):
        raise RuntimeError(f"engine returned {len(outputs)} results for {len(samples)} requests")

    comparisons: list[SampleComparison] = []
    total_diff, n_tokens = 0.0, 0
    worst: dict[str, Any] | None = None
    first_mismatch: dict[str, Any] | None = None
    for position, (sample, outs) in enumerate(zip(samples, outputs)):
        out = outs[0]
        stored = sample.response_tokens
        new = list(out.response_ids)
        prefix = _common_prefix(stored, new)
        identical = stored == new
        sample_max, sample_worst = None, None
        if not sample.metadata.get(LOGPROBS_MISSING_KEY):
            for t in range(min(prefix, len(sample.rollout_log_probs), len(out.log_probs))):
                diff = abs(float(sample.rollout_log_probs[t]) - float(out.log_probs[t]))
                total_diff += diff
                n_tokens += 1
                if sample_max is None or diff > sample_max:
                    sample_max, sample_worst = diff, t
        comparisons.append(
            SampleComparison(
                position,
                sample.group_index,
                sample.index,
                identical,
                prefix,
                len(stored),
                len(new),
                sample_max,
                sample_worst,
                new,
                list(out.log_probs),
                out.finish_reason,
            )
        )
        if sample_max is not None and (worst is None or sample_max > worst["abs_diff"]):
            worst = {
                "position": position,
                "group_index": sample.group_index,
                "index": sample.index,
                "token": sample_worst,
                "stored": float(sample.rollout_log_probs[sample_worst]),
                "new": float(out.log_probs[sample_worst]),
                "abs_diff": sample_max,
            }
        if not identical and first_mismatch is None:
            first_mismatch = {
                "position": position,
                "group_index": sample.group_index,
                "index": sample.index,
                "first_diff_token": prefix,
                "stored_response_ids": stored,
                "new_response_ids": new,
                "stored_response": sample.response,
            }

    n = len(samples)
    n_identical = sum(c.identical for c in comparisons)
    return SendReport(
        n_samples=n,
        n_identical=n_identical,
        identical_fraction=n_identical / n if n else None,
        n_tokens_compared=n_tokens,
        logprob_abs_diff_mean=total_diff / n_tokens if n_tokens else None,
        logprob_abs_diff_max=worst["abs_diff"] if worst else None,
        logprob_tol=logprob_tol,
        logprob_exceeding=[
            c.position
            for c in comparisons
            if c.logprob_abs_diff_max is not None and c.logprob_abs_diff_max > logprob_tol
        ],
        first_mismatch=first_mismatch,
        worst_logprob=worst,
        params=dataclasses.asdict(params),
        comparisons=comparisons,
    )
