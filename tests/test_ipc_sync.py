"""tasks/sync/ipc.py: SGLang-compatible weight payloads (CUDA IPC handles named by GPU UUID).

CPU tests check the by-value path (also across two unrelated processes), the device-slot mapping on
synthetic rebuild args and the payload's globals (SGLang's SafeUnpickler allows only torch, collections
and builtins). The `gpu` tests open a real IPC handle in a receiver process that sees the GPU under
another CUDA_VISIBLE_DEVICES and write through it (run by scripts/gpu_checks.sh).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollflow.tasks.rollout.sglang import payloads as sglang_payloads
from rollflow.tasks.sync import ipc
from rollflow.tasks.sync.buckets import buckets_by_bytes

REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _MyTensor(torch.Tensor):
    pass


# Shared by the receiver subprocess (exec'd there): sha256 over dtype, shape and raw bytes. Not
# parity.tensor_checksum: its uint8 view fails on 0-d tensors wider than a byte.
DIGEST_SRC = """
import hashlib
def digest(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
"""
_ns: dict = {"torch": torch}
exec(DIGEST_SRC, _ns)
digest = _ns["digest"]


def _sample_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return [
        ("fp32", torch.randn(3, 5, generator=g)),
        ("bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("int64", torch.randint(-(2**40), 2**40, (2, 3, 4), generator=g)),
        ("empty", torch.empty(0, 8)),
        ("scalar", torch.tensor(3.5, dtype=torch.float16)),
        ("transposed", base.t()),
        ("slice", torch.arange(1000, dtype=torch.int32)[10:20:3]),
        ("param", torch.nn.Parameter(torch.randn(2, 2, generator=g))),
        ("subclass", torch.randn(3, generator=g).as_subclass(_MyTensor)),
    ]


def _assert_same(sent: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (name, a), (_, b) in zip(sent, got):
        assert type(b) is torch.Tensor, name
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert not b.requires_grad, name
        assert torch.equal(b, a.detach().as_subclass(torch.Tensor)), name


def _globals(payload: bytes) -> set[str]:
    """module.name of every global a pickle references (protocol 4+ pushes them as two strings)."""
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(payload):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
    return out


# ----------------------------------------------------------------------------------------------
# CPU: by-value payloads
# ----------------------------------------------------------------------------------------------


def test_cpu_round_trip_in_process():
    named = _sample_tensors()
    _assert_same(named, ipc.deserialize_named_tensors(ipc.serialize_named_tensors(named)))


def test_cpu_payload_uses_only_globals_sglang_allows_and_plain_pickle_loads_it():
    named = _sample_tensors()
    payload = ipc.serialize_named_tensors(named)
    names = _globals(payload)
    assert names, "expected tensor reconstructors in the payload"
    bad = {g for g in names if not (g.startswith(("torch.", "collections.", "builtins.")))}
    assert not bad, f"SGLang's SafeUnpickler would refuse {sorted(bad)}"
    # no shared-memory / fd reductions: those need the sender's multiprocessing resource sharer
    assert not any("rebuild_storage" in g or "resource_sharer" in g for g in names), names
    _assert_same(named, pickle.loads(payload))  # the fake SGLang server's receiving side


def test_view_of_large_storage_travels_compactly():
    big = torch.arange(1_000_000, dtype=torch.float32)
    payload = ipc.serialize_named_tensors([("head", big[5:9])])
    assert len(payload) < 10_000, len(payload)
    [(_, t)] = ipc.deserialize_named_tensors(payload)
    assert t.tolist() == [5.0, 6.0, 7.0, 8.0]


def test_sglang_engine_serializer_delegates():
    named = _sample_tensors()
    payload = sglang_payloads.serialize_named_tensors(named)
    assert not any("rebuild_storage" in g for g in _globals(payload))
    _assert_same(named, ipc.deserialize_named_tensors(payload))


def test_cpu_cross_process_unrelated_receiver(tmp_path):
    named = _sample_tensors()
    path = tmp_path / "payload.bin"
    path.write_bytes(ipc.serialize_named_tensors(named))
    receiver = (
        "import json, sys, torch\n"
        "from rollflow.tasks.sync.ipc import deserialize_named_tensors\n"
        + DIGEST_SRC
        + "named = deserialize_named_tensors(open(sys.argv[1], 'rb').read())\n"
        "print(json.dumps([[n, list(t.shape), digest(t)] for n, t in named]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", receiver, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [[n, list(t.shape), digest(t)] for n, t in named]


def test_encode_payloads_one_independent_payload_per_rank():
    named = _sample_tensors()[:3]
    payloads = ipc.encode_payloads(named, tp_size=3)
    assert len(payloads) == 3 and all(isinstance(p, str) for p in payloads)
    for p in payloads:
        _assert_same(named, ipc.deserialize_named_tensors(base64.b64decode(p, validate=True)))
    with pytest.raises(ValueError, match="tp_size"):
        ipc.encode_payloads(named, tp_size=0)


def test_wrapper_subclass_is_refused():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="wrapper tensor subclass"):
        ipc.serialize_named_tensors([("w", t)])


# ----------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------


def test_ipc_buckets_follow_the_engine_bucketing_rule():
    sizes = [10, 10, 30, 5, 5, 20, 1]  # fp32 elements: 40, 40, 120, 20, 20, 80, 4 bytes
    named = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]
    buckets = list(ipc.ipc_buckets(named, 80, tp_size=2))
    expected = [[n for n, _ in b] for b in buckets_by_bytes(named, 80)]
    assert [b.names for b in buckets] == expected
    assert expected == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"], ["t6"]]
    assert [b.nbytes for b in buckets] == [80, 120, 40, 80, 4]
    for b in buckets:
        assert len(b.payloads) == 2 and len(b.keepalive) == len(b.names)
        got = ipc.deserialize_named_tensors(base64.b64decode(b.payloads[1]))
        _assert_same(list(zip(b.names, b.keepalive)), got)
    assert list(ipc.ipc_buckets([], 80)) == []


def test_ipc_buckets_cast_before_sizing_and_are_lazy():
    consumed = []

    def named():
        for i in range(6):
            consumed.append(i)
            yield f"w{i}", torch.full((10,), i + 0.5, requires_grad=True)  # 40 B fp32, 20 B bf16

    it = ipc.ipc_buckets(named(), 40, dtype=torch.bfloat16)
    first = next(it)
    assert first.names == ["w0", "w1"] and first.nbytes == 40  # bf16 sizes decide the grouping
    assert len(consumed) == 3  # one tensor past the bucket, no more
    assert all(t.dtype == torch.bfloat16 and not t.requires_grad for t in first.keepalive)
    [(_, t0), _] = ipc.deserialize_named_tensors(base64.b64decode(first.payloads[0]))
    assert t0.dtype == torch.bfloat16 and torch.equal(t0, torch.full((10,), 0.5, dtype=torch.bfloat16))
    assert [b.names for b in it] == [["w2", "w3"], ["w4", "w5"]]


# ----------------------------------------------------------------------------------------------
# Device slot: UUID <-> local index, without a GPU
# ----------------------------------------------------------------------------------------------

UUID_A = "5c2f1e0a-1111-2222-3333-444455556666"
UUID_B = "9d8e7f6a-aaaa-bbbb-cccc-ddddeeeeffff"


def _synthetic_args(device) -> tuple:
    # rebuild_cuda_tensor's 15 arguments, with recognisable values
    return (
        torch.Tensor,
        (4,),
        (1,),
        0,
        "storage_cls",
        torch.float32,
        device,
        b"handle",
        16,
        0,
        False,
        b"refcount",
        0,
        b"event",
        True,
    )


def test_replace_device_slot_touches_only_the_device():
    args = _synthetic_args(0)
    out = ipc.replace_device_slot(args, UUID_A)
    assert out[ipc.DEVICE_SLOT] == UUID_A and ipc.DEVICE_SLOT == 6
    assert out[:6] == args[:6] and out[7:] == args[7:] and len(out) == len(args)
    with pytest.raises(ValueError, match="device is item 6"):
        ipc.replace_device_slot(args[:5], UUID_A)


def test_local_device_index_maps_uuids_and_keeps_ints():
    visible = [UUID_B, UUID_A]
    assert ipc.local_device_index(UUID_A, visible) == 1
    assert ipc.local_device_index("GPU-" + UUID_B.upper(), visible) == 0  # nvidia-smi spelling
    assert ipc.local_device_index(UUID_A, ["GPU-" + UUID_B, "GPU-" + UUID_A]) == 1
    assert ipc.local_device_index(3, visible) == 3
    with pytest.raises(TypeError):
        ipc.local_device_index(None, visible)
    with pytest.raises(TypeError):
        ipc.local_device_index(True, visible)


def test_unknown_uuid_error_names_the_uuid_and_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-" + UUID_B)
    with pytest.raises(ipc.IpcDeviceError) as err:
        ipc.local_device_index(UUID_A, [UUID_B])
    msg = str(err.value)
    assert UUID_A in msg and f"0={UUID_B}" in msg and "CUDA_VISIBLE_DEVICES='GPU-" in msg
    with pytest.raises(ipc.IpcDeviceError, match="no CUDA device"):
        ipc.local_device_index(UUID_A, [])


class _CudaHandle:
    """Pickles like a CUDA tensor reduced by ipc: torch's rebuild_cuda_tensor + args with a UUID."""

    def __init__(self, device):
        self.device = device

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, _synthetic_args(self.device)


def test_receiver_maps_the_uuid_before_torch_rebuilds(monkeypatch):
    payload = pickle.dumps([("w", _CudaHandle(UUID_A)), ("v", _CudaHandle(2))])
    assert "torch.multiprocessing.reductions.rebuild_cuda_tensor" in _globals(payload)
    calls = []
    monkeypatch.setattr(ipc, "visible_device_uuids", lambda: [UUID_B, UUID_A])
    monkeypatch.setattr(
        ipc, "reductions", SimpleNamespace(rebuild_cuda_tensor=lambda *a: calls.append(a) or len(calls))
    )
    assert ipc.deserialize_named_tensors(payload) == [("w", 1), ("v", 2)]
    assert [c[ipc.DEVICE_SLOT] for c in calls] == [1, 2]
    assert calls[0][:6] == _synthetic_args(0)[:6] and calls[0][7:] == _synthetic_args(0)[7:]


def test_receiver_error_for_a_gpu_it_cannot_see(monkeypatch):
    payload = pickle.dumps([("w", _CudaHandle(UUID_A))])
    monkeypatch.setattr(ipc, "visible_device_uuids", lambda: [UUID_B])
    with pytest.raises(ipc.IpcDeviceError, match=UUID_A):
        ipc.deserialize_named_tensors(payload)


def test_receiver_refuses_foreign_globals():
    with pytest.raises(pickle.UnpicklingError, match="posix.getcwd|os.getcwd"):
        ipc.deserialize_named_tensors(pickle.dumps([("x", os.getcwd)]))
    with pytest.raises(ValueError, match="list of"):
        ipc.deserialize_named_tensors(pickle.dumps({"x": 1}))


# ----------------------------------------------------------------------------------------------
# GPU: real IPC handles
# ----------------------------------------------------------------------------------------------

N_64MB = 16 * 2**20  # fp32 elements; every integer up to 2**24 is exact in fp32


@pytest.mark.gpu
@needs_cuda
def test_cuda_payload_is_a_handle_named_by_uuid():
    dev = torch.cuda.device_count() - 1
    t = torch.arange(N_64MB, dtype=torch.float32, device=f"cuda:{dev}")
    payload = ipc.serialize_named_tensors([("w", t)])
    assert len(payload) < 10_000, f"{len(payload)} bytes for a 64 MB tensor: data was copied"
    assert ipc.device_uuid(dev).encode() in payload
    assert "torch.multiprocessing.reductions.rebuild_cuda_tensor" in _globals(payload)
    bucket = next(ipc.ipc_buckets([("w", t.cpu())], 2**30, device=f"cuda:{dev}", dtype=torch.bfloat16, tp_size=2))
    assert bucket.keepalive[0].is_cuda and bucket.keepalive[0].dtype == torch.bfloat16
    assert all(len(p) < 15_000 for p in bucket.payloads)


@pytest.mark.gpu
@needs_cuda
def test_cuda_receiver_with_other_visible_devices_writes_through_the_handle(tmp_path):
    dev = torch.cuda.device_count() - 1  # on a multi-GPU host the receiver sees this one as index 0
    t = torch.arange(N_64MB, dtype=torch.float32, device=f"cuda:{dev}")
    torch.cuda.synchronize(dev)
    path = tmp_path / "payload.bin"
    path.write_bytes(ipc.serialize_named_tensors([("w", t)]))
    receiver = (
        "import sys, torch\n"
        "from rollflow.tasks.sync.ipc import deserialize_named_tensors\n"
        "assert torch.cuda.device_count() == 1, torch.cuda.device_count()\n"
        "[(name, t)] = deserialize_named_tensors(open(sys.argv[1], 'rb').read())\n"
        "assert name == 'w' and t.device == torch.device('cuda', 0), t.device\n"
        f"expected = torch.arange({N_64MB}, dtype=torch.float32, device=t.device)\n"
        "assert torch.equal(t, expected), 'values differ'\n"
        "t[0] = 42\n"
        "torch.cuda.synchronize()\n"
        "print('receiver ok', t.device)\n"
    )
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "GPU-" + ipc.device_uuid(dev),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", receiver, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "receiver ok cuda:0" in proc.stdout
    torch.cuda.synchronize(dev)
    assert t[0].item() == 42.0  # the receiver wrote into the sender's memory: zero copy
    assert t[1].item() == 1.0 and t[-1].item() == N_64MB - 1
