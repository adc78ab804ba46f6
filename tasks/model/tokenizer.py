"""Tokenizers the engines and trainers share.

The embedded default is a character tokenizer (no download, no hub). Real HF tokenizers plug in
behind the same small protocol.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

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
