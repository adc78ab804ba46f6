"""Host copies in pinned memory, for moving a trainer's state off the GPU while a colocated engine uses it."""

from __future__ import annotations

import torch


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` in pinned memory, started asynchronously (synchronize before freeing `t`'s storage)
    so that the copy back to the GPU can be asynchronous too."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
