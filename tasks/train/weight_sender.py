"""The trainer's side of a weight sync into SGLang engines, in buckets, without the object store.

- `tensor` (colocated: trainer and engine share each GPU): the trainer serializes its own GPU tensors
  as CUDA IPC handles (tasks/sync/ipc.py); the engine's server opens them, so no bytes are copied
  between processes. The sender keeps a bucket's tensors alive until the next bucket is asked for.
- `distributed` (disaggregated): the trainer is rank 0 of a weight-update group with every TP rank
  of every engine (NCCL on GPUs, gloo on CPU) and broadcasts each bucket's tensors while the engines
  receive them (`/update_weights_from_distributed`).

A plain class over a callable giving the HF-named tensors; `TrainWorker` owns one and exposes its
methods to the sync task (flows/weight_sync.py), which drives both actors in SGLang's call order.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.net import free_port, node_ip

NamedTensors = Callable[[], dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch." (what SGLang's request carries)
    shape: tuple[int, ...]


def _cast(t: torch.Tensor, dtype: str | None, device: str | None) -> torch.Tensor:
    t = t.detach()
    if device is not None:
        t = t.to(device)
    if dtype is not None:
        t = t.to(DTYPES[dtype])
    return t.contiguous()


def bucket_plan(named: dict[str, torch.Tensor], bucket_bytes: int, dtype: str | None = None) -> list[list[TensorMeta]]:
    """The buckets as sent (sizes in the sent dtype; meta tensors: nothing is allocated)."""
    from rollflow.tasks.sync.buckets import buckets_by_bytes

    sent = ((name, torch.empty(t.shape, dtype=DTYPES[dtype] if dtype else t.dtype, device="meta"))
            for name, t in named.items())
    return [[TensorMeta(name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for name, m in bucket]
            for bucket in buckets_by_bytes(sent, bucket_bytes)]


class WeightSender:
    def __init__(self, named_tensors: NamedTensors):
        self._named_tensors = named_tensors
        self._ipc: Iterator | None = None
        self._held = None  # the current IPC bucket: its tensors must outlive the engine's load
        self._group = None
        self._plan: list[list[TensorMeta]] | None = None
        self._plan_dtype: str | None = None
        self._plan_tensors: dict[str, torch.Tensor] | None = None

    # -- tensor path (CUDA IPC) -------------------------------------------------------------------
    def ipc_begin(self, bucket_bytes: int, tp_size: int = 1, dtype: str | None = None,
                  device: str | None = None, flattened: bool = False) -> int:
        """Plan the buckets; returns how many `ipc_next` calls follow. `tp_size`: payload copies per
        bucket (1 when every engine TP rank takes the payload of the trainer rank on its own GPU);
        `flattened`: SGLang's load_format="flattened_bucket"."""
        from rollflow.tasks.sync.ipc import ipc_buckets

        named = self._named_tensors()
        n = len(bucket_plan(named, bucket_bytes, dtype))
        self._ipc = ipc_buckets(named.items(), bucket_bytes, tp_size=tp_size, device=device, dtype=
                                DTYPES[dtype] if dtype else None, flattened=flattened)
        self._held = None
        return n

    def ipc_next(self) -> dict:
        """The next bucket's payloads (one base64 string per copy), its tensor names and the GPU they
        were made on (this process's CUDA_VISIBLE_DEVICES, as the scheduler numbers GPUs; None without);
        the previous bucket's tensors are released (the engine has loaded them by now)."""
        if self._ipc is None:
            raise RuntimeError("ipc_next before ipc_begin")
        self._held = None
        bucket = next(self._ipc)
        self._held = bucket
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or None
        return {"payloads": list(bucket.payloads), "names": list(bucket.names), "nbytes": int(bucket.nbytes),
                "gpu": visible.split(",")[0] if visible else None}

    def ipc_end(self) -> None:
        self._ipc = None
        self._held = None

    # -- distributed path (NCCL / gloo broadcast) ----------------------------------------------------
    def group_address(self) -> tuple[str, int]:
        """Where the weight-update group meets: this (rank 0's) node and a free port on it."""
        return node_ip(), free_port()

    @property
    def in_group(self) -> bool:
        return self._group is not None

    def join_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                   backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """Rank 0 of the group (blocks until every engine rank has joined). A previous group (engines
        restarted since) is destroyed first."""
        from rollflow.tasks.sync.weight_group import init_weight_group

        self.leave_group()
        self._group = init_weight_group(master_address, master_port, rank=0, world_size=world_size,
                                        group_name=group_name, backend=backend, timeout_s=timeout_s)

    def plan(self, bucket_bytes: int, dtype: str | None = None) -> list[list[dict]]:
        """The buckets' (name, dtype, shape) lists, in the order `broadcast_bucket` sends them."""
        self._plan_tensors = self._named_tensors()  # one snapshot for all buckets of this sync
        self._plan = bucket_plan(self._plan_tensors, bucket_bytes, dtype)
        self._plan_dtype = dtype
        return [[dataclasses.asdict(m) for m in bucket] for bucket in self._plan]

    def drop_snapshot(self) -> None:
        """Forget the last `plan`'s tensors (a rank that only took part in a sharded trainer's gathers)."""
        self._plan_tensors = None

    def broadcast_bucket(self, index: int, device: str | None = None) -> int:
        """Broadcast bucket `index` of the last `plan` (the engines are receiving it); returns bytes sent."""
        import torch.distributed as dist

        if self._group is None or self._plan is None or self._plan_tensors is None:
            raise RuntimeError("broadcast_bucket needs join_group and plan first")
        named = self._plan_tensors
        sent = 0
        for meta in self._plan[index]:
            t = _cast(named[meta.name], self._plan_dtype, device)
            dist.broadcast(t, src=0, group=self._group)
            sent += t.numel() * t.element_size()
        if index == len(self._plan) - 1:
            self._plan_tensors = None  # the sync is complete: drop the snapshot
        return sent

    def leave_group(self) -> None:
        if self._group is None:
            return
        import torch.distributed as dist

        try:
            dist.destroy_process_group(self._group)
        except Exception:  # noqa: BLE001 - a group whose peers are gone cannot be torn down cleanly
            pass
        self._group = None
