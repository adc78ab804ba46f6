"""Faults of the reproducibility gate (`AlignmentFaults.nondeterministic_logits_std`, `.greedy_sampling`).

Module-level functions that run next to a worker's state (the flow's `ActorRunner`): they change that one
worker object (a hook on its model, a copy of its sampling settings), never a module global, so the fault
ends with the actor.
"""

from __future__ import annotations

from typing import Any

import torch

from rollflow.tasks.debug.train_checks import backend_of


def add_logit_noise(model: torch.nn.Module, std: float) -> torch.utils.hooks.RemovableHandle:
    """Every forward of `model` adds N(0, std^2) noise to its logits, drawn from a generator seeded from OS
    entropy: the stand-in for a nondeterministic kernel (atomics, split-K reductions) that no seed fixes."""
    generator = torch.Generator()
    generator.seed()  # unseeded on purpose: a fresh, unrepeatable seed

    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits = output.logits
        noise = torch.randn(logits.shape, generator=generator, dtype=torch.float32) * std
        output.logits = logits + noise.to(device=logits.device, dtype=logits.dtype)
        return output

    return model.register_forward_hook(hook)


def trainer_logit_noise(worker: Any, std: float) -> None:
    backend = backend_of(worker)
    model = getattr(backend, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fault nondeterministic_logits_std: {type(backend).__name__} has no torch `model`")
    add_logit_noise(model, std)


def engine_greedy_sampling(worker: Any) -> None:
    """The engine keeps its temperature (and so its log-probs) but only ever picks the top token."""
    worker.rollout_cfg = worker.rollout_cfg.model_copy(update={"top_k": 1})
