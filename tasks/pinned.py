"""Host copies in pinned memory, for moving a model's state off the GPU while a colocated worker uses it.

Pinned (page-locked) host memory is what lets a copy between host and GPU run at the bus's speed and without
blocking the host. A pageable copy (`Module.to("cpu")`) is several times slower, and pinning fresh host memory costs
about as much again, so a model parked every iteration keeps its pinned buffers (docs/performance.md 7).
"""

from __future__ import annotations

import torch


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` in pinned memory, started asynchronously (synchronize before freeing `t`'s storage)
    so that the copy back to the GPU can be asynchronous too."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


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


def park_on_host(module: torch.nn.Module, shelf: dict[int, torch.Tensor]) -> None:
    """`module`'s parameters and buffers to pinned host memory; their GPU memory is free once this returns.

    `shelf` (the caller's, kept between calls) holds one pinned buffer per tensor, reused by every later park:
    pinning fresh host memory costs about what a pageable copy does, so only the first park pays it."""
    for t in _state(module):
        if not t.is_cuda:
            continue
        buf = shelf.get(id(t))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = shelf[id(t)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t.data, non_blocking=True)
        t.data = buf
    torch.cuda.synchronize()


def bring_back(module: torch.nn.Module, device: torch.device) -> None:
    """Undo `park_on_host`: the same values on `device` (the shelf keeps its buffers for the next park)."""
    for t in _state(module):
        if t.device != device:
            t.data = t.data.to(device, non_blocking=True)
    torch.cuda.synchronize()
