"""A deliberately broken Triton kernel: the IMA reproducer's real illegal memory access (CUDA only).

Imported only when the `triton_oob` fault fires, so nothing else depends on Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

FAR = 1 << 40  # elements past the buffer: terabytes away from any allocation


@triton.jit
def rollflow_ima_oob_store(dst, src, n, far, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vals = tl.load(src + offs, mask=mask, other=0.0)
    # The bug: the store is offset by `far` elements, far outside `dst`'s allocation.
    tl.store(dst + far + offs, vals, mask=mask)


def oob_store(t, far: int = FAR) -> None:
    """Launch the faulting kernel on tensor `t` (asynchronously, as any kernel launch)."""
    n = t.numel()
    block = 1024
    rollflow_ima_oob_store[(triton.cdiv(n, block),)](t, t, n, far, BLOCK=block)
