"""Weight sync by CUDA IPC handles (`tensor`: colocated engines, trainer ranks and engine TP ranks share GPUs:
SGLang servers, or the in-process hf engine with rollout.hf_weight_sync=tensor).

Per bucket, every engine TP rank takes a flattened bucket made by the trainer rank on its own GPU (a server
sees only its own GPUs, so it cannot open handles to another GPU), and the engine actor posts them; no tensor
bytes travel between processes. Top to bottom:

1. pair each engine TP rank with the trainer rank on its GPU (`payload_sources`; the engines' GPUs from
   their server actors, `engine_gpus`);
2. each feeding trainer rank starts a bucket stream (`TrainerClient.ipc_begin_ranks` -> `TrainWorker.ipc_begin`
   -> `tasks/train/weight_sender.py:WeightSender.ipc_begin`), in the engine's dtype;
3. inside one weight-update session on every server (`EngineClient.begin_weight_update` ...
   `end_weight_update`: SGLang 0.5.23 refuses tensor updates outside one), bucket by bucket until the one
   marked last: the ranks make and hold their next bucket (`ipc_next_ranks` -> `WeightSender.ipc_next`, which
   serializes it with `tasks/sync/ipc.py`: one uint8 tensor + SGLang's per-tensor metadata, as IPC handles),
   and the engine posts one payload per TP rank (`EngineClient.apply_serialized_bucket` ->
   `tasks/rollout/sglang/weight_receiver.py:WeightReceiver.apply_serialized_bucket`: `POST
   /update_weights_from_tensor`, load_format flattened_bucket; the last bucket sets the weight_version);
4. the session ends and the ranks drop their streams (`ipc_end_ranks`), also when a step failed
   (`shared.weight_update_session` says why ending after a failure is right).
"""

from __future__ import annotations

from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup
from rollflow.flows.weight_sync.shared import SyncResult, bucket_bytes, engine_dtype, weight_update_session
from rollflow.infra.clients import EngineClient, TrainerClient
from rollflow.tasks.sync.ipc import FLATTENED_BUCKET


class IpcPlacementError(RuntimeError):
    """An engine TP rank sits on a GPU where no trainer rank runs (colocated tensor sync cannot reach it)."""


def payload_sources(
    n_engine_ranks: int, trainer_gpus: list[str | None], engine_gpus: list[str] | None = None
) -> list[int]:
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
                "gpus_per_engine), else use weight_sync=distributed or disk"
            )
        return [by_gpu[g] for g in engine_gpus]
    if len(trainer_gpus) == n_engine_ranks:
        return list(range(n_engine_ranks))
    if len(trainer_gpus) == 1:
        return [0] * n_engine_ranks
    raise IpcPlacementError(
        f"{len(trainer_gpus)} trainer ranks for {n_engine_ranks} engine TP ranks: weight_sync="
        "tensor pairs them one to one (or one trainer rank for all)"
    )


def engine_gpus(cfg: RunConfig, engine: EngineClient) -> list[str] | None:
    """The GPUs of every engine TP rank, servers in order (None: on CPU, or servers rollflow did not launch). The
    in-process hf engine is one rank on its actor's GPU."""
    if cfg.rollout.engine == "hf":
        gpu = engine.visible_gpu()
        return [gpu] if gpu is not None else None
    if cfg.resources.num_gpus <= 0 or cfg.rollout.sglang.urls:
        return None
    group = WorkerGroup.for_run(cfg)
    gpus = [g for k in range(cfg.resources.num_engines) for g in group.server(k).info().gpu_ids]
    return [str(g) for g in gpus] or None


def push_tensor(cfg: RunConfig, trainer: TrainerClient, engine: EngineClient, weight_version: int) -> SyncResult:
    return push_buckets(
        trainer,
        engine,
        weight_version,
        bucket_bytes=bucket_bytes(cfg),
        dtype=engine_dtype(cfg),
        gpus=engine_gpus(cfg, engine),
    )


def push_buckets(
    trainer: TrainerClient,
    engine: EngineClient,
    weight_version: int,
    *,
    bucket_bytes: int,
    dtype: str | None,
    gpus: list[str] | None,
) -> SyncResult:
    """Bucket by bucket, inside one weight-update session: each trainer rank that feeds an engine TP rank
    makes (and holds) its flattened bucket, the engine loads them all, next bucket. On GPUs the tensors
    go to each rank's own device first, so they travel as IPC handles of that GPU. `gpus`: the engine TP ranks'
    GPUs (`engine_gpus`)."""
    sources = payload_sources(engine.payloads_per_bucket(), trainer.gpu_ids(), gpus)
    copies = {r: sources.count(r) for r in sorted(set(sources))}
    trainer.ipc_begin_ranks(bucket_bytes, copies, dtype, flattened=True)
    version, nbytes, n = weight_version - 1, 0, 0
    try:
        with weight_update_session(engine):
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
    finally:
        trainer.ipc_end_ranks(list(copies))
    return SyncResult("tensor", version, n, nbytes, sources=tuple(sources))
