"""Weight fingerprints (tasks/sync/parity.py): every changed bit is caught, on any device, at any size."""

from __future__ import annotations

import struct

import pytest
import torch

from rollflow.tasks.sync import parity
from rollflow.tasks.sync.parity import checksums, compare, tensor_checksum

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def reference(tensor: torch.Tensor) -> str:
    """The documented formula in plain Python integers, from the tensor's bytes."""
    raw = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 8)
    words = struct.unpack(f"<{len(raw) // 8}Q", raw)
    digits = ""
    for mul, add in ((0x9E3779B97F4A7C16, 0x2545F4914F6CDD1D), (0xC2B2AE3D27D4EB4E, 0x165667B19E3779F9)):
        h = sum(w * (i * mul + add) for i, w in enumerate(words)) % (1 << 64)
        digits += f"{h:016x}"
    return f"{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|{digits}"


def _sample(dtype: torch.dtype, shape=(13, 7), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_is_the_documented_formula(dtype):
    for shape in [(13, 7), (1,), (), (0, 4), (3, 5, 2)]:
        t = _sample(dtype, shape)
        assert tensor_checksum(t) == reference(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    t = _sample(dtype, (5, 7))
    base = tensor_checksum(t)
    n_bytes = t.numel() * t.element_size()
    for byte in range(n_bytes):
        for bit in range(8):
            flipped = t.clone()
            flipped.reshape(-1).view(torch.uint8)[byte] ^= 1 << bit
            assert tensor_checksum(flipped) != base, (byte, bit)


def test_dtype_shape_and_swaps_are_mismatches():
    t = _sample(torch.float32, (4, 6))
    assert tensor_checksum(t) != tensor_checksum(t.reshape(6, 4))
    assert tensor_checksum(t) != tensor_checksum(t.view(torch.int32))
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tensor_checksum(t) != tensor_checksum(swapped)
    report = compare(checksums({"a": t, "b": t * 2}), checksums({"a": t, "b": t * 2 + 1e-7}))
    assert report.mismatched == ["b"]


def test_views_offsets_and_threads_do_not_change_it():
    base = torch.arange(200, dtype=torch.uint8)
    odd = base[3:90]  # storage offset not a multiple of 8 bytes, length not either
    assert tensor_checksum(odd) == tensor_checksum(odd.clone()) == reference(odd)
    t = _sample(torch.float32, (300, 301))
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_checksum(t)
        torch.set_num_threads(2)
        assert tensor_checksum(t) == one
    finally:
        torch.set_num_threads(threads)


def test_chunked_sums_equal_one_pass(monkeypatch):
    t = _sample(torch.bfloat16, (97, 33), seed=3)
    whole = tensor_checksum(t)
    monkeypatch.setattr(parity, "_CHUNK_WORDS", 10)  # many chunks, a short last one
    assert tensor_checksum(t) == whole == reference(t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fingerprint_equals_cpu():
    named = {f"t{i}": _sample(dt, (257, 129), seed=i) for i, dt in enumerate(DTYPES)}
    big = torch.randn(5_000_000, dtype=torch.bfloat16)  # several chunks
    named["big"] = big
    on_cpu = checksums(named)
    on_gpu = checksums({k: v.cuda() for k, v in named.items()})
    assert on_gpu == on_cpu
    flipped = big.cuda()
    flipped.view(torch.int16)[4_999_999] ^= 1
    assert checksums({"big": flipped})["big"] != on_cpu["big"]
