"""Weight sync by broadcast (`distributed`: disaggregated SGLang; NCCL on GPUs, gloo for CPU tests).

The trainer's rank 0 and every TP rank of every engine form one weight-update group; per bucket the engines
post the metadata while the trainer broadcasts the tensors. Top to bottom:

1. once per engine lifetime (a fresh or restarted engine is not in the group): the trainer names a meeting
   point (`TrainerClient.weight_group_address` -> `tasks/train/weight_sender.py:WeightSender.group_address`),
   every engine rank starts joining (`EngineClient.join_weight_group` ->
   `tasks/rollout/sglang/weight_receiver.py:WeightReceiver.join_weight_group`: `POST
   /init_weights_update_group`) and the trainer joins as rank 0 (`WeightSender.join_group` ->
   `tasks/sync/weight_group.py:init_weight_group`);
2. the trainer starts a bucket stream in the engine's dtype (`weight_buckets_begin` -> `WeightSender.buckets_begin`;
   a sharded trainer's ranks make each bucket together);
3. inside one weight-update session on every server (SGLang 0.5.23 refuses distributed updates outside one),
   bucket by bucket until the one marked last: the trainer makes the bucket and hands out its metadata
   (`next_weight_bucket` -> `WeightSender.next_bucket`), the engine starts receiving it
   (`receive_weight_bucket` -> `WeightReceiver.receive_bucket`: `POST /update_weights_from_distributed` with
   names, dtypes, shapes), the trainer broadcasts its tensors in the same order (`broadcast_weight_bucket` ->
   `WeightSender.broadcast_current`), and the engine's answer closes the bucket (the last sets the version).
"""

from __future__ import annotations

from rollflow.flows.config import RunConfig
from rollflow.flows.weight_sync.shared import SyncResult, bucket_bytes, engine_dtype, weight_update_session
from rollflow.infra.clients import EngineClient, TrainerClient


def group_name(cfg: RunConfig) -> str:
    return f"rollflow-{cfg.run}"


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
    with weight_update_session(engine):  # ended also when a bucket fails
        last = False
        while not last:  # the trainer makes each bucket as it is sent (a sharded trainer: its ranks together)
            metas, last = trainer.next_weight_bucket()
            receiving = engine.receive_weight_bucket(metas, last, weight_version, name)
            nbytes += trainer.broadcast_weight_bucket("cuda" if backend == "nccl" else None)
            version = receiving.result()
            n += 1
    return SyncResult("distributed", version, n, nbytes, joined)
