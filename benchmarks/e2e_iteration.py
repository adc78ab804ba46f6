"""One RL iteration driven the way `flows/iteration.py:rl_iteration` drives its actors under `placement=colocate,
offload=true`, without Prefect: either in one process, the rollout worker and the train worker being the plain
classes the actors wrap (`tasks/rollout/worker.py`, `tasks/train/worker.py`) called directly, or through the same
two classes as Ray actors behind rl_iteration's typed clients (`infra/clients.py`), to show what Ray adds.

Stage order (rl_iteration's, checkpoint left out):
generate -> reward -> persist -> engine release -> trainer onload -> load -> train -> engine resume weights ->
sync -> parity -> trainer offload -> engine resume KV cache.

Every stage boundary synchronises the device (in process), so each stage's time is its own work, not queued kernels
of the one before; the iteration's time is taken separately, from its first to its last boundary. Through Ray, each
stage ends when its actor call returns (the driver has no device of its own to synchronise).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol, TypeVar

import torch

from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig
from rollflow.tasks.rollout.worker import RolloutWorker
from rollflow.tasks.sync.parity import compare
from rollflow.tasks.train.memory_fit import engine_host_bytes_per_param
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
    bucket_bytes: int = 512 << 20  # the tensor path's buckets (rollout.sglang.bucket_mb's default)
    compile_cache: str | None = None  # store.compile_cache resolved: torch.compile's caches loaded / saved there

    @property
    def engine_host_bytes_per_param(self) -> float:
        """What the colocated engine keeps in host memory while the trainer trains (the fit check counts it)."""
        return engine_host_bytes_per_param(self.rollout.engine, self.rollout.dtype)

    @property
    def weight_sync(self) -> str:
        """The hf engine's path (object_store or tensor; the suite resolves auto as RunConfig does)."""
        return self.rollout.hf_weight_sync


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
    train_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # what the train stage returned

    def compute_s(self) -> float:
        return sum(self.seconds[s] for s in GENERATE_COMPUTE + TRAIN_COMPUTE)

    def overhead_s(self) -> float:
        """Iteration time not spent generating or training (NeMo-RL's overhead)."""
        return self.iteration_s - self.compute_s()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class IterationEngine(Protocol):
    """What an iteration asks of the engine side: RolloutWorker in process, EngineClient through Ray."""

    def rollout(self, rollout_id: int) -> list: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: list[str] | None = None) -> None: ...
    def update_weights(self, weights: Any, weight_version: int) -> int: ...
    def weight_checksums(self) -> dict[str, str]: ...
    def describe(self) -> Any: ...
    def visible_gpu(self) -> str | None: ...
    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...


class IterationTrainer(Protocol):
    """What an iteration asks of the trainer side: TrainWorker in process, TrainerClient through Ray."""

    def onload(self) -> bool: ...
    def offload(self) -> bool: ...
    def load_artifact(self, ref: ArtifactRef) -> int: ...
    def train_on_artifact(self, ref: ArtifactRef) -> dict[str, float]: ...
    def named_weights(self) -> Any: ...
    def weight_checksums(self, as_dtype: str | None = None) -> dict[str, str]: ...


@dataclasses.dataclass
class Workers:
    engine: IterationEngine
    trainer: IterationTrainer
    store: RolloutStore
    setup: Setup
    on_ray: bool = False


def _trainer_args(setup: Setup) -> tuple[tuple, dict]:
    """TrainWorker's arguments, as rl_train starts it (resident), in process or as an actor alike."""
    args = (setup.model, setup.optim, setup.algo)
    kwargs = {"store_root": setup.store_root, "run": RUN, "temperature": setup.rollout.temperature or 1.0}
    return args, kwargs | {
        "compile_cache": setup.compile_cache,
        "parks_on_host": True,
        "engine_host_bytes_per_param": setup.engine_host_bytes_per_param,
    }


def build_workers(setup: Setup) -> Workers:
    # The engine on the model's weights at version 0.
    engine = RolloutWorker(setup.model, setup.rollout, setup.data, compile_cache=setup.compile_cache)
    args, kwargs = _trainer_args(setup)
    return Workers(engine, TrainWorker(*args, **kwargs), RolloutStore(setup.store_root), setup)


RAY_RUN = "bench-e2e"


def build_ray_workers(setup: Setup, cuda: bool) -> Workers:
    """The same two workers as Ray actors (Ray already initialised), each behind the client rl_iteration uses.
    On CUDA both take half of the one GPU, as `placement=colocate` places them."""
    from rollflow.infra.clients import EngineClient, TrainerClient
    from rollflow.infra.workers import start_actor

    options = {"num_gpus": 0.5} if cuda else None
    engine = EngineClient(
        start_actor(
            RAY_RUN,
            "engine",
            RolloutWorker,
            setup.model,
            setup.rollout,
            setup.data,
            compile_cache=setup.compile_cache,
            options=options,
            wait=False,
        )
    )
    args, kwargs = _trainer_args(setup)
    trainer = start_actor(RAY_RUN, "trainer", TrainWorker, *args, options=options, wait=False, **kwargs)
    trainer = TrainerClient([trainer])
    engine.wait_started()
    trainer.wait_started()
    return Workers(engine, trainer, RolloutStore(setup.store_root), setup, on_ray=True)


def stop_ray_workers() -> None:
    from rollflow.infra.workers import stop_actor

    stop_actor(RAY_RUN, "engine")
    stop_actor(RAY_RUN, "trainer")


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
    cuda = device.startswith("cuda") and not w.on_ray  # through Ray the device is the actors', not this process's
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
    metrics = stage("train", lambda: trainer.train_on_artifact(ref))
    stage("engine_resume_weights", lambda: engine.resume_memory(["weights"]))
    stage("sync", lambda: sync_weights(w, rollout_id + 1))
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
        train_metrics=dict(metrics),
    )


def sync_weights(w: Workers, weight_version: int) -> None:
    """The hf engine's path, as rl_iteration's sync task takes it (flows/weight_sync/):
    - object_store: the trainer's HF-named host copies handed to the engine (Ray's object store between actors);
    - tensor: bucket by bucket as the trainer makes them on its device; between actors the flow's own code
      (`push_buckets`: CUDA IPC handles on a GPU), in one process the same buckets handed over directly."""
    setup, engine, trainer = w.setup, w.engine, w.trainer
    if setup.weight_sync == "object_store":
        engine.update_weights(trainer.named_weights(), weight_version)
    elif w.on_ray:
        from rollflow.flows.weight_sync.tensor import push_buckets

        gpu = engine.visible_gpu()
        push_buckets(
            trainer,
            engine,
            weight_version,
            bucket_bytes=setup.bucket_bytes,
            dtype=engine_cast(setup),
            gpus=[gpu] if gpu is not None else None,
        )
    else:
        if not (isinstance(engine, RolloutWorker) and isinstance(trainer, TrainWorker)):
            raise TypeError("in process the tensor path needs the workers themselves")
        engine.begin_weight_update()
        for bucket, last in trainer.weight_buckets(setup.bucket_bytes, engine_cast(setup)):
            engine.apply_bucket(bucket, last, weight_version)
        engine.end_weight_update()


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
