"""A LoRA run's adapter into SGLang's LoRA adapter API (`rollout.sglang.lora_sync=adapter`; model.lora set).

The servers keep the base weights (launched with --enable-lora, rank and target modules from model.lora) and
only the adapter travels, a few MiB instead of the whole model:

1. the trainer's rank 0 hands out its adapter in PEFT form (`TrainerClient.lora_adapter` ->
   `tasks/train/lora_backend.py:LoraTorchBackend.lora_adapter`: the A and B tensors under PEFT's saved names
   plus PEFT's adapter_config), a Pending object ref that goes to the engine actor through Ray's object store;
2. the engine actor (`EngineClient.update_lora_adapter` -> `RolloutWorker.update_lora_adapter` ->
   `tasks/rollout/sglang/lora_receiver.py:LoraReceiver.update_lora_adapter`) loads it on every server under
   `rollflow-v{version}` (weight_sync=disk: `/load_lora_adapter` from a directory the servers must read;
   tensor / distributed: `/load_lora_adapter_from_tensors`, one serialized copy per TP rank, by value), makes
   later generate requests name it, unloads the previous adapter and sets the servers' weight_version.
"""

from __future__ import annotations

from rollflow.flows.weight_sync.shared import SyncResult
from rollflow.infra.clients import EngineClient, TrainerClient


def push_adapter(trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    version = engine.update_lora_adapter(trainer.lora_adapter(), weight_version)
    return SyncResult("lora_adapter", version)
