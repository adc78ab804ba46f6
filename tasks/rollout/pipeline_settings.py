"""Settings of off-policy pipelining (RunConfig section `pipeline`): one-step-off async training,
partial rollouts and dynamic sampling. Cross-section rules (placement, engines) live in flows/config.py."""

from __future__ import annotations

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
        description="0: generate -> train -> sync in sequence; k >= 1: the engine generates rollout i+1 "
        "while the trainer trains on rollout i (one step off), and no trained token is more "
        "than k weight versions behind the trainer (partial rollouts need k >= 2)",
    )
    partial_rollout: bool = Field(
        False,
        description="at sync time abort unfinished generations, keep their tokens and log-probs, and continue "
        "them in the next rollout under the new weights (per-token weight versions recorded)",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)

    @property
    def pipelined(self) -> bool:
        return self.max_staleness > 0
