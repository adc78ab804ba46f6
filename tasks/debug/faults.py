"""Fault injection for the alignment checks: reproduce each known failure on purpose.

Explicit, opt-in helpers (no global flags): `run_alignment(..., faults=AlignmentFaults(...))` calls
them, tests and users reproducing a failure do too. Each one breaks exactly what one check guards.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterable
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from rollflow.tasks.progress import Progress
from rollflow.tasks.rollout.hf_engine import HFEngine

GibberishMode = Literal["shuffle", "random"]
SyncFault = Literal["corrupt_tensor", "swap_layers"]


class AlignmentFaults(BaseModel):
    """Failures to inject into an alignment run (all off by default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    gibberish_weights: Optional[GibberishMode] = Field(
        None, description="engine and trainer (policy + reference) start from shuffled or random weights (check 1)"
    )
    perturb_ref_std: float = Field(
        0.0, ge=0, description="gaussian noise added to the reference model's weights (check 2)"
    )
    engine_temperature: Optional[float] = Field(
        None,
        gt=0,
        description="the engine samples and scores log-probs at this temperature, the trainer at the "
        "configured one (check 3)",
    )
    perturb_policy_std: float = Field(
        0.0, ge=0, description="noise added to the policy after the old log-probs, before the first step (check 4)"
    )
    sync: Optional[SyncFault] = Field(None, description="corrupt one tensor or swap two layers in transit (check 5)")
    sync_tensor: Optional[str] = Field(None, description="tensor that `sync` corrupts (default: one of the last layer)")
    nondeterministic_logits_std: float = Field(
        0.0,
        ge=0,
        description="reproducibility gate: the second run's trainer adds noise from an unseeded generator "
        "to its logits (tasks/debug/repro_faults.py)",
    )
    greedy_sampling: bool = Field(
        False,
        description="reproducibility gate: both runs' engines sample greedily (top_k=1) at the configured "
        "temperature > 0 (the group-diversity guard's fault)",
    )
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.describe())

    def describe(self) -> list[str]:
        out = []
        if self.gibberish_weights:
            out.append(f"gibberish_weights={self.gibberish_weights} (engine and trainer)")
        if self.perturb_ref_std:
            out.append(f"perturb_ref_std={self.perturb_ref_std:g} (reference model)")
        if self.engine_temperature is not None:
            out.append(f"engine_temperature={self.engine_temperature:g} (engine only)")
        if self.perturb_policy_std:
            out.append(f"perturb_policy_std={self.perturb_policy_std:g} (after old log-probs)")
        if self.sync:
            out.append(f"sync={self.sync}" + (f" ({self.sync_tensor})" if self.sync_tensor else ""))
        if self.nondeterministic_logits_std:
            out.append(f"nondeterministic_logits_std={self.nondeterministic_logits_std:g} (second gate run's trainer)")
        if self.greedy_sampling:
            out.append("greedy_sampling (engine, temperature unchanged)")
        return out

    def refusal(self, lora: bool) -> str | None:
        """Why these faults cannot act on the run's trainer, in one line (None: they can). Asked before any worker
        starts."""
        if self.perturb_ref_std and lora:
            return (
                "faults.perturb_ref_std: under model.lora the reference is the base model with the adapters off, "
                "the weights the policy is built on, so there is no reference of its own to perturb; run this "
                "drill on the config without model.lora"
            )
        return None

    @property
    def repro_only(self) -> list[str]:
        """The faults only the reproducibility gate applies (refused without it: a fault that does nothing)."""
        return [name for name in ("nondeterministic_logits_std", "greedy_sampling") if getattr(self, name)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def scramble_module(module: torch.nn.Module, mode: GibberishMode, seed: int = 0) -> None:
    """Replace every tensor by a permutation of its values ("shuffle") or by fresh init-scale noise
    ("random"). Deterministic per (seed, tensor name), so two copies of a model scramble alike."""
    for index, (name, tensor) in enumerate(sorted(module.state_dict().items())):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():  # megatron's _extra_state: None
            continue
        g = _generator(seed * 1_000_003 + index)
        if mode == "shuffle":
            flat = tensor.detach().reshape(-1).cpu()
            new = flat[torch.randperm(flat.numel(), generator=g)].reshape(tensor.shape)
        elif mode == "random":
            if tensor.dim() > 1:
                new = torch.randn(tensor.shape, generator=g, dtype=torch.float32) * 0.02
            else:
                new = torch.ones(tensor.shape) if name.endswith("norm.weight") else torch.zeros(tensor.shape)
        else:
            raise ValueError(f"gibberish mode {mode!r}: expected 'shuffle' or 'random'")
        tensor.copy_(new.to(device=tensor.device, dtype=tensor.dtype))


@torch.no_grad()
def perturb_module(module: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Add N(0, std^2) noise to every floating-point parameter (in place)."""
    perturb_tensors(module.parameters(), std, seed)


def perturb_tensors(tensors: Iterable[torch.Tensor], std: float, seed: int = 0) -> None:
    """Add N(0, std^2) noise to every floating-point tensor (in place), in the order given."""
    g = _generator(seed)
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32) * std
                tensor.add_(noise.to(device=tensor.device, dtype=tensor.dtype))


_LAYER = re.compile(r"(^|\.)(layers|h|blocks)\.(\d+)\.")


def default_sync_tensor(names: list[str]) -> str:
    """A tensor of the last layer (where a pipeline-stage name-mapping bug would land)."""
    layered = [(int(m.group(3)), n) for n in names if (m := _LAYER.search(n))]
    if not layered:
        return sorted(names)[len(names) // 2]
    last = max(i for i, _ in layered)
    return sorted(n for i, n in layered if i == last)[0]


def apply_sync_fault(
    named: dict[str, torch.Tensor], fault: SyncFault, tensor: str | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """A copy of `named` with one tensor corrupted or the tensors of two layers swapped; plus what was done."""
    out = dict(named)
    if fault == "corrupt_tensor":
        name = tensor or default_sync_tensor(list(out))
        if name not in out:
            raise KeyError(f"sync fault: no tensor {name!r} in the weights")
        bad = out[name].detach().clone()
        flat = bad.view(-1)
        flat[0] = flat[0] + max(1e-3, float(flat[0].abs()) * 1e-2)
        out[name] = bad
        return out, f"corrupted {name} (element 0)"
    if fault == "swap_layers":
        layer_ids = sorted({int(m.group(3)) for n in out if (m := _LAYER.search(n))})
        if len(layer_ids) < 2:
            raise ValueError("sync fault swap_layers: the model has fewer than two numbered layers")
        a, b = layer_ids[0], layer_ids[1]
        for name in list(named):
            m = _LAYER.search(name)
            if m and int(m.group(3)) in (a, b):
                other = b if int(m.group(3)) == a else a
                twin = name[: m.start(3)] + str(other) + name[m.end(3) :]
                out[name] = named[twin]
        return out, f"swapped layers {a} and {b}"
    raise ValueError(f"sync fault {fault!r}: expected 'corrupt_tensor' or 'swap_layers'")


def freeze_serving_model(engine: HFEngine) -> None:
    """Stale serving (the post-sync probe's fault): from now on the hf engine generates from a frozen copy of its
    current model, while weight updates keep landing in the original tensors, which are also the ones its
    checksums read. Every parity check passes; only what the engine serves is stale, as with a KV / prefix cache
    not flushed or a CUDA graph captured before the update (SkyRL#1680, verl#7904)."""
    engine.model = copy.deepcopy(engine.model)


SLOW_TICK_S = 0.25


def slow_down(progress: Progress, seconds: float) -> None:
    """A slow call that keeps making progress (debug.slow_train_s): the stall deadline must leave it alone, and a
    SIGSTOP of the stall drill lands inside the call instead of between two calls (docs/checks.md)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(min(SLOW_TICK_S, max(0.0, until - time.monotonic())))
        progress.tick()
