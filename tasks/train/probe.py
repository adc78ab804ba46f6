"""The trainer's half of the post-sync probe (tasks/sync/probe.py): the engine's probe tokens, teacher-forced."""

from __future__ import annotations

import dataclasses

from rollflow.artifacts.sample import Sample
from rollflow.tasks.train.batch import batch_from_samples, per_sample
from rollflow.tasks.train.step import TrainBackend


def probe_log_probs(backend: TrainBackend, samples: list[Sample]) -> list[list[float]]:
    """The policy's log-prob of every response token of `samples`, in order: the same scoring forward as the
    old log-probs of a train step (so the probe compares exactly what the mismatch metrics compare)."""
    # Never trained on, so never rewarded: a zero reward only satisfies the batch builder.
    batch = batch_from_samples([dataclasses.replace(s, reward=0.0) for s in samples], group_size=1)
    log_probs = backend.compute_log_probs(batch, "policy").float().cpu()
    return [row.tolist() for row in per_sample(log_probs, batch.response_mask)]
