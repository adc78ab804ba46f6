"""Test-only actor classes for the fault drills (importable by Ray workers: classes travel by reference).

`CrashOnceRolloutWorker` kills its own process in the middle of one rollout - after the first
generation batch, before the second - exactly once per run (a marker file remembers), the way an
engine dies of an OOM or a segfault. Every rollout it serves is logged with the process id, so a
drill can prove that a different process (the restarted actor) finished the crashed rollout.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tasks.rollout.worker import RolloutWorker

CRASH_ROLLOUT_ID = 1
DRILL_DIR = Path(tempfile.gettempdir()) / "rollflow-drills"


def drill_files(run: str) -> tuple[Path, Path]:
    """(crash marker, pid log) of the engine actor of `run` (the actor is named '<run>:engine')."""
    stem = f"{run}-engine"
    return DRILL_DIR / f"{stem}.crashed", DRILL_DIR / f"{stem}.pids"


def _run_name() -> str:
    import ray

    name = ray.get_runtime_context().get_actor_name() or "unnamed:engine"
    return name.rsplit(":", 1)[0]


class CrashOnceRolloutWorker(RolloutWorker):
    def rollout(self, rollout_id: int, split: str = "train", *, greedy: bool = False):
        marker, pids = drill_files(_run_name())
        DRILL_DIR.mkdir(parents=True, exist_ok=True)
        with pids.open("a") as fh:
            fh.write(f"{split} {rollout_id} {os.getpid()}\n")
        if split == "train" and rollout_id == CRASH_ROLLOUT_ID and not marker.exists():
            generate_batch = self.engine._generate_batch
            batches: list[int] = []

            def dying_batch(*args, **kwargs):
                if batches:  # the second batch: this rollout is half done
                    marker.write_text(f"killed pid {os.getpid()} mid-rollout {rollout_id}\n")
                    os._exit(1)
                batches.append(1)
                return generate_batch(*args, **kwargs)

            self.engine._generate_batch = dying_batch
        return super().rollout(rollout_id, split, greedy=greedy)
