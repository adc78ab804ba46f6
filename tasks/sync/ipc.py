"""Colocated weight sync payloads: CUDA tensors travel as IPC handles, SGLang-compatible.

The trainer pickles `[(name, tensor), ...]` the way SGLang's `MultiprocessingSerializer` does (torch's
multiprocessing reductions: a CUDA tensor becomes `(rebuild_cuda_tensor, args)` holding an IPC handle,
not data), base64-encodes one copy per TP rank, and POSTs them to `/update_weights_from_tensor`.

Device identity: torch puts the sender's *local* device index into slot `DEVICE_SLOT` of the rebuild
args. Ray gives the trainer actor `CUDA_VISIBLE_DEVICES=k` (so its GPU is index 0) while the SGLang
server sees several GPUs, so an index means a different GPU on each side. SGLang's workers patch
torch's reductions (`monkey_patch_torch_reductions`) so that slot carries the device UUID string,
which they map back to their own index; an int is used as-is. We write the UUID without patching
torch: our pickler reduces tensors itself, and our unpickler (`deserialize_named_tensors`, used by the
hf engine and tests) maps the UUID in `find_class` instead of replacing torch's functions.

Only torch, collections and builtins globals appear in a payload: SGLang's receiving `SafeUnpickler`
allows nothing else (a rollflow function in the pickle would be refused there).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch.multiprocessing import reductions
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from rollflow.tasks.sync.buckets import buckets_by_bytes

# Position of `storage_device` in the args of torch.multiprocessing.reductions.rebuild_cuda_tensor
# (the same index SGLang's patch rewrites).
DEVICE_SLOT = 6
_REBUILD_CUDA = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


class IpcDeviceError(RuntimeError):
    """A CUDA IPC handle names a GPU that this process cannot see."""


# ----------------------------------------------------------------------------------------------
# Device slot: pure functions (tested without a GPU)
# ----------------------------------------------------------------------------------------------


def replace_device_slot(args: tuple, device: int | str) -> tuple:
    """`args` of rebuild_cuda_tensor with the device slot replaced."""
    if len(args) <= DEVICE_SLOT:
        raise ValueError(f"rebuild_cuda_tensor args have {len(args)} items; the device is item {DEVICE_SLOT}")
    return (*args[:DEVICE_SLOT], device, *args[DEVICE_SLOT + 1 :])


def _norm_uuid(uuid: str) -> str:
    # torch prints a bare UUID; nvidia-smi and CUDA_VISIBLE_DEVICES use "GPU-<uuid>"
    return uuid.strip().lower().removeprefix("gpu-")


def local_device_index(device: int | str, visible_uuids: Sequence[str]) -> int:
    """The local index of `device` (a UUID string, or an index used as-is) among `visible_uuids`."""
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise TypeError(f"CUDA IPC device slot holds {device!r} ({type(device).__name__}): expected int or UUID str")
    if isinstance(device, int):
        return device
    wanted = _norm_uuid(device)
    for index, uuid in enumerate(visible_uuids):
        if _norm_uuid(uuid) == wanted:
            return index
    visible = ", ".join(f"{i}={u}" for i, u in enumerate(visible_uuids)) or "no CUDA device"
    raise IpcDeviceError(
        f"CUDA IPC handle is on GPU {device}, which this process does not see (visible: {visible}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): colocated weight sync needs "
        f"the receiver to see the sender's GPU"
    )


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpu() -> str | None:
    """This process's (first) GPU as the cluster numbers them (Ray sets CUDA_VISIBLE_DEVICES), None without: what
    pairs a sender with a receiver on the same GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or None
    return visible.split(",")[0] if visible else None


def visible_device_uuids() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


# ----------------------------------------------------------------------------------------------
# Sending side
# ----------------------------------------------------------------------------------------------


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, plain `torch.Tensor` (Parameters and subclasses reduce like tensors)."""
    if is_traceable_wrapper_subclass(tensor):
        raise TypeError(
            f"{type(tensor).__name__} is a wrapper tensor subclass (e.g. DTensor): gather it to a "
            f"plain local tensor before a weight sync"
        )
    t = tensor.detach()
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    t = _plain(tensor)
    if t.is_cuda:
        rebuild, args = reductions.reduce_tensor(t)
        return rebuild, replace_device_slot(args, device_uuid(args[DEVICE_SLOT]))
    # CPU (and other non-CUDA) tensors travel by value. torch's shared-memory reduction for CPU
    # (the default `file_descriptor` strategy) hands the fd over through multiprocessing's resource
    # sharer, authenticated with the parent's authkey: an unrelated receiver (an HTTP server, a Ray
    # actor) cannot fetch it. Tensor.__reduce_ex__ embeds the bytes (torch._utils / torch.storage
    # globals only); a view of a larger storage is compacted first so only its own bytes travel.
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t.__reduce_ex__(2)


class _TensorPickler(pickle.Pickler):
    """A pickler whose tensor reduction is ours; torch's global reducers stay untouched."""

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        return NotImplemented


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> bytes:
    """SGLang's `update_weights_from_tensor` payload: a pickled list of (name, tensor).

    CUDA tensors become IPC handles naming their GPU by UUID (the sender must keep them alive until
    the receiver is done); other tensors carry their bytes."""
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump([(str(n), t) for n, t in named])
    return buf.getvalue()


# SGLang's `load_format="flattened_bucket"` (sglang/srt/weight_sync/tensor_bucket.py, 0.5.23): one payload
# is `{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}`; the receiver views
# each slice back as its dtype and shape. The metadata class is SGLang's (its SafeUnpickler allows it by
# name); the trainer need not have SGLang installed, so the pickle names it without importing it.
FLATTENED_BUCKET = "flattened_bucket"
_SGLANG_FLAT_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclasses.dataclass(frozen=True)
class FlatEntry:
    """One tensor's slice of a flattened bucket (the fields of SGLang's FlattenedTensorMetadata, in order)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _ExternalClass:
    """A class the receiver has and the sender may lack, pickled by module and name only."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle checks that a reduce callable is callable; never called here
        raise TypeError(f"{self.module}.{self.name} exists only on the receiving side")


class _FlatPickler(pickle._Pickler):  # the Python pickler: it can write a global it cannot import
    dispatch = dict(pickle._Pickler.dispatch)

    def save_external(self, obj: _ExternalClass) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)

    dispatch[_ExternalClass] = save_external

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, FlatEntry):
            # FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel): a dataclass
            return (
                _ExternalClass(*_SGLANG_FLAT_METADATA),
                (obj.name, torch.Size(obj.shape), obj.dtype, obj.start_idx, obj.end_idx, obj.numel),
            )
        return NotImplemented


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlatEntry]]:
    """The bucket's tensors as one uint8 tensor (on their device) plus where each one lies. Every
    start offset must be a multiple of the tensor's element size (the receiver views the slice as
    that dtype): `buckets_by_bytes` callers keep one dtype per bucket or order by alignment."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    parts, entries, offset = [], [], 0
    for name, tensor in named:
        t = _plain(tensor).contiguous()
        if offset % t.element_size():
            raise ValueError(
                f"{name} ({t.dtype}) would start at byte {offset}, not a multiple of its element "
                f"size {t.element_size()}: SGLang cannot view it back; split the bucket by dtype"
            )
        flat = t.reshape(-1).view(torch.uint8)
        entries.append(FlatEntry(str(name), t.shape, t.dtype, offset, offset + flat.numel(), flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), entries


def serialize_flattened_bucket(flat: torch.Tensor, entries: list[FlatEntry]) -> bytes:
    """One `serialized_named_tensors` entry for load_format="flattened_bucket"."""
    buf = io.BytesIO()
    _FlatPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump({"flattened_tensor": flat, "metadata": list(entries)})
    return buf.getvalue()


def encode_payloads(named: list[tuple[str, torch.Tensor]], *, tp_size: int = 1) -> list[str]:
    """`serialized_named_tensors`: one base64 payload per TP rank. Each rank gets its own serialization
    because CUDA IPC ref-counts are per serialization (a rank releasing its copy must not free another's)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [base64.b64encode(serialize_named_tensors(named)).decode("ascii") for _ in range(tp_size)]


@dataclasses.dataclass
class IpcBucket:
    """One request's payloads plus the tensors they point into: keep `keepalive` referenced until the
    receiver answered, or the IPC handles may name freed (and reused) memory."""

    payloads: list[str]
    keepalive: list[torch.Tensor]
    names: list[str]
    nbytes: int


def ipc_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    tp_size: int = 1,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    flattened: bool = False,
) -> Iterator[IpcBucket]:
    """Consecutive tensors up to `bucket_bytes` per bucket (a larger tensor alone), each first moved to
    `device` / cast to `dtype` when given. Lazy: the caller holds one bucket's converted copies at a time.
    `flattened`: each payload is one flattened bucket (SGLang's load_format="flattened_bucket"), so a
    bucket is one IPC handle however many tensors it holds."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    converted = ((name, t.detach().to(device=device, dtype=dtype)) for name, t in named)
    for pairs in buckets_by_bytes(converted, bucket_bytes):
        tensors = [t for _, t in pairs]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if flattened:
            flat, entries = flatten_bucket(pairs)
            payloads = [
                base64.b64encode(serialize_flattened_bucket(flat, entries)).decode("ascii") for _ in range(tp_size)
            ]
            tensors = [flat]  # the handle points into the flat copy: it must outlive the load
        else:
            payloads = encode_payloads(pairs, tp_size=tp_size)
        yield IpcBucket(payloads=payloads, keepalive=tensors, names=[n for n, _ in pairs], nbytes=nbytes)


# ----------------------------------------------------------------------------------------------
# Receiving side (ours: the hf engine and tests; SGLang has its own)
# ----------------------------------------------------------------------------------------------


def _rebuild_cuda_tensor_here(*args):
    device = args[DEVICE_SLOT]
    if isinstance(device, str):
        args = replace_device_slot(args, local_device_index(device, visible_device_uuids()))
    return reductions.rebuild_cuda_tensor(*args)


_SAFE_BUILTINS = frozenset(
    {
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "str",
        "bytes",
        "bytearray",
        "int",
        "float",
        "bool",
        "complex",
        "slice",
        "range",
    }
)


class _TensorUnpickler(pickle.Unpickler):
    """Loads payloads of `serialize_named_tensors` (and SGLang's). Only torch, collections and plain
    builtins may be named, as in SGLang's SafeUnpickler: a payload arrives over HTTP."""

    def find_class(self, module: str, name: str):
        if (module, name) == _REBUILD_CUDA:
            return _rebuild_cuda_tensor_here
        if (module, name) == _SGLANG_FLAT_METADATA:
            return FlatEntry
        if (
            module == "torch"
            or module.startswith("torch.")
            or module == "collections"
            or (module == "builtins" and name in _SAFE_BUILTINS)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"weight payload names {module}.{name}: only torch, collections and plain builtins are allowed"
        )


def deserialize_named_tensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors` (or of `serialize_flattened_bucket`) in another process:
    IPC handles open on the local index of the GPU whose UUID they carry."""
    named = _TensorUnpickler(io.BytesIO(data)).load()
    if isinstance(named, dict) and set(named) == {"flattened_tensor", "metadata"}:
        flat = named["flattened_tensor"]
        return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in named["metadata"]]
    if not isinstance(named, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in named):
        raise ValueError(f"weight payload is {type(named).__name__}, expected a list of (name, tensor)")
    return [(str(n), t) for n, t in named]
