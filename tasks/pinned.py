"""Host copies in pinned memory, for moving a model's state off the GPU while a colocated worker uses it.

Pinned (page-locked) host memory is what lets a copy between host and GPU run at the bus's speed and without
blocking the host. A pageable copy (`Module.to("cpu")`) is several times slower, and pinning fresh host memory costs
about as much again, so a model parked every iteration keeps its pinned buffers (docs/performance.md 7).

`HostShelf` is where those buffers live: one allocation per batch of new tensors, of exactly their size, its pages
touched on every core and then registered with the driver. torch's own pinned allocator (`pin_memory=True`) takes a
block per tensor, rounded up to a power of two (up to 2x the host memory), and page-locks it on one thread at a few
GiB/s, which is most of a fresh node's first iteration beyond a steady one (docs/performance.md 7).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

ALIGN = 4096  # every buffer starts on its own page: any dtype's view is aligned, and no two share a page


def page_locked(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is page-locked host memory the driver knows, however it got so (torch's pinned
    allocator or `HostShelf`'s registration). `Tensor.is_pinned()` answers for torch's allocator only (False for
    registered memory in torch 2.11), so it cannot tell. Asks the driver API, which leaves the runtime's last-error
    state alone; False without a CUDA driver."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    memory_type = ctypes.c_uint(0)
    # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2; CU_MEMORYTYPE_HOST = 1 (pageable memory: an error code instead)
    rc = driver.cuPointerGetAttribute(ctypes.byref(memory_type), 2, ctypes.c_void_p(t.data_ptr()))
    return rc == 0 and memory_type.value == 1


def _register(base: torch.Tensor) -> None:
    """Page-lock `base` (a contiguous host tensor) until it is collected."""
    cudart = torch.cuda.cudart()
    nbytes = base.numel() * base.element_size()
    rc = cudart.cudaHostRegister(base.data_ptr(), nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 2**30:.1f} GiB of host memory failed ({rc}): the host is short of "
            "memory it can lock; offload less (colocate=false) or use a host with more memory"
        )
    # Unregistered when the tensor object goes, which is before its memory can be freed (it holds the storage).
    weakref.finalize(base, cudart.cudaHostUnregister, base.data_ptr())


@dataclass
class HostShelf:
    """Host buffers by key, each the shape and dtype of the tensor it holds, kept and reused between calls.

    `pin` (default: a CUDA device is present) page-locks them; without it the shelf is plain host memory (what a
    CPU-only host can have, and what the carving is tested on)."""

    pin: bool = field(default_factory=torch.cuda.is_available)
    slots: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    blocks: list[torch.Tensor] = field(default_factory=list)  # the allocations the slots are views of

    def place(self, tensors: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """A buffer for each of `tensors` (same key), reusing this shelf's buffer of that key when its shape and
        dtype still match; the rest are carved from one new allocation of exactly their size. Values are not
        copied."""
        fresh = [
            (key, t)
            for key, t in tensors.items()
            if key not in self.slots or self.slots[key].shape != t.shape or self.slots[key].dtype != t.dtype
        ]
        if fresh:
            offsets, total = [], 0
            for _, t in fresh:
                offsets.append(total)
                total += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
            raw = torch.empty(total + ALIGN, dtype=torch.uint8)  # torch aligns to 64 bytes; start on a page
            base = raw[-raw.data_ptr() % ALIGN :][: max(total, 1)]
            if self.pin:
                base.zero_()  # touches every page on all cores; the driver's register would fault them in on one
                _register(base)
            self.blocks.append(base)
            for (key, t), offset in zip(fresh, offsets):
                nbytes = t.numel() * t.element_size()
                self.slots[key] = base[offset : offset + nbytes].view(t.dtype).view(t.shape)
        return {key: self.slots[key] for key in tensors}

    def nbytes(self) -> int:
        """Host memory this shelf holds."""
        return sum(b.numel() for b in self.blocks)


def _state(module: torch.nn.Module) -> list[torch.Tensor]:
    # Parameters and buffers, each once (a tied parameter is one object), moved by swapping `.data` as
    # `Module.to()` does, so references to the Parameters (and the ties) stay valid.
    seen: set[int] = set()
    out = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def park_on_host(module: torch.nn.Module, shelf: HostShelf) -> None:
    """`module`'s parameters and buffers to pinned host memory; their GPU memory is free once this returns.

    `shelf` (the caller's, kept between calls) holds one pinned buffer per tensor, reused by every later park:
    pinning fresh host memory costs about what a pageable copy does, so only the first park pays it."""
    on_gpu = [t for t in _state(module) if t.is_cuda]
    bufs = shelf.place({id(t): t for t in on_gpu})
    for t in on_gpu:
        buf = bufs[id(t)]
        buf.copy_(t.data, non_blocking=True)
        t.data = buf
    torch.cuda.synchronize()


def bring_back(module: torch.nn.Module, device: torch.device) -> None:
    """Undo `park_on_host`: the same values on `device` (the shelf keeps its buffers for the next park)."""
    for t in _state(module):
        if t.device != device:
            t.data = t.data.to(device, non_blocking=True)
    torch.cuda.synchronize()
