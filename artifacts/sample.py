"""The `Sample`: one prompt + one response, the unit every artifact stores.

Field names follow slime's `Sample` so its debug dumps import losslessly (docs/architecture.md section 5.1).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Union

Prompt = Union[str, list[dict[str, Any]]]
Reward = Union[float, dict[str, Any], None]


class Status(str, enum.Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @classmethod
    def parse(cls, value: Any) -> "Status":
        """Accept our values, slime's enum names/values ("COMPLETED", "Status.TRUNCATED") and enums."""
        if isinstance(value, Status):
            return value
        raw = getattr(value, "value", value)
        text = str(raw).strip()
        if text.lower().startswith("status."):
            text = text[len("status.") :]
        for member in cls:
            if text.lower() in (member.value, member.name.lower()):
                return member
        allowed = ", ".join(m.value for m in cls)
        raise ValueError(f"Sample.status: unknown status {value!r}; expected one of {allowed}")


@dataclasses.dataclass
class Sample:
    group_index: int
    index: int
    prompt: Prompt
    tokens: list[int]  # prompt + response token ids
    response: str
    response_length: int
    loss_mask: list[int]  # len == response_length
    rollout_log_probs: list[float]  # len == response_length
    reward: Reward = None
    label: str | None = None
    status: Status = Status.COMPLETED
    weight_version: int = 0
    reward_key: str | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # MoE routing replay: top-k expert ids [len(tokens) - 1][layers][k] (slime's rollout_routed_experts).
    routed_experts: list[list[list[int]]] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as one float. A dict reward is read at `reward_key` (the run's `rollout.reward_key`, or
        `rollout.eval_reward_key` for eval, as slime's `--reward-key`), else at the sample's own `reward_key`."""
        if self.reward is None:
            raise ValueError(f"Sample (group {self.group_index}, index {self.index}) has no reward yet")
        return reward_value(
            self.reward, reward_key or self.reward_key, where=f"Sample (group {self.group_index}, index {self.index})"
        )

    def validate(self) -> None:
        """Raise ValueError naming the field when the sample breaks the data contract."""
        where = f"Sample (group {self.group_index}, index {self.index})"
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"{where}: response_length={self.response_length} outside 0..len(tokens)={len(self.tokens)}"
            )
        if len(self.loss_mask) != self.response_length:
            raise ValueError(f"{where}: len(loss_mask)={len(self.loss_mask)} != response_length={self.response_length}")
        if len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"{where}: len(rollout_log_probs)={len(self.rollout_log_probs)} "
                f"!= response_length={self.response_length}"
            )
        if any(isinstance(x, float) and math.isnan(x) for x in self.rollout_log_probs):
            raise ValueError(f"{where}: rollout_log_probs contains NaN")
        Status.parse(self.status)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["status"] = Status.parse(self.status).value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Build a Sample; unknown keys are kept in metadata so nothing is lost."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        metadata = dict(known.get("metadata") or {})
        if extra:
            metadata.setdefault("extra_fields", {}).update(extra)
        known["metadata"] = metadata
        known["status"] = Status.parse(known.get("status", Status.COMPLETED))
        for key in ("tokens", "loss_mask"):
            known[key] = [int(x) for x in known.get(key) or []]
        known["rollout_log_probs"] = [float(x) for x in known.get("rollout_log_probs") or []]
        return cls(**known)


def reward_value(reward: Any, reward_key: str | None, *, where: str = "Sample") -> float:
    """slime's `Sample.get_reward_value`: a float as is, a dict at `reward_key` (which must be set and present)."""
    if isinstance(reward, dict):
        if not reward_key:
            raise ValueError(
                f"{where}: reward is a dict with keys {sorted(reward)} but no reward key is set: set "
                "rollout.reward_key (and rollout.eval_reward_key for eval) to one of them, as slime's --reward-key"
            )
        if reward_key not in reward:
            raise ValueError(
                f"{where}: reward key {reward_key!r} is not in the dict reward (keys {sorted(reward)}); "
                "set rollout.reward_key to one of them"
            )
        return float(reward[reward_key])
    return float(reward)
