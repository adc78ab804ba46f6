"""What the train side's workers return to the orchestrator: small typed results, built here where the
values are known, and passed as they are (Ray pickles them); `rollflow.infra.clients` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainerDescription:
    """One trainer rank: its backend and data-parallel placement."""

    backend: str
    rank: int
    world_size: int
    dp_backend: str | None
    sharded: bool = False  # no rank holds the whole state: weight reads and checkpoints involve every rank


@dataclasses.dataclass(frozen=True)
class IpcBucket:
    """One bucket of the tensor (CUDA IPC) path: a serialized payload per engine TP rank."""

    payloads: list[str]
    names: list[str]
    nbytes: int
    gpu: str | None = None  # the GPU the trainer rank made it on (its CUDA_VISIBLE_DEVICES), None without
    last: bool = False  # the sync's last bucket


@dataclasses.dataclass(frozen=True)
class BroadcastBucket:
    """One bucket of the broadcast (distributed) path: each tensor's name, dtype and shape in broadcast order
    (what SGLang's /update_weights_from_distributed takes), and whether it is the sync's last."""

    metas: list[dict[str, Any]]
    last: bool
