"""rollout.function and rollout.agent: the rollout-function settings (tasks/rollout/agent.py)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from rollflow.tasks.rollout.agent import AgentLimits


class AgentConfig(BaseModel):
    """Limits of a rollout function's conversations (used when rollout.function is not 'single_turn')."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_turns: int = Field(
        4,
        ge=1,
        description="model turns per conversation (a tool loop that still calls a tool after them ends truncated)",
    )
    max_total_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="cap on a conversation's response tokens, model and spliced tool/user tokens "
        "together; a longer one is cut and marked truncated (None = no cap)",
    )
    tool_timeout_s: float = Field(5.0, gt=0, description="per tool call; a timeout is a failed tool turn")
    sample_timeout_s: Optional[float] = Field(
        600.0,
        gt=0,
        description="per rollout-function call, time waiting for batched engine calls included; a "
        "timeout makes that slot a failed sample (None = no limit)",
    )

    def limits(self) -> AgentLimits:
        return AgentLimits(
            max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens,
            tool_timeout_s=self.tool_timeout_s,
            sample_timeout_s=self.sample_timeout_s,
        )


class FeedbackConfig(BaseModel):
    """rollout.reward='conversation_feedback': a judge scores each assistant turn from the next turn."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    judge: Optional[str] = Field(
        None,
        description="dotted path 'pkg.mod:judge' of judge(JudgeRequest) -> number or "
        "'good'/'bad'/'neutral' (sync or async; tasks/rollout/feedback.py)",
    )
    votes: int = Field(3, ge=1, description="judgements per turn; the majority verdict is the turn's reward")
