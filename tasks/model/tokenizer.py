"""Tokenizers the engines and trainers share.

The embedded default is a character tokenizer (no download, no hub). Real HF tokenizers plug in
behind the same small protocol.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

CHAR_TOKENIZER_FILE = "rollflow_char_tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One id per character, plus pad/bos/eos. Unknown characters are an error, not silently dropped."""

    alphabet: str
    vocab_size: int

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        ids = []
        for ch in text:
            pos = self.alphabet.find(ch)
            if pos < 0:
                raise ValueError(f"CharTokenizer: character {ch!r} is not in the alphabet {self.alphabet!r}")
            ids.append(pos + 3)
        return ids

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i in (self.pad_token_id, self.bos_token_id, self.eos_token_id):
                continue
            pos = int(i) - 3
            out.append(self.alphabet[pos] if 0 <= pos < len(self.alphabet) else "\ufffd")
        return "".join(out)

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / CHAR_TOKENIZER_FILE
        path.write_text(json.dumps({"alphabet": self.alphabet, "vocab_size": self.vocab_size}))

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        data = json.loads((Path(directory) / CHAR_TOKENIZER_FILE).read_text())
        return cls(alphabet=data["alphabet"], vocab_size=int(data["vocab_size"]))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Our char tokenizer when the directory has one, else the directory's HF tokenizer."""
    model_dir = Path(model_dir)
    if (model_dir / CHAR_TOKENIZER_FILE).exists():
        return CharTokenizer.load(model_dir)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise RuntimeError("loading an HF tokenizer needs transformers: pip install rollflow") from exc
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def is_hf_tokenizer(tokenizer: Any) -> bool:
    """A transformers tokenizer (callable, with chat templates), not rollflow's char tokenizer."""
    return callable(tokenizer) and hasattr(tokenizer, "apply_chat_template")


def has_chat_template(tokenizer: Any) -> bool:
    return is_hf_tokenizer(tokenizer) and bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text of `messages` with the generation prompt (the assistant turn) opened."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            "data.apply_chat_template=true, but the model's tokenizer has no chat template (no 'chat_template' in "
            "tokenizer_config.json, no chat_template.jinja); set data.apply_chat_template=false or add the template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of one prompt, special tokens added exactly once.

    - chat messages (a list): rendered with the tokenizer's chat template, which already writes
      every special token (bos, role markers), then encoded with `add_special_tokens=False`;
    - text with an HF tokenizer: encoded with `add_special_tokens=True`, so the tokenizer's own
      post-processor adds its bos if that model uses one (Llama-3) and nothing if not (Qwen, SmolLM2);
    - text with rollflow's char tokenizer (whose `encode` adds nothing): bos + encode(text).
    """
    if isinstance(prompt, list):
        text = render_chat(tokenizer, prompt)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if is_hf_tokenizer(tokenizer):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + list(tokenizer.encode(prompt))


def decode_response(tokenizer: Any, ids: list[int]) -> str:
    """The text of generated ids without special tokens (the stop token, role markers)."""
    if is_hf_tokenizer(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids)
