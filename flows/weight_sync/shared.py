"""What every weight-sync path shares: its result, the two settings it reads from RunConfig (the bucket
size and the dtype the engine holds), and the weight-update session around the tensor and distributed paths."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

from rollflow.flows.config import RunConfig
from rollflow.infra.clients import EngineClient, WeightSyncMode

log = logging.getLogger(__name__)

# How long ending a session waits after a failed sync. The engine actor may still be inside the failed
# bucket's receive (a broadcast that never comes), and its end call queues behind it: the sync's own error
# must not wait for that. The queued end still runs, before any later call of the serial actor.
END_AFTER_FAILURE_S = 60.0


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


@contextlib.contextmanager
def weight_update_session(engine: EngineClient) -> Iterator[None]:
    """Every server's session open around the body and ended afterwards, also when the body fails. On
    SGLang an end after a failed update is what the server needs: it finalizes the runners (re-packs
    quantized weights, `post_load_weights` when nothing loaded) and closes the session, so the served
    model is whole in layout and the next sync can begin; the failed update recorded no weight_version,
    so parity still names the engine stale. A session left open would refuse that next begin."""
    engine.begin_weight_update()
    failed = True
    try:
        yield
        failed = False
    finally:
        if not failed:
            engine.end_weight_update()
        else:
            try:
                engine.end_weight_update(timeout=END_AFTER_FAILURE_S)
            except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to raise
                log.warning("ending the weight-update session after a failed sync: %s: %s", type(exc).__name__, exc)
