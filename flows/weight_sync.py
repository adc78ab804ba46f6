"""Trainer -> engine weight sync, by the engine's path (plain functions over the two actors' clients;
`flows/iteration.py:sync_task` calls `push_weights`).

- object_store (hf engine) and disk (SGLang `/update_weights_from_disk`): the engine actor takes the
  trainer's tensors through Ray's object store and applies them itself;
- tensor (colocated SGLang): per bucket, the trainer serializes CUDA IPC handles of its own GPU
  tensors and the engine actor posts them; no tensor bytes travel between processes;
- distributed (disaggregated SGLang): the trainer joins (once) a weight-update group with every engine
  TP rank, then per bucket the engine posts the metadata while the trainer broadcasts the tensors.
"""

from __future__ import annotations

import dataclasses

from rollflow.flows.config import RunConfig
from rollflow.infra.clients import EngineClient, TrainerClient, WeightSyncMode


@dataclasses.dataclass(frozen=True)
class SyncResult:
    mode: WeightSyncMode
    weight_version: int
    buckets: int = 0
    nbytes: int = 0
    joined_group: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def group_name(cfg: RunConfig) -> str:
    return f"rollflow-{cfg.run}"


def engine_dtype(cfg: RunConfig) -> str | None:
    """The dtype the engine holds when it differs from the trainer's (tensors are cast before sending)."""
    dtype = (cfg.rollout.sglang.dtype if cfg.rollout.engine == "sglang" else None) or cfg.rollout.dtype
    return dtype if dtype not in (None, "auto", cfg.train.dtype) else None


def bucket_bytes(cfg: RunConfig) -> int:
    return cfg.rollout.sglang.bucket_mb * 2**20


def push_weights(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    mode = engine.weight_sync_mode()
    if mode == "tensor":
        return push_ipc(cfg, trainer, engine, weight_version)
    if mode == "distributed":
        return push_distributed(cfg, trainer, engine, weight_version)
    version = engine.update_weights(trainer.named_weights(), weight_version)
    return SyncResult(mode, version)


def push_ipc(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    """Bucket by bucket: the trainer serializes (and holds) a bucket, the engine loads it, next one.
    On GPUs the tensors go to the trainer's own device first, so they travel as IPC handles."""
    copies = engine.payloads_per_bucket()
    n = trainer.ipc_begin(bucket_bytes(cfg), copies, engine_dtype(cfg))
    version, nbytes = weight_version - 1, 0
    try:
        for i in range(n):
            bucket = trainer.ipc_next()
            nbytes += bucket.nbytes
            version = engine.apply_serialized_bucket(bucket.payloads, i == n - 1, weight_version)
    finally:
        trainer.ipc_end()
    return SyncResult("tensor", version, n, nbytes)


def push_distributed(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    """SGLang's order: init group (engines and trainer concurrently) once; per bucket, the engines'
    /update_weights_from_distributed runs while the trainer broadcasts the same tensors in order."""
    name, backend = group_name(cfg), cfg.rollout.sglang.weight_sync_backend
    joined = False
    if not engine.in_weight_group(name):
        # A fresh or restarted engine: the trainer (rank 0) and every engine rank meet again.
        address, port = trainer.weight_group_address()
        world = engine.weight_group_world_size()
        joining = engine.join_weight_group(address, port, name, backend)
        trainer.join_weight_group(address, port, world, name, backend)
        joining.result()
        joined = True
    plan = trainer.weight_bucket_plan(bucket_bytes(cfg), engine_dtype(cfg))
    version, nbytes = weight_version - 1, 0
    for i, metas in enumerate(plan):
        receiving = engine.receive_weight_bucket(metas, i == len(plan) - 1, weight_version, name)
        nbytes += trainer.broadcast_weight_bucket(i, "cuda" if backend == "nccl" else None)
        version = receiving.result()
    return SyncResult("distributed", version, len(plan), nbytes, joined)
