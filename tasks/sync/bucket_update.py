"""A weight update that arrives bucket by bucket, applied to an in-process engine's resident weights (the `hf`
engine's `tensor` path: the trainer's GPU buckets, by CUDA IPC between two actors or directly in one process).

Each bucket is copied in as it comes, so the engine never holds a second copy of the model; the trainer frees a
bucket once the engine has loaded it. The update counts what was written: only a complete one (every weight, or
for a tied weight the tensor it shares) may give the engine its new weight_version, so a sync cut short never
passes for a successful one. What it wrote stays written; parity then names the engine stale.
"""

from __future__ import annotations

from typing import Iterable

import torch

from rollflow.tasks.sync.copy_plan import copy_eagerly


class BucketedUpdate:
    """One sync's progress over `targets` (the engine's weights by HF name, where they live); `aliases`: tied names
    -> the name whose tensor they share (`ResidentWeights.aliases`)."""

    def __init__(self, targets: dict[str, torch.Tensor], aliases: dict[str, str]):
        self.targets = targets
        self.aliases = aliases
        self.written: set[str] = set()

    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket in. Every name and shape is checked before anything is written, so a bad bucket changes
        nothing."""
        names, dst, src = [], [], []
        for name, tensor in named:
            target = self.targets.get(name)
            if target is None:
                raise KeyError(
                    f"weight update: the trainer sent {name!r}, which the engine does not hold (check the "
                    "trainer->engine name mapping)"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight update: {name} has shape {tuple(tensor.shape)}, the engine expects {tuple(target.shape)}"
                )
            names.append(name)
            dst.append(target)
            src.append(tensor)
        copy_eagerly(dst, src)
        self.written.update(names)

    def missing(self) -> list[str]:
        """The engine's weights no bucket has written so far (a tied name counts as written with its tensor)."""
        done = self.written | {alias for alias, first in self.aliases.items() if first in self.written}
        return sorted(set(self.targets) - done)
