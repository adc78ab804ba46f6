"""Weight sync through a directory (`disk`: SGLang's `/update_weights_from_disk`; disaggregated by default).

1. the trainer's rank 0 gathers its HF-named tensors (`TrainerClient.named_weights`: a Pending object ref,
   handed to the engine actor through Ray's object store, never through this process);
2. the engine actor (`EngineClient.update_weights` -> `RolloutWorker.update_weights` ->
   `tasks/rollout/sglang/weight_receiver.py:WeightReceiver.update_weights`) writes them as an HF safetensors
   directory beside the model's config files (`tasks/rollout/sglang/hf_checkpoint.py:write_hf_checkpoint`,
   atomically: a temp sibling renamed), keeping the newest two versions;
3. every server loads that directory (`WeightReceiver.update_weights_from_disk`: `POST
   /update_weights_from_disk` with the new weight_version), so the servers must be able to read it.
"""

from __future__ import annotations

from rollflow.flows.weight_sync.shared import SyncResult
from rollflow.infra.clients import EngineClient, TrainerClient


def push_disk(trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    version = engine.update_weights(trainer.named_weights(), weight_version)
    return SyncResult("disk", version)
