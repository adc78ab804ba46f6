"""Typed, validated settings of the rollout side (sections of flows' RunConfig)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tasks.rollout.addition import PromptItem, addition_prompts
from tasks.rollout.engine import SamplingParams
from tasks.rollout.sglang_config import SGLangConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    task: Literal["addition"] = "addition"
    digits: int = Field(3, ge=1, le=9)
    prompts_per_rollout: int = Field(256, ge=1, description="prompts (groups) per rollout")
    eval_prompts: int = Field(256, ge=1)
    seed: int = 0


class RolloutConfig(_Strict):
    engine: Literal["hf", "sglang"] = "hf"
    n_samples_per_prompt: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = no top-k (full softmax)")
    max_new_tokens: int = Field(5, ge=1)
    reward: str = Field("addition", description="built-in name or dotted path 'pkg.mod:fn'")
    reward_key: Optional[str] = None
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    device: str = "cpu"
    threads: int = Field(1, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    static_cache: Union[bool, Literal["auto"]] = Field(
        "auto", description="hf engine: transformers' static KV cache with its compiled decode step; "
                            "auto = on for CUDA, off on CPU")
    seed: int = 0
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="engine='sglang' only: server settings")

    def sampling(self, rollout_id: int, *, greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed * 1_000_003 + rollout_id,
        )


EVAL_SEED_OFFSET = 1_000_000


def prompts_for(data: DataConfig, rollout_id: int, split: str = "train") -> list[PromptItem]:
    """The prompts of one rollout, a pure function of (data config, rollout id, split)."""
    if split == "eval":
        return addition_prompts(data.eval_prompts, seed=data.seed + EVAL_SEED_OFFSET, digits=data.digits)
    return addition_prompts(data.prompts_per_rollout, seed=data.seed + rollout_id, digits=data.digits)
