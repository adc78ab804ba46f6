"""Plain functions run next to a Ray actor's state, and actors stopped until their names are free: what the
checks that start their own workers share (stage replay, the reproducibility gate)."""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from rollflow.flows.group import WorkerGroup
from rollflow.tasks.debug.alignment import WorkerRunner


class ActorRunner(WorkerRunner):
    """Runs a module-level function next to a Ray actor's state (`__ray_call__`); tensors stay in the actor."""

    def __init__(self, actor: Any):
        self.actor = actor  # a Ray actor handle (a client's `.actor`)

    def defer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.actor.__ray_call__.remote(fn, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.defer(fn, *args, **kwargs))


def stop_and_wait(group: WorkerGroup, timeout: float = 30.0) -> None:
    """Kill the run's actors and wait until their names are free (a reused name would reuse state)."""
    group.stop_all()
    deadline = time.monotonic() + timeout
    while group.any_running():
        if time.monotonic() > deadline:
            raise RuntimeError(f"actors of run {group.run!r} still registered {timeout:.0f}s after being stopped")
        time.sleep(0.1)
