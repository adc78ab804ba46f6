"""Per-tensor checksums of trainer and engine weights, compared after name mapping.

slime's `--check-weight-update-equal`, always on: a sync is not done until every engine tensor has
the trainer's bytes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Iterable

import torch

NameMap = Callable[[str], str]

# The fingerprint of a tensor: its raw bytes read as 64-bit words w_i, and two sums
#   h = sum_i w_i * k_i  (mod 2^64),  k_i = i*M + A  with M even and A odd,
# so every k_i is odd and thus invertible mod 2^64: changing any one word (any bit of it) always
# changes h, and unrelated changes cancel with probability ~2^-64 per sum. Wrapping int64 arithmetic
# is associative, so the value does not depend on the reduction order: CPU and GPU, one thread or
# many, give the same string. It runs where the tensor lives (no copy to host, no sha256 on the CPU):
# on an H200 ~10x cheaper than the bytes' size in memory traffic (docs/performance.md section 5).
_KEYS = ((0x9E3779B97F4A7C16, 0x2545F4914F6CDD1D), (0xC2B2AE3D27D4EB4E, 0x165667B19E3779F9))
_CHUNK_WORDS = 1 << 22  # 32 MB of int64 per temporary: bounded memory at any tensor size
_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words (zero-padded to a multiple of 8 bytes)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -raw.numel() % 8
    if pad or raw.storage_offset() % 8:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int64)


def _fingerprint_parts(tensor: torch.Tensor, ramps: dict) -> torch.Tensor:
    """[2] int64 on the tensor's device (not synchronised: the caller reads many at once)."""
    words = _words(tensor)
    device = words.device
    out = torch.zeros(2, dtype=torch.int64, device=device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        n = chunk.numel()
        if (device, n) not in ramps:
            ramps[(device, n)] = torch.arange(n, dtype=torch.int64, device=device)
        # sum w_i * (i*M + A) over the chunk = M * sum(w_j * j) + (start*M + A) * sum(w_j): both sums are shared
        # by the two keys, so each word is read twice whatever the number of keys.
        ramped = (chunk * ramps[(device, n)]).sum()
        total = chunk.sum()
        for j, (mul, add) in enumerate(_KEYS):
            out[j] += ramped * _signed(mul) + total * _signed(start * mul + add)
    return out


class _Fingerprints:
    """Fingerprints taken tensor by tensor as they come (kernels queued, nothing read back), read at the end with
    one host transfer per device. A tensor may be dropped once it is added: its parts no longer need it."""

    def __init__(self) -> None:
        self.ramps: dict = {}
        self.parts: dict[str, torch.Tensor] = {}
        self.labels: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.parts[name] = _fingerprint_parts(tensor, self.ramps)
        self.labels[name] = f"{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|"

    def read(self) -> dict[str, str]:
        by_device: dict[torch.device, list[str]] = defaultdict(list)
        for name, value in self.parts.items():
            by_device[value.device].append(name)
        values: dict[str, list[int]] = {}
        for names in by_device.values():
            stacked = torch.stack([self.parts[n] for n in names]).cpu().tolist()
            values.update(zip(names, stacked))
        return {name: label + "".join(f"{v & _MASK:016x}" for v in values[name]) for name, label in self.labels.items()}


def checksums(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """Fingerprint of every tensor (dtype, shape and every bit of its values), computed on its device.

    One host read per device for the whole dict, so a GPU model is checked without per-tensor syncs.
    """
    prints = _Fingerprints()
    for name, tensor in named.items():
        prints.add(name, tensor)
    return prints.read()


def checksums_of_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict[str, str]:
    """`checksums` of a model streamed bucket by bucket (a trainer's `export_buckets`): each bucket is
    fingerprinted where it was made and let go, so the whole model is never held twice, nor copied to the host.
    A name seen again keeps its last tensor, as a dict built from the same buckets would."""
    prints = _Fingerprints()
    for bucket in buckets:
        for name, tensor in bucket:
            prints.add(name, tensor)
    return prints.read()


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The fingerprint of one tensor (`checksums` of many is one host read per device)."""
    return checksums({"t": tensor})["t"]


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
        for label, names in (
            ("mismatch", self.mismatched),
            ("missing in engine", self.missing_in_engine),
            ("unexpected in engine", self.unexpected_in_engine),
        ):
            if names:
                return f"{label}: {names[0]}"
        return None

    def summary(self) -> str:
        if self.ok:
            return f"weight parity ok: {self.n_tensors} tensors equal"
        return (
            f"weight parity FAILED: {len(self.mismatched)} mismatched, {len(self.missing_in_engine)} missing, "
            f"{len(self.unexpected_in_engine)} unexpected of {self.n_tensors}; first {self.first_problem}"
        )

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
