"""What the rollout side's workers return to the orchestrator: small typed results, built here where the
values are known, and passed as they are (Ray pickles them); `rollflow.infra.clients` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """What the engine serves: backend ("hf", "sglang"), model and weight version; `logprobs`: how the
    samples' log-probs are taken ("engine", "teacher_forced"; None where the engine does not say)."""

    backend: str
    model: str
    weight_version: int
    logprobs: str | None = None

    @classmethod
    def of(cls, described: dict[str, str]) -> EngineDescription:
        """From a `RolloutEngine.describe()` (the engines' own small string dict)."""
        return cls(
            backend=str(described["backend"]),
            model=str(described["model"]),
            weight_version=int(described["weight_version"]),
            logprobs=described.get("logprobs"),
        )


@dataclasses.dataclass(frozen=True)
class EngineChecks:
    """Engine-side checks after a sync: names (or `weight_version@url`) that disagree, and notes on
    checks that could not run."""

    mismatched: list[str]
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class WeightOverwriteCheck:
    """The whole-tensor check (debug.check_weight_update_equal): did the sync overwrite every engine
    tensor with exactly the trainer's bytes, per server."""

    ok: bool
    mismatched: list[str]
    servers: list[dict[str, Any]]
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """Where an SGLang server runs (for reports and tests)."""

    index: int
    url: str
    pid: int | None
    gpu_ids: list[str]
    cuda_visible_devices: str | None
    command: list[str]
    log_path: str
    host: str
    node_ip: str
