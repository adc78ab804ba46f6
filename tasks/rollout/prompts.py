"""`PromptItem`: one prompt to generate from, whatever its source (the built-in addition task,
a jsonl/parquet dataset, eval sets) and its reference label."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PromptItem:
    prompt: Any  # text, or chat messages [{"role": ..., "content": ...}] (rendered by the chat template)
    label: str | None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
