"""Copying a fixed set of tensors into another, every sync: the plan is made once and, on one GPU, replayed
as a CUDA graph.

A device-to-device weight update at 0.5B copies 1.26 GB in ~0.6 ms, and the host work around it (checks
per tensor, one launch per large tensor, the multi-tensor copy) took ~0.3 ms more per synchronised call
(docs/performance.md section 5). The pairs (engine tensor, trainer tensor) are the same objects at the
same addresses from one iteration to the next, so the checks and the launch sequence are done once: a
plan is keyed by the source tensors' addresses, shapes and dtypes and the destinations' addresses; while
the key holds, its copies replay as one CUDA graph (one launch). A key seen for the first time runs
eagerly and is captured only when it comes again, so a layout that changes every call (an engine that
moves between devices and comes back elsewhere) never pays for a capture it cannot reuse.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

# Tensors at least this large are copied one by one (a device memcpy runs at full bandwidth); the many
# small ones go through one multi-tensor copy (a few kernel launches instead of one per tensor).
MEMCPY_BYTES = 8 << 20


@dataclasses.dataclass
class CopyPlan:
    """No tensors held (a host-staged update's copies must be freed after the call): `keep` indexes the
    lists each call passes, and the key guarantees a replayed graph finds the same memory there."""

    key: tuple
    keep: tuple[int, ...]  # pairs to copy (a tied tensor sent twice is written once)
    memcpy_bytes: int = MEMCPY_BYTES
    graph: Any = None  # torch.cuda.CUDAGraph once captured, False if the capture was refused
    runs: int = 0


_PTR, _SIZE, _DTYPE = torch.Tensor.data_ptr, torch.Tensor.size, operator.attrgetter("dtype")


def plan_key(dst: list[torch.Tensor], src: list[torch.Tensor]) -> tuple:
    """What a plan depends on. The same key means the same copies between the same memory. (`map` over the
    unbound methods: this runs every sync, and a generator of attribute lookups costs 2-3x as much.)"""
    return tuple(map(_PTR, src)), tuple(map(_SIZE, src)), tuple(map(_DTYPE, src)), tuple(map(_PTR, dst))


def copy_eagerly(dst: list[torch.Tensor], src: list[torch.Tensor], memcpy_bytes: int = MEMCPY_BYTES) -> None:
    big_dst, big_src, small_dst, small_src = [], [], [], []
    for d, s in zip(dst, src):
        if d.numel() * d.element_size() >= memcpy_bytes:
            big_dst.append(d)
            big_src.append(s)
        else:
            small_dst.append(d)
            small_src.append(s)
    with torch.no_grad():
        for d, s in zip(big_dst, big_src):
            d.copy_(s)
        if small_dst:  # mixed devices or dtypes fall back to per-tensor copies inside `_foreach_copy_`
            torch._foreach_copy_(small_dst, small_src)


def _one_cuda_device(tensors: list[torch.Tensor]) -> torch.device | None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    return device if device.type == "cuda" else None


def _capture(dst: list[torch.Tensor], src: list[torch.Tensor], memcpy_bytes: int, device: torch.device) -> Any:
    """The copies as a CUDA graph, captured on a side stream (not `torch.cuda.graph`, which also
    synchronises, collects garbage and empties the cache: costs a capture does not need). None if the
    driver refuses; the plan then stays eager."""
    with torch.cuda.device(device):
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    copy_eagerly(dst, src, memcpy_bytes)
                finally:
                    graph.capture_end()
        except RuntimeError:
            return None
        current.wait_stream(side)
    return graph


def run_plan(plan: CopyPlan, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy `src` into `dst` (the lists `plan.key` was made from): replay the plan's graph, capture it on the
    second run, or copy eagerly (CPU, mixed devices, a capture the driver refused)."""
    plan.runs += 1
    if plan.graph is None and plan.runs >= 2:
        kept_dst, kept_src = [dst[i] for i in plan.keep], [src[i] for i in plan.keep]
        device = _one_cuda_device(kept_dst + kept_src)
        plan.graph = (_capture(kept_dst, kept_src, plan.memcpy_bytes, device) if device is not None else None) or False
    if plan.graph:
        plan.graph.replay()
    else:
        copy_eagerly([dst[i] for i in plan.keep], [src[i] for i in plan.keep], plan.memcpy_bytes)
