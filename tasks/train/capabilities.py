"""What a train backend can do beyond the `TrainBackend` protocol (tasks/train/step.py).

Each capability is a small `@runtime_checkable` protocol: a backend declares it by having the members
(structurally: TorchBackend and MegatronBackend inherit from none of these), and `TrainWorker` asks with
`isinstance` rather than probing names with `getattr` / `hasattr`. docs/architecture.md lists which backend
has which.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch


@runtime_checkable
class Sharded(Protocol):
    """A backend whose ranks may each hold only part of the state (megatron tp / pp / cp > 1, virtual stages,
    a distributed optimizer). When `sharded` is true, checkpoints are Megatron distributed checkpoints written
    by every rank, and reading the weights is a collective."""

    sharded: bool

    def save_distributed(self, directory: str) -> None: ...

    def load_distributed(self, directory: str) -> None: ...

    def all_ranks_finite(self) -> bool: ...


@runtime_checkable
class Offloadable(Protocol):
    """Colocated placement: weights, grads and optimizer state go to host memory while the engine generates,
    and come back bit for bit before training."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...


@runtime_checkable
class BucketExporter(Protocol):
    """Streams its HF-named weights in buckets of about `bucket_bytes` (in `dtype`; None: as they are), so a
    weight sync never holds a second copy of the model (megatron: per layer; a collective when sharded)."""

    def export_buckets(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterable[list[tuple[str, torch.Tensor]]]: ...


@runtime_checkable
class KnowsVocabSize(Protocol):
    """The model's vocabulary size (None: unknown), so token ids beyond it are refused before the forward."""

    vocab_size: int | None


@runtime_checkable
class ModuleReference(Protocol):
    """The frozen reference as a second module beside the policy (the torch backend; None when the run keeps no
    reference): the alignment drills scramble or perturb it in place."""

    ref_model: torch.nn.Module | None


@runtime_checkable
class HostReference(Protocol):
    """The frozen reference is a host copy of the starting weights swapped into the one model (megatron), not a
    second module (the torch backend's `ref_model`): the alignment drills perturb or reset it through these."""

    def reference_tensors(self) -> dict[str, torch.Tensor] | None: ...

    def reset_reference(self) -> None: ...
