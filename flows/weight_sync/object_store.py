"""Weight sync by Ray's object store (`object_store`: the hf engine, unless rollout.hf_weight_sync resolved to
tensor: placement=colocate on CUDA, where flows/weight_sync/tensor.py hands it the trainer's GPU buckets instead).

1. the trainer's rank 0 gathers its HF-named tensors (`TrainerClient.named_weights`: a Pending object ref,
   so the tensors go to the engine actor without passing through this process);
2. the engine actor applies them (`EngineClient.update_weights` -> `RolloutWorker.update_weights` ->
   `tasks/rollout/hf_engine.py:HFEngine.update_weights`): one copy into its resident parameters, planned
   once and replayed (`tasks/sync/copy_plan.py`, `tasks/sync/resident.py`).
"""

from __future__ import annotations

from rollflow.flows.weight_sync.shared import SyncResult
from rollflow.infra.clients import EngineClient, TrainerClient


def push_object_store(trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    version = engine.update_weights(trainer.named_weights(), weight_version)
    return SyncResult("object_store", version)
