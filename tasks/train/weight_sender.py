"""The trainer's side of a weight sync into SGLang engines, in buckets, without the object store.

- `tensor` (colocated: trainer and engine share each GPU): the trainer serializes its own GPU tensors
  as CUDA IPC handles (tasks/sync/ipc.py); the engine's server opens them, so no bytes are copied
  between processes. The sender keeps a bucket's tensors alive until the next bucket is asked for.
- `distributed` (disaggregated): the trainer is rank 0 of a weight-update group with every TP rank
  of every engine (NCCL on GPUs, gloo on CPU) and broadcasts each bucket's tensors while the engines
  receive them (`/update_weights_from_distributed`).

A plain class over a source of buckets (a whole dict cut into buckets, or the megatron backend's per-layer
export, which a sharded trainer's ranks make together); `TrainWorker` owns one and exposes its methods to
the sync task (flows/weight_sync/tensor.py and distributed.py, one module per path), which drives both actors
in SGLang's call order, bucket by bucket until the one marked last. The engine's side of both paths is
tasks/rollout/sglang/weight_receiver.py. A bucket is made when it is asked for (one bucket of look-ahead), so a
sync holds a bucket or two beside the weights, never a second copy of the model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import torch

from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.net import free_port, node_ip
from rollflow.tasks.sync.buckets import buckets_by_bytes
from rollflow.tasks.sync.ipc import ipc_buckets, visible_gpu
from rollflow.tasks.sync.weight_group import init_weight_group
from rollflow.tasks.train.results import BroadcastBucket, IpcBucket

NamedTensors = Callable[[], dict[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch." (what SGLang's request carries)
    shape: tuple[int, ...]


def _on_device(t: torch.Tensor, device: str | None) -> torch.Tensor:
    t = t.detach()
    return (t.to(device) if device is not None else t).contiguous()


# `source(bucket_bytes, dtype)`: the HF-named tensors in buckets of about `bucket_bytes`, already in `dtype` (the
# engine's, None: as they are), so the sender only moves and sends them.
BucketSource = Callable[[int, "str | None"], Iterable[list[tuple[str, torch.Tensor]]]]


def dict_buckets(named_tensors: NamedTensors) -> BucketSource:
    """Buckets of a callable's whole dict (one snapshot per sync), sized in the sent dtype."""

    def source(bucket_bytes: int, dtype: str | None):
        named = named_tensors()
        sent = ((name, t if dtype is None else t.to(DTYPES[dtype])) for name, t in named.items())
        return buckets_by_bytes(sent, bucket_bytes)

    return source


def _with_last(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[list, bool]]:
    """(bucket, is_last): one bucket of look-ahead (a sharded trainer's ranks all look ahead together)."""
    it = iter(buckets)
    current = next(it, None)
    if current is None:
        yield [], True
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


class WeightSender:
    """Streams the trainer's HF-named tensors bucket by bucket. `source(bucket_bytes, dtype)` gives the buckets:
    a whole dict cut into buckets (torch backend), or the megatron backend's `export_buckets`, which every rank of
    a sharded model must step through together; so every rank is stepped, and only the feeding ones send."""

    def __init__(self, source: BucketSource):
        self._source = source
        self._stream: Iterator[tuple[list, bool]] | None = None
        self._held = None  # the current IPC bucket: its tensors must outlive the engine's load
        self._ipc_args: tuple = ()
        self._group = None
        self._current: list[tuple[str, torch.Tensor]] | None = None

    def buckets(self, bucket_bytes: int, dtype: str | None = None) -> Iterator[tuple[list, bool]]:
        """(bucket, is_last) as the source makes them, on the trainer's device: for an engine in this same process,
        which needs no serialization (a sharded source's ranks must all step through it together)."""
        return _with_last(self._source(bucket_bytes, dtype))

    # -- tensor path (CUDA IPC) -------------------------------------------------------------------
    def ipc_begin(
        self,
        bucket_bytes: int,
        tp_size: int = 1,
        dtype: str | None = None,
        device: str | None = None,
        flattened: bool = False,
    ) -> None:
        """Start a sync: `ipc_next` then gives the buckets until one says it is the last. `tp_size`: payload
        copies per bucket (1 when every engine TP rank takes the payload of the trainer rank on its own GPU; 0 for
        a rank no engine reads from, which only steps along); `flattened`: SGLang's load_format="flattened_bucket"."""
        self._stream = _with_last(self._source(bucket_bytes, dtype))
        self._ipc_args = (tp_size, device, flattened)
        self._held = None

    def ipc_next(self) -> IpcBucket:
        """The next bucket's payloads (one base64 string per copy), its tensor names, whether it is the last, and
        the GPU they were made on (this process's CUDA_VISIBLE_DEVICES, as the scheduler numbers GPUs; None
        without); the previous bucket's tensors are released (the engine has loaded them by now)."""
        if self._stream is None:
            raise RuntimeError("ipc_next before ipc_begin")
        self._held = None
        pairs, last = next(self._stream)
        tp_size, device, flattened = self._ipc_args
        out = IpcBucket(
            payloads=[],
            names=[n for n, _ in pairs],
            last=last,
            nbytes=sum(t.numel() * t.element_size() for _, t in pairs),
            gpu=visible_gpu(),
        )
        if tp_size and pairs:
            bucket = next(
                ipc_buckets(pairs, 1 << 62, tp_size=tp_size, device=device, flattened=flattened)
            )  # the source's bucket, as one IPC bucket
            self._held = bucket
            out = dataclasses.replace(out, payloads=list(bucket.payloads), nbytes=int(bucket.nbytes))
        return out

    def ipc_end(self) -> None:
        self._stream = None
        self._held = None

    # -- distributed path (NCCL / gloo broadcast) ----------------------------------------------------
    def group_address(self) -> tuple[str, int]:
        """Where the weight-update group meets: this (rank 0's) node and a free port on it."""
        return node_ip(), free_port()

    @property
    def in_group(self) -> bool:
        return self._group is not None

    def join_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """Rank 0 of the group (blocks until every engine rank has joined). A previous group (engines
        restarted since) is destroyed first."""
        self.leave_group()
        self._group = init_weight_group(
            master_address,
            master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )

    def buckets_begin(self, bucket_bytes: int, dtype: str | None = None) -> None:
        """Start a broadcast sync: `next_bucket` / `broadcast_current` then go bucket by bucket."""
        self._stream = _with_last(self._source(bucket_bytes, dtype))
        self._current = None

    def next_bucket(self, keep: bool = True) -> BroadcastBucket:
        """The next bucket's metadata (name, dtype, shape of each tensor, in broadcast order) and whether it is
        the last; kept for `broadcast_current` unless `keep` is false (a rank that only steps along)."""
        if self._stream is None:
            raise RuntimeError("next_bucket before buckets_begin")
        pairs, last = next(self._stream)
        self._current = pairs if keep else None
        if last:
            self._stream = None
        metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in pairs]
        return BroadcastBucket(metas=[dataclasses.asdict(m) for m in metas], last=last)

    def broadcast_current(self, device: str | None = None) -> int:
        """Broadcast the bucket `next_bucket` gave (the engines are receiving it); bytes sent."""
        import torch.distributed as dist

        if self._group is None or self._current is None:
            raise RuntimeError("broadcast_current needs join_group and next_bucket first")
        sent = 0
        for _, tensor in self._current:
            t = _on_device(tensor, device)
            dist.broadcast(t, src=0, group=self._group)
            sent += t.numel() * t.element_size()
        self._current = None
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
