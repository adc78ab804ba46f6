"""The weight-update process group of the distributed sync path (torch.distributed; NCCL on GPUs,
gloo on CPU): the trainer is rank 0, every TP rank of every SGLang engine joins it
(`/init_weights_update_group`), and each bucket is broadcast from rank 0.

Below both sides: the trainer's `WeightSender` (tasks/train/weight_sender.py) joins through
`init_weight_group`, the SGLang engine (tasks/rollout/sglang/weight_receiver.py) names the group; the path reads
top to bottom in flows/weight_sync/distributed.py.
"""

from __future__ import annotations

from typing import Any, Callable

DEFAULT_GROUP = "rollflow_weight_sync"


def init_weight_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
    timeout_s: float = 600.0,
):
    """Join the weight-update group the way SGLang's engines do (tcp:// rendezvous, store prefixed by
    the group name); the trainer is rank 0. Works without a default process group."""
    import datetime

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # so broadcast(src=0, group=pg) resolves
    return pg


def broadcaster(pg) -> Callable[[Any], None]:
    import torch.distributed as dist

    def broadcast(tensor) -> None:
        dist.broadcast(tensor, src=0, group=pg)

    return broadcast
