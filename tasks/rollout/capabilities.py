"""What a rollout engine can do beyond the `RolloutEngine` protocol (tasks/rollout/engine.py).

Each capability is a small `@runtime_checkable` protocol: an engine declares it by having the members
(structurally: HFEngine and SGLangEngine inherit from none of these), and `RolloutWorker` asks with
`isinstance` rather than probing names with `getattr` / `hasattr`. A type checker then sees every member the
worker relies on. docs/architecture.md lists which engine has which.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Liveness(Protocol):
    """An engine whose server processes can die under it (SGLang): the worker's ping reports it."""

    def alive(self) -> bool: ...


@runtime_checkable
class Abortable(Protocol):
    """Requests in flight can be cut (their samples come back aborted); returns the abort calls sent."""

    def abort(self, rids: Sequence[str] | None = None) -> int: ...


@runtime_checkable
class StickyAbort(Protocol):
    """An abort stays in force until reset (HFEngine's flag): each new rollout resets it first, so an abort
    meant for the previous rollout does not cut this one."""

    def reset_abort(self) -> None: ...


@runtime_checkable
class ReportsInflight(Protocol):
    """The request ids in flight now (SGLang; in-process engines have none to report)."""

    def inflight(self) -> list[str]: ...


@runtime_checkable
class Offloadable(Protocol):
    """Frees weights, KV cache and CUDA graphs at once for a colocated trainer (SGLang's memory saver);
    other engines release through `release_memory`."""

    def offload(self) -> None: ...


@runtime_checkable
class ServesWeightsByName(Protocol):
    """Servers that answer the first values of a named tensor (SGLang's /get_weights_by_name), per server."""

    urls: list[str]

    def get_weights_by_name(self, name: str, truncate_size: int = 100, url: str | None = None) -> Any: ...


@runtime_checkable
class ReportsModelInfo(Protocol):
    """Servers that report what they serve (SGLang's /model_info: the weight version among it), per server."""

    urls: list[str]

    def model_info(self, url: str | None = None) -> dict[str, Any]: ...


@runtime_checkable
class BucketedWeightSync(Protocol):
    """An engine that takes weights the trainer sends it (SGLang), rather than a dict through Ray's object
    store: `weight_sync` says how (disk, tensor, distributed); `payloads_per_bucket` how many serialized copies
    of each tensor bucket it needs (one per TP rank of every server)."""

    weight_sync: str
    payloads_per_bucket: int

    def apply_serialized_bucket(
        self, payloads: Sequence[str], *, last: bool, weight_version: int, load_format: str | None = None
    ) -> None: ...


@runtime_checkable
class TakesBuckets(Protocol):
    """An in-process engine that copies the trainer's tensors in bucket by bucket (the hf engine): the tensor
    path's receiving end, whether the bucket came by CUDA IPC or from the same process."""

    def apply_bucket(self, named: Sequence[tuple[str, Any]], *, last: bool, weight_version: int) -> None: ...


@runtime_checkable
class WeightUpdateSession(Protocol):
    """Tensor and distributed updates happen inside a session the engine opens and closes (SGLang 0.5.23)."""

    def begin_weight_update(self) -> None: ...

    def end_weight_update(self) -> None: ...


@runtime_checkable
class WeightGroupMember(Protocol):
    """Joins the trainer's weight-update group (NCCL / gloo) and receives broadcast buckets; `weight_group`:
    the group it joined, None before."""

    weight_group: str | None
    weight_group_world_size: int

    def join_weight_group(self, master_address: str, master_port: int, *, group_name: str, backend: str) -> None: ...

    def receive_bucket(
        self, metas: Sequence[Mapping[str, Any]], *, last: bool, weight_version: int, group_name: str
    ) -> None: ...
