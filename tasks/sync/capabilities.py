"""The capabilities both sides share: weights readable where they live, a torch module held in the worker
(engines and trainers alike).

A `@runtime_checkable` protocol instead of a `getattr(x, "weight_tensors")` probe: an engine or backend
declares the capability by having the method, and callers ask with `isinstance`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ResidentTensors(Protocol):
    """The weights as they sit in memory (on the GPU: no host copy), for fingerprints computed in place.
    HFEngine and TorchBackend have it; the others only give host copies (`named_weights`)."""

    def weight_tensors(self) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class HoldsModule(Protocol):
    """A torch module in this process that the alignment faults can modify in place: the `hf` engine's, the
    torch backend's (megatron's first chunk, set when it is built). SGLang's engine holds none here."""

    model: torch.nn.Module


class NamedWeights(Protocol):
    def named_weights(self) -> dict[str, torch.Tensor]: ...


def weights_in_place(holder: NamedWeights) -> dict[str, torch.Tensor]:
    """`holder`'s weights where they live when it can give them so, else its host copies."""
    return holder.weight_tensors() if isinstance(holder, ResidentTensors) else holder.named_weights()
