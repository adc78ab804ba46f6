"""What every weight-sync path shares: its result, and the two settings it reads from RunConfig (the bucket
size and the dtype the engine holds)."""

from __future__ import annotations

import dataclasses

from rollflow.flows.config import RunConfig
from rollflow.infra.clients import WeightSyncMode


@dataclasses.dataclass(frozen=True)
class SyncResult:
    mode: WeightSyncMode
    weight_version: int
    buckets: int = 0
    nbytes: int = 0
    joined_group: bool = False
    sources: tuple[int, ...] = ()  # tensor path: the trainer rank whose payload each engine TP rank took

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def engine_dtype(cfg: RunConfig) -> str | None:
    """The dtype the engine holds when it differs from the trainer's (tensors are cast before sending)."""
    dtype = (cfg.rollout.sglang.dtype if cfg.rollout.engine == "sglang" else None) or cfg.rollout.dtype
    return dtype if dtype not in (None, "auto", cfg.train.dtype) else None


def bucket_bytes(cfg: RunConfig) -> int:
    return cfg.rollout.sglang.bucket_mb * 2**20
