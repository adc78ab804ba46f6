"""The trainer side of stage replay: one iteration retrained from its own starting checkpoint.

Module-level functions that run next to a `TrainWorker`'s state (the flow's `ActorRunner`, or in process),
so the weights never leave the worker; only metrics, step statistics and per-sample records come back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import ArtifactRef
from rollflow.tasks.train.checkpoint import CheckpointError, load_checkpoint
from rollflow.tasks.train.records import SampleRecords, read_records


@dataclasses.dataclass
class ReplayedIteration:
    metrics: dict[str, float]
    steps: list[dict[str, float]]  # unprefixed, in optimizer-step order
    records: SampleRecords


def retrain_iteration(
    worker: Any, ref: ArtifactRef, *, source_root: str, source_run: str, record_uri: str
) -> ReplayedIteration:
    """Train on rollout `ref.rollout_id` from the state the run trained it from: checkpoint `rollout_id` (written
    after iteration `rollout_id`), or the worker's initial state for rollout 0 (the run's trainer started from
    the same model, seed and optimizer). `record_uri`: scratch file for the replay's records."""
    rollout_id = ref.rollout_id
    if rollout_id == 0:
        state = worker._initial_state
        if state is None:
            raise NotImplementedError("stage replay of a sharded trainer (megatron tp/pp > 1) is not supported")
    else:
        try:
            state = load_checkpoint(source_root, source_run, rollout_id, storage_options=worker.storage_options)
        except CheckpointError as exc:
            raise CheckpointError(
                f"stage replay of rollout {rollout_id} starts from checkpoint {rollout_id} of run {source_run!r}, "
                f"which is not committed ({exc}); runs with checkpoint_every > 1 replay only the rollouts right "
                "after a checkpoint"
            ) from exc
    worker.backend.load_checkpoint_bytes(state)
    metrics = worker.train_on_artifact(ref, record_uri=record_uri)
    fs, path = open_fs(record_uri, worker.storage_options)
    with fs.open(path, "rb") as f:
        records = read_records(f.read())
    return ReplayedIteration(metrics=dict(metrics), steps=worker.train_steps(), records=records)
