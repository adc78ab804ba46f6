"""Trainer -> engine weight sync, by the engine's path (plain functions over the two actors' clients;
`flows/iteration.py:sync_task` calls `push_weights`).

- object_store (hf engine) and disk (SGLang `/update_weights_from_disk`): the engine actor takes the
  trainer's tensors through Ray's object store and applies them itself;
- tensor (colocated SGLang): per bucket, every engine TP rank takes a flattened bucket made by the
  trainer rank on its own GPU (CUDA IPC handles of that rank's tensors: a server sees only its own
  GPUs, so it cannot open handles to another GPU) and the engine actor posts them; no tensor bytes
  travel between processes;
- distributed (disaggregated SGLang): the trainer joins (once) a weight-update group with every engine
  TP rank, then per bucket the engine posts the metadata while the trainer broadcasts the tensors.

Tensor and distributed updates run inside a weight-update session on every server (SGLang 0.5.23
refuses them otherwise): opened before the first bucket, closed after the last.
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
    sources: tuple[int, ...] = ()  # tensor path: the trainer rank whose payload each engine TP rank took

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


class IpcPlacementError(RuntimeError):
    """An engine TP rank sits on a GPU where no trainer rank runs (colocated tensor sync cannot reach it)."""


def payload_sources(n_engine_ranks: int, trainer_gpus: list[str | None],
                    engine_gpus: list[str] | None = None) -> list[int]:
    """For each engine TP rank (servers in order, their TP ranks in order), the trainer rank whose
    payload it takes: the rank on the same GPU when both sides' GPUs are known; else rank r for
    engine rank r (as many trainer ranks as engine ranks); else rank 0 for all (one trainer rank:
    CPU tensors travel by value, and on a GPU one engine of tp 1 shares rank 0's GPU)."""
    if engine_gpus and all(g is not None for g in trainer_gpus):
        if len(engine_gpus) != n_engine_ranks:
            raise ValueError(f"{len(engine_gpus)} engine GPUs for {n_engine_ranks} engine TP ranks")
        by_gpu = {g: r for r, g in enumerate(trainer_gpus)}
        missing = [f"engine TP rank {i} on GPU {g}" for i, g in enumerate(engine_gpus) if g not in by_gpu]
        if missing:
            raise IpcPlacementError(
                f"{', '.join(missing)}: no trainer rank runs there (trainer GPUs {trainer_gpus}); weight_sync=tensor "
                "needs a trainer rank on every engine GPU (placement=colocate with trainer_gpus = num_engines x "
                "gpus_per_engine), else use weight_sync=distributed or disk")
        return [by_gpu[g] for g in engine_gpus]
    if len(trainer_gpus) == n_engine_ranks:
        return list(range(n_engine_ranks))
    if len(trainer_gpus) == 1:
        return [0] * n_engine_ranks
    raise IpcPlacementError(f"{len(trainer_gpus)} trainer ranks for {n_engine_ranks} engine TP ranks: weight_sync="
                            "tensor pairs them one to one (or one trainer rank for all)")


def engine_gpus(cfg: RunConfig) -> list[str] | None:
    """The GPUs of every engine TP rank, servers in order (None: on CPU, or servers rollflow did not launch)."""
    if cfg.resources.num_gpus <= 0 or cfg.rollout.sglang.urls:
        return None
    from rollflow.flows.group import WorkerGroup

    group = WorkerGroup.for_run(cfg)
    gpus = [g for k in range(cfg.resources.num_engines) for g in group.server(k).info().gpu_ids]
    return [str(g) for g in gpus] or None


def push_ipc(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    """Bucket by bucket, inside one weight-update session: each trainer rank that feeds an engine TP rank
    makes (and holds) its flattened bucket, the engine loads them all, next bucket. On GPUs the tensors
    go to each rank's own device first, so they travel as IPC handles of that GPU."""
    from rollflow.tasks.sync.ipc import FLATTENED_BUCKET

    sources = payload_sources(engine.payloads_per_bucket(), trainer.gpu_ids(), engine_gpus(cfg))
    copies = {r: sources.count(r) for r in sorted(set(sources))}
    trainer.ipc_begin_ranks(bucket_bytes(cfg), copies, engine_dtype(cfg), flattened=True)
    version, nbytes, n = weight_version - 1, 0, 0
    try:
        engine.begin_weight_update()
        last = False
        while not last:
            made = trainer.ipc_next_ranks(list(copies))
            last = made[sources[0]].last
            nbytes += made[sources[0]].nbytes
            taken = {r: 0 for r in copies}
            payloads = []
            for r in sources:
                payloads.append(made[r].payloads[taken[r]])
                taken[r] += 1
            version = engine.apply_serialized_bucket(payloads, last, weight_version, FLATTENED_BUCKET)
            n += 1
        engine.end_weight_update()
    finally:
        trainer.ipc_end_ranks(list(copies))
    return SyncResult("tensor", version, n, nbytes, sources=tuple(sources))


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
    trainer.weight_buckets_begin(bucket_bytes(cfg), engine_dtype(cfg))
    version, nbytes, n = weight_version - 1, 0, 0
    engine.begin_weight_update()
    last = False
    while not last:  # the trainer makes each bucket as it is sent (a sharded trainer: its ranks together)
        metas, last = trainer.next_weight_bucket()
        receiving = engine.receive_weight_bucket(metas, last, weight_version, name)
        nbytes += trainer.broadcast_weight_bucket("cuda" if backend == "nccl" else None)
        version = receiving.result()
        n += 1
    engine.end_weight_update()
    return SyncResult("distributed", version, n, nbytes, joined)
