"""`Conversation`: a multi-turn sample as it is built, token by token, with its turn boundaries.

Model turns keep the engine's own token ids and log-probs (loss mask 1); tool and user turns are
spliced in as token ids with loss mask 0 and log-prob 0. `to_sample` writes the turns into
`Sample.metadata["turns"]` (offsets into the response tokens, end exclusive), which `rollflow show`
renders and the turn-level rewards (tasks/rollout/feedback.py) are credited by.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from rollflow.artifacts.sample import Sample, Status
from rollflow.tasks.model.tokenizer import decode_response, is_hf_tokenizer
from rollflow.tasks.rollout.engine import GenerationOutput, SamplingParams
from rollflow.tasks.rollout.prompts import PromptItem

TURNS_KEY = "turns"
Role = Literal["assistant", "tool", "user"]


@dataclasses.dataclass
class Turn:
    role: Role
    start: int  # offset of the turn's first token in the response tokens
    end: int  # exclusive
    text: str
    finish_reason: Optional[str] = None  # assistant turns: stop | length | abort
    name: Optional[str] = None  # tool turns: the tool called
    arguments: Optional[str] = None
    ok: Optional[bool] = None  # tool turns: False when the tool raised or timed out
    error: Optional[str] = None
    reward: Optional[float] = None  # turn-level reward (conversation feedback), None = not scored

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Turn":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def turns_of(sample: Sample) -> list[Turn]:
    """The sample's turns (empty for a single-turn sample)."""
    return [Turn.from_dict(t) for t in sample.metadata.get(TURNS_KEY) or []]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of spliced text, without special tokens (no bos in the middle of a conversation)."""
    if is_hf_tokenizer(tokenizer):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer.encode(text))


class Conversation:
    """Prompt ids plus turns; `max_total_tokens` caps the response (all turns, model and spliced)."""

    def __init__(self, prompt_ids: list[int], tokenizer: Any, *, max_total_tokens: int | None = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.tokenizer = tokenizer
        self.max_total_tokens = max_total_tokens
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.turns: list[Turn] = []
        self.truncated = False
        self.aborted = False

    @property
    def ids(self) -> list[int]:
        """Everything so far: what the next model turn continues."""
        return self.prompt_ids + self.response_ids

    def remaining(self) -> int | None:
        if self.max_total_tokens is None:
            return None
        return max(0, self.max_total_tokens - len(self.response_ids))

    def sampling(self, params: SamplingParams) -> SamplingParams | None:
        """`params` with max_new_tokens cut to the token budget left; None (and truncated) when none is left."""
        left = self.remaining()
        if left is None:
            return params
        if left == 0:
            self.truncated = True
            return None
        return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, left))

    def add_model(self, out: GenerationOutput) -> Turn:
        """A model turn: the engine's ids and log-probs as they came (loss mask 1)."""
        if len(out.log_probs) != len(out.response_ids):
            raise ValueError(f"engine output has {len(out.response_ids)} tokens but {len(out.log_probs)} log-probs")
        turn = self._append(
            list(out.response_ids), list(out.log_probs), 1, role="assistant", finish_reason=out.finish_reason
        )
        if out.finish_reason == "abort":
            self.aborted = True
        return turn

    def add_text(self, role: Role, text: str, **fields: Any) -> Turn:
        """A tool or user turn from text (encoded without special tokens; loss mask 0)."""
        return self.add_tokens(role, encode_text(self.tokenizer, text), text=text, **fields)

    def add_tokens(self, role: Role, ids: list[int], *, text: str | None = None, **fields: Any) -> Turn:
        """A tool or user turn from token ids (loss mask 0), cut at the token budget (then truncated)."""
        ids = [int(t) for t in ids]
        left = self.remaining()
        if left is not None and len(ids) > left:
            ids, text, self.truncated = ids[:left], None, True
        return self._append(ids, [0.0] * len(ids), 0, role=role, text=text, **fields)

    def _append(
        self, ids: list[int], log_probs: list[float], mask: int, *, role: Role, text: str | None = None, **fields: Any
    ) -> Turn:
        start = len(self.response_ids)
        self.response_ids += ids
        self.log_probs += [float(x) for x in log_probs]
        self.loss_mask += [mask] * len(ids)
        turn = Turn(
            role=role,
            start=start,
            end=len(self.response_ids),
            text=decode_response(self.tokenizer, ids) if text is None else text,
            **fields,
        )
        self.turns.append(turn)
        return turn

    def last_assistant_text(self) -> str:
        for turn in reversed(self.turns):
            if turn.role == "assistant":
                return turn.text
        return ""

    def status(self) -> Status:
        if self.aborted:
            return Status.ABORTED
        last = next((t for t in reversed(self.turns) if t.role == "assistant"), None)
        if self.truncated or (last is not None and last.finish_reason == "length"):
            return Status.TRUNCATED
        return Status.COMPLETED

    def to_sample(self, item: PromptItem, *, status: Status | None = None, **metadata: Any) -> Sample:
        """The whole conversation as one Sample (group/index/weight version are set by the runner)."""
        return Sample(
            group_index=0,
            index=0,
            prompt=item.prompt,
            tokens=self.prompt_ids + self.response_ids,
            response=decode_response(self.tokenizer, self.response_ids),
            response_length=len(self.response_ids),
            loss_mask=list(self.loss_mask),
            rollout_log_probs=list(self.log_probs),
            label=item.label,
            status=status or self.status(),
            metadata={**item.metadata, **metadata, TURNS_KEY: [t.to_dict() for t in self.turns]},
        )
