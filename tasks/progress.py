"""Progress counters the workers keep, so a waiting client can tell a slow call from a stalled one.

A worker's default concurrency group runs the long call (a rollout, a train step, a weight sync); its control
group answers `progress()` meanwhile (docs/architecture.md section 6.1). The counter only has to move while
work is done: decode steps, micro-batches, weight buckets, finished calls. Its value means nothing else.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


class Progress:
    """A monotonic counter of work done, ticked by the working thread and read by another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def tick(self, n: int = 1) -> None:
        with self._lock:
            self._n += n

    @property
    def value(self) -> int:
        return self._n


@runtime_checkable
class ReportsProgress(Protocol):
    """An engine or backend that counts its own units of work (decode steps, requests, micro-batches)."""

    progress: Progress


def progress_of(*parts: object) -> int:
    """The sum of the counters of those `parts` that keep one (the others count 0)."""
    return sum(p.progress.value for p in parts if isinstance(p, ReportsProgress))
