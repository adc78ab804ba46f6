"""Per-tensor checksums of trainer and engine weights, compared after name mapping.

slime's `--check-weight-update-equal`, always on: a sync is not done until every engine tensor has
the trainer's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch

NameMap = Callable[[str], str]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and raw bytes (so a reshape or a cast is a mismatch too)."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checksums(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in named.items()}


@dataclasses.dataclass
class ParityReport:
    n_tensors: int
    mismatched: list[str]
    missing_in_engine: list[str]
    unexpected_in_engine: list[str]

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing_in_engine or self.unexpected_in_engine)

    @property
    def first_problem(self) -> str | None:
        for label, names in (("mismatch", self.mismatched), ("missing in engine", self.missing_in_engine),
                             ("unexpected in engine", self.unexpected_in_engine)):
            if names:
                return f"{label}: {names[0]}"
        return None

    def summary(self) -> str:
        if self.ok:
            return f"weight parity ok: {self.n_tensors} tensors equal"
        return (f"weight parity FAILED: {len(self.mismatched)} mismatched, {len(self.missing_in_engine)} missing, "
                f"{len(self.unexpected_in_engine)} unexpected of {self.n_tensors}; first {self.first_problem}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok, "first_problem": self.first_problem}


def compare(trainer: dict[str, str], engine: dict[str, str], name_map: NameMap | None = None) -> ParityReport:
    """Compare checksum maps; `name_map` turns a trainer name into the engine's name."""
    mapped = {(name_map(k) if name_map else k): v for k, v in trainer.items()}
    names = sorted(mapped)
    return ParityReport(
        n_tensors=len(names),
        mismatched=[n for n in names if n in engine and engine[n] != mapped[n]],
        missing_in_engine=[n for n in names if n not in engine],
        unexpected_in_engine=sorted(set(engine) - set(mapped)),
    )


def tensor_prefix(tensor: torch.Tensor, n: int) -> list[float]:
    """The first `n` values of the flattened tensor as Python floats (exact for fp32/bf16/fp16)."""
    return tensor.detach().reshape(-1)[:n].float().cpu().tolist()


def compare_prefixes(trainer: dict[str, list[float]], engine: dict[str, list[float]]) -> ParityReport:
    """Parity on the first values of every tensor, for engines that cannot export whole tensors.

    SGLang serves `/get_weights_by_name` with a truncated value list: comparing every tensor's head
    still catches unmapped names, swapped layers, a wrong pipeline-stage offset and dtype mistakes.
    """
    names = sorted(trainer)
    # `name@url`: a further server of the engine whose head differs from the first server's.
    other_servers = sorted(k for k in engine if "@" in k and k.split("@", 1)[0] in trainer)
    return ParityReport(
        n_tensors=len(names),
        mismatched=[n for n in names if n in engine and engine[n] != trainer[n]] + other_servers,
        missing_in_engine=[n for n in names if n not in engine],
        unexpected_in_engine=[],
    )
