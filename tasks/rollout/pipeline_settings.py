"""Settings of off-policy pipelining (RunConfig section `pipeline`): one-step-off async training,
partial rollouts and dynamic sampling. Cross-section rules (placement, engines) live in flows/config.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BUILTIN_FILTER = "rollflow.tasks.rollout.dynamic_sampling:reward_not_constant"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DynamicSamplingConfig(_Strict):
    """DAPO-style group filter with over-sampling (slime's --dynamic-sampling-filter-path and
    --over-sampling-batch-size): generate until the rollout has data.prompts_per_rollout groups that pass
    the filter, at most `max_tries` generate calls."""

    enabled: bool = Field(False, description="filter prompt groups and over-sample until the batch is full")
    filter_path: str = Field(
        BUILTIN_FILTER,
        description="'module:function' taking one group's samples (rewards set), returning True to "
        "keep it; default drops groups whose rewards are all equal (zero GRPO advantage)",
    )
    max_tries: int = Field(
        4,
        ge=1,
        le=64,
        description="generate calls per rollout at most (the first one included); "
        "a batch still short then is topped up with filtered groups",
    )

    @field_validator("filter_path")
    @classmethod
    def _dotted(cls, value: str) -> str:
        module, sep, name = value.partition(":")
        if not sep or not module or not name:
            raise ValueError(
                f"pipeline.dynamic_sampling.filter_path={value!r}: expected 'module:function', e.g. {BUILTIN_FILTER!r}"
            )
        return value


class PipelineConfig(_Strict):
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: generate -> train -> sync in sequence; N >= 1: while the trainer trains on rollout i "
        "the engine (weights i) generates the rollouts up to i+N, so rollout j is generated with weights "
        "j-N (j >= N) and no trained token is more than N weight versions behind the trainer (with "
        "partial rollouts, N >= 2, the queue is one rollout deep and continued tokens age up to N)",
    )
    partial_rollout: bool = Field(
        False,
        description="at sync time abort unfinished generations, keep their tokens and log-probs, and continue "
        "them in the next rollout under the new weights (per-token weight versions recorded)",
    )
    stale_policy: Literal["drop", "wait"] = Field(
        "drop",
        description="partial rollouts: a cut group whose next continuation would hold tokens more than "
        "max_staleness versions old is dropped (drop: marked `stale`, counted and logged, not trained) or finished "
        "at once under the weights it began with while the sync waits for it (wait: counted). Without partial "
        "rollouts the lock-step queue never exceeds max_staleness and the generator always waits",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)

    @property
    def pipelined(self) -> bool:
        return self.max_staleness > 0

    @property
    def depth(self) -> int:
        """Rollouts generated ahead of the trainer. In lock step: rollout j always comes from weights j - depth,
        whatever the timing, so a resumed run generates exactly what an uninterrupted one would. Partial
        rollouts keep one rollout ahead: their cut samples are continued one rollout later and age from there."""
        if not self.pipelined:
            return 0
        return 1 if self.partial_rollout else self.max_staleness
