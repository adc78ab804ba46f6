"""Trainer -> engine weight sync: the engine's path picks the module that runs it (plain functions over the
two actors' typed clients; `flows/iteration.py:sync_task` calls `push_weights`).

- object_store.py (hf engine, rollout.hf_weight_sync=object_store): host copies through Ray's object store,
  applied by the engine actor;
- disk.py (SGLang, disaggregated default): the engine actor writes an HF directory, the servers load it;
- tensor.py (colocated SGLang, or the hf engine with rollout.hf_weight_sync=tensor): CUDA IPC handles of
  flattened buckets, trainer rank and engine TP rank on one GPU;
- distributed.py (disaggregated SGLang): a weight-update group, the trainer broadcasts bucket by bucket;
- adapter.py (a LoRA run on SGLang with rollout.sglang.lora_sync=adapter): only the adapter, through SGLang's
  LoRA adapter API (from a directory with weight_sync=disk, from tensors otherwise).

The shared pieces below the flows (buckets, IPC serialization, copy plans, the process group, name mapping,
parity) are in tasks/sync/; the trainer's side is tasks/train/weight_sender.py, SGLang's side
tasks/rollout/sglang/weight_receiver.py.
"""

from __future__ import annotations

from rollflow.flows.config import RunConfig
from rollflow.flows.weight_sync.adapter import push_adapter
from rollflow.flows.weight_sync.disk import push_disk
from rollflow.flows.weight_sync.distributed import push_distributed
from rollflow.flows.weight_sync.object_store import push_object_store
from rollflow.flows.weight_sync.shared import SyncResult
from rollflow.flows.weight_sync.tensor import push_tensor
from rollflow.infra.clients import EngineClient, TrainerClient


def push_weights(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    if adapter_sync(cfg):
        return push_adapter(trainer, engine, weight_version)
    mode = engine.weight_sync_mode()
    if mode == "tensor":
        return push_tensor(cfg, trainer, engine, weight_version)
    if mode == "distributed":
        return push_distributed(cfg, trainer, engine, weight_version)
    if mode == "disk":
        return push_disk(trainer, engine, weight_version)
    return push_object_store(trainer, engine, weight_version)


def adapter_sync(cfg: RunConfig) -> bool:
    """The engine takes the LoRA adapter, not merged weights (config validation makes sure there is one)."""
    return cfg.rollout.engine == "sglang" and cfg.rollout.sglang.lora_sync == "adapter"
