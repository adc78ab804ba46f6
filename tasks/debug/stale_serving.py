"""The rollout worker with the stale-serving fault armed (debug.serve_stale, tasks/debug/faults.py).

A subclass instead of a flag inside RolloutWorker: the rollout side never imports the debug toolkit, and the
fault exists only in runs that ask for it (flows/group.py picks this class).
"""

from __future__ import annotations

from rollflow.tasks.debug.faults import freeze_serving_model
from rollflow.tasks.rollout.hf_engine import HFEngine
from rollflow.tasks.rollout.worker import RolloutWorker


class StaleServingWorker(RolloutWorker):
    """Serves its starting weights forever while taking (and checksumming) every update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.engine, HFEngine):
            raise ValueError(
                f"debug.serve_stale is a fault of the hf engine; rollout.engine="
                f"{self.rollout_cfg.engine!r} has no model copy to freeze: set rollout.engine='hf'"
            )
        freeze_serving_model(self.engine)
