"""The engine's side of every weight sync into SGLang servers (the trainer's side: tasks/train/weight_sender.py;
the flow that drives both, one module per path: flows/weight_sync/).

- disk: the trainer's tensors are written as an HF safetensors directory (`write_hf_checkpoint`),
  then `POST /update_weights_from_disk` (works anywhere the server can read the directory);
- tensor (colocated): `POST /update_weights_from_tensor` with one base64 payload per TP rank, each a
  flattened bucket (`load_format="flattened_bucket"`: one uint8 tensor + SGLang's per-tensor metadata,
  tasks/sync/ipc.py); CUDA tensors serialize as CUDA IPC handles, so only metadata crosses HTTP, and
  each TP rank's payload must come from a process on that rank's GPU (flows/weight_sync/tensor.py pairs them);
- distributed (disaggregated): `POST /init_weights_update_group` while the trainer joins as rank 0,
  then per bucket `POST /update_weights_from_distributed` with names/dtypes/shapes while the trainer
  broadcasts the tensors in the same order (NCCL on GPUs; gloo works for CPU tests).

Tensor and distributed updates run inside a weight-update session (`POST /begin_weight_update` ...
`POST /end_weight_update`, per server): SGLang 0.5.23 refuses them otherwise (HTTP 400). The engine keeps
track of the sessions it opened, so it never begins twice on its own; ending after a failed update is
right on SGLang (the end finalizes the runners and closes the session; no weight_version was recorded).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from rollflow.tasks.rollout.engine import next_weight_version
from rollflow.tasks.rollout.sglang.hf_checkpoint import write_hf_checkpoint
from rollflow.tasks.rollout.sglang.lora_receiver import MERGED_INTO_ADAPTER_ENGINE
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError, torch_dtype_name
from rollflow.tasks.sync.buckets import buckets_by_bytes
from rollflow.tasks.sync.ipc import FLATTENED_BUCKET, flatten_bucket, serialize_flattened_bucket
from rollflow.tasks.sync.weight_group import DEFAULT_GROUP

# SGLang 0.5.23's answer (HTTP 400, success false) to a begin while a session is open
SESSION_ALREADY_OPEN = "a weight-update session is already open"


class WeightReceiver:
    """The weight-update half of `SGLangEngine` (a base class of it). It uses the engine's `urls`, `tp_sizes`,
    `weight_version`, `weight_sync`, `weight_dir`, `config_dir`, `bucket_bytes`, `tensor_device`,
    `weight_group` and its `_post(url, path, payload, timeout=...)`."""

    urls: list[str]
    tp_sizes: list[int]
    weight_version: int
    weight_sync: str
    weight_dir: Path | None
    config_dir: Path | None
    bucket_bytes: int
    tensor_device: str | None
    weight_group: str | None
    _post: Callable[..., Any]
    # servers where this engine opened a session it has not ended (an end that failed leaves one here)
    _open_sessions: set[str]

    def _target_version(self, weight_version: int) -> int:
        """The next version; or the current one again (a re-sync of the same weights, e.g. the startup
        weight-update check), which cannot lose or double an update."""
        if weight_version == self.weight_version:
            return weight_version
        return next_weight_version(self.weight_version, weight_version)

    # -- weight-update session (SGLang 0.5.23: tensor and distributed updates only inside one) --------
    def begin_weight_update(self) -> None:
        """POST /begin_weight_update on every server. A session this engine left open (its end failed) is
        ended first, so the engine never begins twice. One it cannot know of, opened before this actor
        restarted, is refused by SGLang with its 400 'already open' (scheduler_components/weight_updater.py:
        SchedulerWeightUpdaterManager.begin_weight_update returns success=False; the server lives on): that
        one is ended and a new one begun."""
        opened: list[str] = []
        try:
            for url in self.urls:
                if url in self._open_sessions:
                    self._post(url, "/end_weight_update", {})
                    self._open_sessions.discard(url)
                try:
                    self._post(url, "/begin_weight_update", {})
                except SGLangRequestError as exc:
                    if SESSION_ALREADY_OPEN not in str(exc):
                        raise
                    self._post(url, "/end_weight_update", {})
                    self._post(url, "/begin_weight_update", {})
                self._open_sessions.add(url)
                opened.append(url)
        except BaseException:
            for url in opened:
                self._end_quietly(url)
            raise

    def end_weight_update(self) -> None:
        """POST /end_weight_update on every server where this engine has a session open (each is tried
        even when one fails)."""
        errors = []
        for url in self.urls:
            if url not in self._open_sessions:
                continue
            try:
                self._post(url, "/end_weight_update", {})
                self._open_sessions.discard(url)
            except SGLangRequestError as exc:
                errors.append(str(exc))
        if errors:
            raise SGLangRequestError("; ".join(errors))

    def _end_quietly(self, url: str) -> None:
        try:
            self._post(url, "/end_weight_update", {}, timeout=30.0)
            self._open_sessions.discard(url)
        except Exception:  # noqa: BLE001 - best effort while another error is on its way up
            pass

    @contextlib.contextmanager
    def weight_update_session(self):
        """Begin ... end on every server; ended also when the body fails (see the module docstring)."""
        self.begin_weight_update()
        failed = True
        try:
            yield
            failed = False
        finally:
            if failed:
                for url in list(self._open_sessions):
                    self._end_quietly(url)
            else:
                self.end_weight_update()

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Mapping[str, Any], weight_version: int) -> None:
        """The RolloutEngine entry point: tensors from the trainer, through the configured path."""
        if getattr(self, "lora_sync", "merged") == "adapter":
            raise RuntimeError(MERGED_INTO_ADAPTER_ENGINE)
        if self.weight_sync == "tensor":
            self.update_weights_from_tensor(named_tensors, weight_version)
        elif self.weight_sync == "disk":
            if self.weight_dir is None:
                self.weight_dir = Path(tempfile.mkdtemp(prefix="rollflow-sglang-weights-"))
            if self.config_dir is None:
                raise ValueError(
                    "disk weight updates need the model's config_dir (config.json to write beside the tensors)"
                )
            target = self.weight_dir / f"v{weight_version:06d}"
            write_hf_checkpoint(named_tensors, target, config_dir=self.config_dir)
            self.update_weights_from_disk(target, weight_version)
            for old in self.weight_dir.glob("v*"):  # keep the newest two versions on disk
                if old.name < f"v{weight_version - 1:06d}":
                    shutil.rmtree(old, ignore_errors=True)
        else:
            raise RuntimeError(
                "weight_sync='distributed' is driven by the trainer, which owns the tensors and the NCCL group: "
                "call SGLangEngine.sync_weights_distributed(...) from the trainer side (see tasks/rollout/"
                "sglang/weight_receiver.py), or use weight_sync='disk' through this call"
            )

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: int,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        version = self._target_version(weight_version)
        payload: dict[str, Any] = {
            "model_path": str(model_path),
            "weight_version": str(version),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        for url in self.urls:
            self._post(url, "/update_weights_from_disk", payload)
        self.weight_version = version

    def update_weights_from_tensor(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        weight_version: int,
        *,
        serializer: Callable[[list], bytes] | None = None,
        load_format: str | None = None,
        device: str | None = None,
    ) -> int:
        """Bucketed POST /update_weights_from_tensor inside a weight-update session; one serialized payload
        per TP rank of each server (default: SGLang's flattened bucket; `serializer` + `load_format` for
        another). Tensors move to `device` first (colocated: the engine's GPU, so they travel as IPC
        handles). Returns the number of requests per server."""
        self._target_version(weight_version)  # a skipped or repeated version fails before anything is sent
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        device = device or self.tensor_device
        if device is not None:
            items = [(name, t.to(device)) for name, t in items]
        buckets = list(buckets_by_bytes(items, self.bucket_bytes))
        with self.weight_update_session():
            for b, bucket in enumerate(buckets):
                # One serialization per TP rank: CUDA IPC refcounts are per serialization, and each rank
                # deserializes (and releases) only its own (tp_worker.deserialize_own_rank).
                if serializer is None:  # SGLang's flattened bucket: one uint8 tensor + metadata per payload
                    flat, entries = flatten_bucket(bucket)
                    raws = [serialize_flattened_bucket(flat, entries) for _ in range(self.payloads_per_bucket)]
                    fmt = FLATTENED_BUCKET
                else:
                    raws, fmt = [serializer(bucket) for _ in range(self.payloads_per_bucket)], load_format
                payloads = [base64.b64encode(raw).decode("ascii") for raw in raws]
                self.apply_serialized_bucket(
                    payloads, last=b == len(buckets) - 1, weight_version=weight_version, load_format=fmt
                )
        return len(buckets)

    @property
    def weight_group_world_size(self) -> int:
        """Ranks of the weight-update group: the trainer (rank 0) plus every TP rank of every server."""
        return 1 + sum(self.tp_sizes)

    def init_weights_update_group(
        self, master_address: str, master_port: int, *, group_name: str = DEFAULT_GROUP, backend: str = "nccl"
    ) -> list[cf.Future]:
        """Ask every server to join the group (async: each call blocks until the trainer joins as rank 0).
        Server k's ranks start after rank 0 and the ranks of servers before it."""
        world_size = self.weight_group_world_size
        offsets = [1 + sum(self.tp_sizes[:k]) for k in range(len(self.urls))]
        pool = cf.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-group")
        futures = [
            pool.submit(
                self._post,
                url,
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": off,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
            )
            for url, off in zip(self.urls, offsets)
        ]
        pool.shutdown(wait=False)
        return futures

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP,
        weight_version: int | None = None,
        flush_cache: bool = True,
    ) -> list[cf.Future]:
        """The metadata of one bucket (async: each call returns once the broadcast has arrived)."""
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        pool = cf.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="sglang-dist")
        futures = [pool.submit(self._post, url, "/update_weights_from_distributed", payload) for url in self.urls]
        pool.shutdown(wait=False)
        return futures

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        for url in self.urls:
            self._post(url, "/destroy_weights_update_group", {"group_name": group_name})
        if self.weight_group == group_name:
            self.weight_group = None

    def sync_weights_distributed(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        weight_version: int,
        *,
        broadcast: Callable[[Any], None],
        join_group: Callable[[], Any] | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> int:
        """The trainer's side of the NCCL path, in SGLang's call order:

        1. (once, when `join_group` is given) POST /init_weights_update_group to every server while
           `join_group()` makes the trainer rank 0 of the same group (e.g. `init_weight_group(...)`,
           tasks/sync/weight_group.py);
        2. inside a weight-update session, per bucket: POST /update_weights_from_distributed (names,
           dtypes, shapes) to every server while `broadcast(tensor)` sends each tensor of the bucket in
           the same order.
        Returns the number of buckets.
        """
        version = self._target_version(weight_version)
        if join_group is not None:
            if master_port is None:
                raise ValueError("init of the weight group needs master_port")
            futures = self.init_weights_update_group(
                master_address, master_port, group_name=group_name, backend=backend
            )
            join_group()
            for fut in futures:
                fut.result(timeout=timeout_s)
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        buckets = list(buckets_by_bytes(items, self.bucket_bytes))
        with self.weight_update_session():
            for b, bucket in enumerate(buckets):
                last = b == len(buckets) - 1
                futures = self.update_weights_from_distributed(
                    [n for n, _ in bucket],
                    [torch_dtype_name(t.dtype) for _, t in bucket],
                    [list(t.shape) for _, t in bucket],
                    group_name=group_name,
                    weight_version=version if last else None,
                    flush_cache=last,
                )
                for _, tensor in bucket:
                    broadcast(tensor)
                for fut in futures:
                    fut.result(timeout=timeout_s)
        self.weight_version = version
        return len(buckets)

    # -- trainer-driven paths: the payloads / broadcasts come from the trainer actor -------------------
    @property
    def payloads_per_bucket(self) -> int:
        """Serialized copies one tensor bucket needs: one per TP rank of every server (CUDA IPC
        refcounts are per serialization, so no two ranks may share one)."""
        return sum(self.tp_sizes)

    def apply_serialized_bucket(
        self, payloads: Sequence[str], *, last: bool, weight_version: int, load_format: str | None = None
    ) -> None:
        """One bucket of `/update_weights_from_tensor`, serialized `payloads_per_bucket` times (by the
        trainer: CUDA IPC handles of its own GPU tensors, tasks/sync/ipc.py); server k's ranks get the
        next tp_k payloads. The last bucket flushes the cache and sets the version."""
        if len(payloads) != self.payloads_per_bucket:
            raise ValueError(
                f"{len(payloads)} serialized payloads for servers with tp sizes {self.tp_sizes}: "
                f"one per TP rank of every server ({self.payloads_per_bucket}) is needed"
            )
        version = self._target_version(weight_version) if last else None
        offset = 0
        for url, tp in zip(self.urls, self.tp_sizes):
            payload: dict[str, Any] = {
                "serialized_named_tensors": list(payloads[offset : offset + tp]),
                "flush_cache": last,
            }
            offset += tp
            if load_format is not None:
                payload["load_format"] = load_format
            if version is not None:
                payload["weight_version"] = str(version)
            self._post(url, "/update_weights_from_tensor", payload)
        if version is not None:
            self.weight_version = version

    def join_weight_group(
        self,
        master_address: str,
        master_port: int,
        *,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """Every server joins the trainer's group (returns once the trainer, rank 0, has joined too)."""
        for fut in self.init_weights_update_group(master_address, master_port, group_name=group_name, backend=backend):
            fut.result(timeout=timeout_s)
        self.weight_group = group_name

    def receive_bucket(
        self,
        metas: Sequence[Mapping[str, Any]],
        *,
        last: bool,
        weight_version: int,
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = 600.0,
    ) -> None:
        """Receive one bucket the trainer broadcasts (`metas`: name, dtype, shape in sending order)."""
        version = self._target_version(weight_version) if last else None
        futures = self.update_weights_from_distributed(
            [m["name"] for m in metas],
            [m["dtype"] for m in metas],
            [list(m["shape"]) for m in metas],
            group_name=group_name,
            weight_version=version,
            flush_cache=last,
        )
        for fut in futures:
            fut.result(timeout=timeout_s)
        if version is not None:
            self.weight_version = version
