"""One RL iteration driven in one process, the way `flows/iteration.py:rl_iteration` drives its actors under
`placement=colocate, offload=true`, without Ray or Prefect: the rollout worker and the train worker are the plain
classes the actors wrap (`tasks/rollout/worker.py`, `tasks/train/worker.py`), called directly.

Stage order (rl_iteration's, checkpoint left out):
generate -> reward -> persist -> engine release -> trainer onload -> load -> train -> engine resume weights ->
sync -> parity -> trainer offload -> engine resume KV cache.

Every stage boundary synchronises the device, so each stage's time is its own work, not queued kernels of the
one before; the iteration's time is taken separately, from its first to its last boundary.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, TypeVar

import torch

from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import compare
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig
from rollflow.tasks.train.worker import TrainWorker

STAGES = (
    "generate",
    "reward",
    "persist",
    "engine_release",
    "trainer_onload",
    "load",
    "train",
    "engine_resume_weights",
    "sync",
    "parity",
    "trainer_offload",
    "engine_resume_kv",
)
GENERATE_COMPUTE = ("generate",)
TRAIN_COMPUTE = ("train",)
RUN = "e2e"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the two workers are built from (the fields of RunConfig an iteration reads)."""

    model: str  # a local HF directory or builtin:addition
    rollout: RolloutConfig
    data: DataConfig
    optim: OptimConfig
    algo: AlgoConfig
    store_root: str


@dataclasses.dataclass(frozen=True)
class IterationTimes:
    """One iteration: seconds and (CUDA) peak allocated bytes per stage, the iteration's own wall time."""

    rollout_id: int
    seconds: dict[str, float]
    peak_bytes: dict[str, int]  # empty off CUDA
    iteration_s: float
    samples: int
    generated_tokens: int
    parity_ok: bool

    def compute_s(self) -> float:
        return sum(self.seconds[s] for s in GENERATE_COMPUTE + TRAIN_COMPUTE)

    def overhead_s(self) -> float:
        """Iteration time not spent generating or training (NeMo-RL's overhead)."""
        return self.iteration_s - self.compute_s()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Workers:
    engine: RolloutWorker
    trainer: TrainWorker
    store: RolloutStore
    setup: Setup


def build_workers(setup: Setup) -> Workers:
    # The trainer as rl_train starts it (resident); the engine on the model's weights at version 0.
    engine = RolloutWorker(setup.model, setup.rollout, setup.data)
    trainer = TrainWorker(
        setup.model,
        setup.optim,
        setup.algo,
        store_root=setup.store_root,
        run=RUN,
        temperature=setup.rollout.temperature or 1.0,
    )
    return Workers(engine, trainer, RolloutStore(setup.store_root), setup)


def engine_cast(setup: Setup) -> str | None:
    """The dtype the engine holds when it differs from the trainer's (parity compares in the engine's)."""
    return setup.rollout.dtype if setup.rollout.dtype != setup.optim.dtype else None


class StageClock:
    """Seconds and (on CUDA) peak allocated bytes of each named stage of one iteration: `clock(name, fn)` runs
    `fn` as stage `name`. A stage that raises names itself: which stage ran out of memory is what a shape that does
    not fit should say."""

    def __init__(self, rollout_id: int, cuda: bool):
        self.rollout_id, self.cuda = rollout_id, cuda
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    def __call__(self, name: str, fn: Callable[[], T]) -> T:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            out = fn()
            if self.cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            raise RuntimeError(f"iteration {self.rollout_id}, stage {name}: {type(exc).__name__}: {exc}") from exc
        if self.cuda:
            self.peaks[name] = torch.cuda.max_memory_allocated()
        self.seconds[name] = time.perf_counter() - start
        return out


def run_iteration(w: Workers, rollout_id: int, device: str) -> IterationTimes:
    cuda = device.startswith("cuda")
    stage = StageClock(rollout_id, cuda)
    seconds, peaks = stage.seconds, stage.peaks

    setup, engine, trainer = w.setup, w.engine, w.trainer
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    samples = stage("generate", lambda: engine.rollout(rollout_id))
    reward_fn = reward_fn_from_config(setup.rollout)
    samples = stage("reward", lambda: score_samples(samples, reward_fn, reward_key=setup.rollout.reward_key))
    ref = stage("persist", lambda: _persist(w, rollout_id, samples))
    stage("engine_release", engine.release_memory)
    stage("trainer_onload", trainer.onload)
    stage("load", lambda: trainer.load_artifact(ref))
    stage("train", lambda: trainer.train_on_artifact(ref))
    stage("engine_resume_weights", lambda: engine.resume_memory(["weights"]))
    # The hf engine's path (object_store): the trainer's HF-named tensors handed to the engine, here without the
    # Ray object store between the two (one process).
    stage("sync", lambda: engine.update_weights(trainer.named_weights(), rollout_id + 1))
    cast = engine_cast(setup)
    report = stage("parity", lambda: compare(trainer.weight_checksums(cast), engine.weight_checksums()))
    if not report.ok:
        raise RuntimeError(report.summary())
    stage("trainer_offload", trainer.offload)
    stage("engine_resume_kv", lambda: engine.resume_memory(["kv_cache"]))
    iteration_s = time.perf_counter() - started
    return IterationTimes(
        rollout_id=rollout_id,
        seconds=seconds,
        peak_bytes=peaks,
        iteration_s=iteration_s,
        samples=len(samples),
        generated_tokens=sum(s.response_length for s in samples),
        parity_ok=report.ok,
    )


def _persist(w: Workers, rollout_id: int, samples) -> ArtifactRef:
    d = w.engine.describe()
    return w.store.write(
        RUN,
        "train",
        rollout_id,
        samples,
        n_samples_per_prompt=w.setup.rollout.n_samples_per_prompt,
        engine=EngineInfo(backend=d.backend, model=d.model, weight_version=d.weight_version),
        config_hash="benchmark",
    )
