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

from rollflow.tasks.rollout.worker import RolloutWorker

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


# ---------------------------------------------------------------------------- placement / colocation
def calls_file(run: str) -> Path:
    """Where the recording workers below log their calls for run `run` (one line per call)."""
    return DRILL_DIR / f"{run}-calls.log"


def _log_call(what: str) -> None:
    DRILL_DIR.mkdir(parents=True, exist_ok=True)
    with calls_file(_run_name()).open("a") as fh:
        fh.write(what + "\n")


def _placement_line(role: str, **extra) -> str:
    import ray

    pg = ray.util.get_current_placement_group()
    fields = {"pg": pg.id.hex() if pg else "none", "pid": os.getpid(), **extra}
    return f"start {role} " + " ".join(f"{k}={v}" for k, v in fields.items())


class RecordingRolloutWorker(RolloutWorker):
    """Logs its start (placement group, base GPU id) and the colocation calls, in order."""

    def __init__(self, *args, base_gpu_id: int | None = None, **kwargs):
        super().__init__(*args, base_gpu_id=base_gpu_id, **kwargs)
        _log_call(_placement_line("engine", base_gpu_id=base_gpu_id))

    def release_memory(self) -> None:
        _log_call("release")
        super().release_memory()

    def resume_memory(self, tags=None) -> None:
        _log_call("resume " + ",".join(tags or ["all"]))
        super().resume_memory(tags)

    def update_weights(self, named, weight_version: int) -> int:
        _log_call(f"update {weight_version}")
        return super().update_weights(named, weight_version)


from rollflow.tasks.train.worker import TrainWorker  # noqa: E402


class RecordingTrainWorker(TrainWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _log_call(_placement_line("trainer"))

    def train_on_artifact(self, *args, **kwargs):
        _log_call("train")
        return super().train_on_artifact(*args, **kwargs)

    def offload(self):
        _log_call("trainer offload")
        return super().offload()

    def onload(self):
        _log_call("trainer onload")
        return super().onload()


class CpuMegatronTrainWorker(TrainWorker):
    """A trainer actor whose Megatron runs on CPU: megatron-core's CUDA-hard-coded DDP / schedule / optimizer
    paths go through the test-only shims (tests/megatron_cpu_shim.py) for the whole life of the actor process,
    and the product's refusal of multi-rank megatron off CUDA is lifted here (only here: the product never
    patches torch)."""

    def __init__(self, *args, **kwargs):
        import rollflow.tasks.train.worker as train_module
        from tests.megatron_cpu_shim import cpu_megatron

        self._shim = cpu_megatron()
        self._shim.__enter__()
        train_module.megatron_multi_rank_refusal = lambda optim: None
        super().__init__(*args, **kwargs)
