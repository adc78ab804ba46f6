"""Integrity digests of payload files: the hash a manifest records for each file, by name.

New artifacts record xxh3-128: it proves the bytes are the ones written (partial copies, disk errors, hand
edits, a racing writer's payload) at memory speed, where sha256 cost more than reading the file itself. It is
not a defence against someone who can write the store: whoever can replace a payload can replace its
manifest too, so a cryptographic hash buys nothing there. Manifests written before schema 3 record sha256,
which is still verified as sha256.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import xxhash

XXH3_128 = "xxh3_128"
SHA256 = "sha256"
# What a writer records; readers verify whichever one an entry holds.
INTEGRITY_ALGORITHM = XXH3_128
HEX_LENGTHS = {XXH3_128: 32, SHA256: 64}
_HEX = {name: re.compile(rf"^[0-9a-f]{{{n}}}$") for name, n in HEX_LENGTHS.items()}


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    if algorithm == XXH3_128:
        return xxhash.xxh3_128()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(sorted(HEX_LENGTHS))})")


def hexdigest(data: bytes | memoryview, algorithm: str = INTEGRITY_ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def is_hex_digest(value: str, algorithm: str) -> bool:
    return bool(_HEX[algorithm].match(value))
