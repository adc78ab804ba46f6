"""The trainer with the slow-train fault armed (debug.slow_train_s, tasks/debug/faults.py).

A subclass, as tasks/debug/stale_serving.py: the train side never imports the debug toolkit, and the fault exists
only in runs that ask for it (flows/group.py picks this class).
"""

from __future__ import annotations

from typing import Any

from rollflow.tasks.debug.faults import slow_down
from rollflow.tasks.train.worker import TrainWorker


class SlowTrainWorker(TrainWorker):
    """Spends `slow_train_s` seconds, ticking its progress, before every train call's real work."""

    def __init__(self, *args: Any, slow_train_s: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slow_train_s = slow_train_s

    def train_on_artifact(self, ref: Any, **kwargs: Any) -> dict[str, float]:
        slow_down(self._progress, self._slow_train_s)
        return super().train_on_artifact(ref, **kwargs)
