"""Typed clients of the run's actors: one method per operation, typed arguments and results.

flows/ talks to its Ray actors only through these (docs/architecture.md section 6.3): "go to definition" lands on
the operation and a type checker sees a typo, where a method name in a string failed at run time.
Each method calls the actor method of the same name by attribute (`self.actor.rollout.remote(...)`).

- `TrainerClient`: every data-parallel rank of the trainer (tasks/train/worker.py:TrainWorker).
  Operations that run collectives (load, train, replay) go to every rank at once and return rank 0's
  result; the rest (checkpoint, weights, weight sync) ask rank 0, which holds the same state.
- `EngineClient`: the rollout worker (tasks/rollout/worker.py:RolloutWorker). `abort`, `inflight` and
  `alive` run in the actor's control concurrency group, so they answer while a rollout runs.
- `ServerClient`: one SGLang server actor (tasks/rollout/sglang/server_worker.py:SGLangServerWorker).
- `CriticClient`: the critic of advantage_estimator="ppo" (tasks/train/critic_worker.py:CriticWorker).

Calls that another actor consumes, or that must overlap (weight sync), return `Pending[T]`: its `ref`
goes to the other actor as an argument (Ray resolves it there: tensors go actor to actor), its
`result()` waits.

Placement, start, restart and stop live in the run's worker group (flows/group.py:WorkerGroup).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Generic, Literal, Sequence, TypeVar

from rollflow.infra import deadline
from rollflow.infra.workers import CONTROL

# The workers' results, defined where they are built (tasks/) and importable from here, beside the clients.
from rollflow.tasks.rollout.results import EngineChecks, EngineDescription, ServerInfo, WeightOverwriteCheck
from rollflow.tasks.train.results import BroadcastBucket, IpcBucket, TrainerDescription

if TYPE_CHECKING:
    import torch

    from rollflow.artifacts.sample import Sample
    from rollflow.artifacts.store import ArtifactRef
    from rollflow.tasks.sync.probe import ProbeSpec
    from rollflow.tasks.train.critic import CriticEstimate

__all__ = [
    "ActorUnavailable",
    "BroadcastBucket",
    "CriticClient",
    "EngineChecks",
    "EngineClient",
    "EngineDescription",
    "IpcBucket",
    "Pending",
    "ServerClient",
    "ServerInfo",
    "TrainerClient",
    "TrainerDescription",
    "WeightOverwriteCheck",
    "gather",
]

T = TypeVar("T")
WeightSyncMode = Literal["object_store", "disk", "tensor", "distributed", "lora_adapter"]
ALIVE_TIMEOUT_S = 60.0


class ActorUnavailable(RuntimeError):
    """An awaited actor's connection dropped mid-call: its process, its raylet or its whole node went away.

    Ray's own ActorUnavailableError names only the actor id; on a cluster the node is what the operator needs
    (a raylet killed, a host down), so this names the actor and its node and keeps Ray's error as the cause."""

    def __init__(self, actor: str, node: str, detail: str):
        self.actor, self.node, self.detail = actor, node, detail
        where = f" on node {node}" if node else ""
        super().__init__(
            f"actor {actor}{where} became unavailable mid-call (its process, its raylet or its node went away; "
            f"the call may or may not have run): {detail}"
        )

    def __reduce__(self):  # Prefect and Ray pickle exceptions: rebuild from the fields
        return (ActorUnavailable, (self.actor, self.node, self.detail))


def _get(ref: Any, timeout: float | None = None) -> Any:
    # Every wait on an actor call: under a task's stall watch it fails a stuck call (infra/deadline.py).
    import ray

    try:
        return deadline.wait(ref, timeout)
    except ray.exceptions.ActorUnavailableError as exc:
        raise _unavailable(ref, exc) from exc


def _unavailable(refs: Any, exc: Exception) -> ActorUnavailable:
    """The actor of `refs` named in `exc` (or the first one with an actor), with its node from the GCS table."""
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    ids = [r.task_id().actor_id() for r in (refs if isinstance(refs, list) else [refs])]
    ids = [a.hex() for a in ids if not a.is_nil()]
    actor_id = next((a for a in ids if a in str(exc)), ids[0] if ids else "")
    rows = deadline.actor_table(actor_id) if actor_id else []
    name = str(rows[0].get("Name") or actor_id) if rows else actor_id or "?"
    return ActorUnavailable(name, deadline.node_of(rows, rows[0].get("Name")) if rows else "", detail)


@dataclasses.dataclass(frozen=True)
class Pending(Generic[T]):
    """An actor call in flight. `ref` (a Ray ObjectRef) may be passed to another actor's call;
    `result()` waits for the value."""

    ref: Any

    def result(self, timeout: float | None = None) -> T:
        return _get(self.ref, timeout)


def gather(pending: Sequence[Pending[T]], timeout: float | None = None) -> list[T]:
    """Wait for several calls at once (they run concurrently); their results in order."""
    return _get([p.ref for p in pending], timeout)


def _ping(actor: Any, timeout: float | None = ALIVE_TIMEOUT_S) -> bool:
    """The actor's `ping`, in its control group (answers while the default group is busy)."""
    return bool(_get(actor.ping.options(concurrency_group=CONTROL).remote(), timeout))


def _alive(actor: Any) -> bool:
    try:
        return _ping(actor)
    except deadline.StallError:
        # The watch killed the actor and wrote its stacks: "not alive" would restart it silently, hiding the stall
        # that the task must fail with (its retry then restarts the actor).
        raise
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


# -- trainer ---------------------------------------------------------------------------------------------
class TrainerClient:
    """The trainer's ranks (rank 0 first; one rank without data parallelism)."""

    def __init__(self, ranks: Sequence[Any]):
        if not ranks:
            raise ValueError("a trainer has at least one rank")
        self.ranks = list(ranks)
        self._sharded: bool | None = None

    @property
    def sharded(self) -> bool:
        """Whether calls that read the weights must reach every rank (asked once per client)."""
        if self._sharded is None:
            self._sharded = len(self.ranks) > 1 and self.describe().sharded
        return self._sharded

    def _on(self, rank: int, call: Callable[[Any], Any]) -> Any:
        """`call(actor)` (which starts one actor call: `lambda a: a.weight_checksums.remote(...)`) on `rank`, or on
        every rank at once when the trainer is sharded (then `rank`'s result)."""
        if not self.sharded:
            return _get(call(self.ranks[rank]))
        return _get([call(a) for a in self.ranks])[rank]

    @property
    def actor(self) -> Any:
        """Rank 0's Ray actor handle (the one that writes checkpoints and serves weights)."""
        return self.ranks[0]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _rank0_of_all(self, refs: list[Any]) -> Any:
        return _get(refs)[0]

    # lifecycle
    def wait_started(self) -> None:
        """Wait until every rank's constructor ran (data-parallel ranks rendezvous in them)."""
        _get([a.ping.remote() for a in self.ranks])

    def alive(self) -> bool:
        return _alive(self.actor)

    def describe(self, rank: int = 0) -> TrainerDescription:
        return _get(self.ranks[rank].describe.remote())

    # training: every rank at once (collectives), rank 0's result
    def load_artifact(self, ref: ArtifactRef) -> int:
        """Load and checksum a rollout artifact ahead of `train_on_artifact`; its sample count."""
        return self._rank0_of_all([a.load_artifact.remote(ref) for a in self.ranks])

    def train_on_artifact(
        self,
        ref: ArtifactRef,
        *,
        subsample: float | None = None,
        dump_uri: str | None = None,
        reward_key: str | None = None,
        critic: Pending[CriticEstimate] | None = None,
        record_uri: str | None = None,
    ) -> dict[str, float]:
        """Train on the artifact (each rank on its share); the global metrics. `reward_key`: the run's
        field of dict rewards (slime's --reward-key), over the samples' own. `critic` (ppo): the critic's
        estimate for this artifact, still in flight; every rank receives it from the object store.
        `record_uri`: rank 0 writes the per-sample train records there (tasks/train/records.py)."""
        extra = {"critic": critic.ref} if critic is not None else {}
        return self._rank0_of_all(
            [
                a.train_on_artifact.remote(
                    ref, subsample=subsample, dump_uri=dump_uri, reward_key=reward_key, record_uri=record_uri, **extra
                )
                for a in self.ranks
            ]
        )

    def replay_step(
        self,
        ref: ArtifactRef,
        *,
        start_state_uri: str | None,
        out_state_uri: str,
        subsample: float | None = None,
        dump_uri: str | None = None,
        reward_key: str | None = None,
        critic: Pending[CriticEstimate] | None = None,
    ) -> dict[str, float]:
        """Train on a pinned artifact from a saved state (None: the initial one), save the result. `critic` (ppo):
        the replay's critic estimate of this artifact, as for `train_on_artifact`."""
        extra = {"critic": critic.ref} if critic is not None else {}
        return self._rank0_of_all(
            [
                a.replay_step.remote(
                    ref,
                    start_state_uri=start_state_uri,
                    out_state_uri=out_state_uri,
                    subsample=subsample,
                    dump_uri=dump_uri,
                    reward_key=reward_key,
                    **extra,
                )
                for a in self.ranks
            ]
        )

    def offload(self) -> bool:
        """Colocation: every rank's weights, grads and optimizer state to host memory while the engine generates."""
        return self._rank0_of_all([a.offload.remote() for a in self.ranks])

    def onload(self) -> bool:
        """Undo `offload` on every rank, before training."""
        return self._rank0_of_all([a.onload.remote() for a in self.ranks])

    def train_steps(self) -> list[dict[str, float]]:
        """Each optimizer step's statistics (loss, grad_norm, ...) of the last train or replay call (rank 0)."""
        return _get(self.actor.train_steps.remote())

    # rank 0
    def save_checkpoint(self, iteration: int, extra: dict[str, Any] | None = None) -> str:
        """Commit checkpoint `iteration` (`extra` goes into its meta.json); its folder. Every rank is called (a
        sharded trainer writes a distributed checkpoint; the others return at once and rank 0 writes)."""
        return self._rank0_of_all([a.save_checkpoint.remote(iteration, extra=extra) for a in self.ranks])

    def named_weights(self) -> Pending[dict[str, torch.Tensor]]:
        """HF-named weights, left in Ray's object store: pass `.ref` to an engine's call. A sharded trainer's
        ranks gather them together; rank 0's dict is the one passed on."""
        if not self.sharded:
            return Pending(self.actor.named_weights.remote())
        refs = [a.export_weights.remote() for a in self.ranks]
        _get(refs[1:])  # the other ranks took part in the gathers and return {}
        return Pending(refs[0])

    def weight_prefixes(self, n: int, as_dtype: str | None = None) -> dict[str, list[float]]:
        return self._on(0, lambda a: a.weight_prefixes.remote(n, as_dtype))

    def lora_adapter(self) -> Pending[dict[str, Any]]:
        """Rank 0's adapter in PEFT form ({"tensors", "config"}), left in Ray's object store for the engine."""
        return Pending(self.actor.lora_adapter.remote())

    def lora_adapter_checksums(self) -> dict[str, str]:
        return self._on(0, lambda a: a.lora_adapter_checksums.remote())

    def weight_checksums(self, as_dtype: str | None = None, *, rank: int = 0) -> dict[str, str]:
        return self._on(rank, lambda a: a.weight_checksums.remote(as_dtype))

    def score_probe(self, samples: list[Sample]) -> list[list[float]]:
        """The post-sync probe's teacher-forced log-probs (rank 0's; every rank joins when sharded)."""
        return self._on(0, lambda a: a.score_probe.remote(samples))

    # weight sync into SGLang engines (flows/weight_sync.py)
    # per-GPU tensor path: every engine TP rank takes the payload of the trainer rank on its own GPU
    def gpu_ids(self) -> list[str | None]:
        """Each rank's GPU as the Ray cluster numbers them (None on CPU)."""
        return list(_get([a.visible_gpu.remote() for a in self.ranks]))

    def _stepping(self, ranks: Sequence[int]) -> list[int]:
        """The ranks a bucket-by-bucket sync calls: `ranks`, or every rank when the trainer is sharded (its ranks
        make each bucket together)."""
        return list(range(len(self.ranks))) if self.sharded else list(ranks)

    def ipc_begin_ranks(
        self, bucket_bytes: int, copies: dict[int, int], dtype: str | None = None, flattened: bool = True
    ) -> None:
        """Start the tensor path on each rank in `copies` (rank -> payload copies it makes per bucket); a sharded
        trainer's other ranks step along with no copies."""
        _get(
            [
                self.ranks[r].ipc_begin.remote(bucket_bytes, copies.get(r, 0), dtype, flattened)
                for r in self._stepping(list(copies))
            ]
        )

    def ipc_next_ranks(self, ranks: Sequence[int]) -> dict[int, IpcBucket]:
        """The next bucket of each rank in `ranks` (every rank steps when sharded); `IpcBucket.last` on the last."""
        stepping = self._stepping(ranks)
        outs = dict(zip(stepping, _get([self.ranks[r].ipc_next.remote() for r in stepping])))
        return {r: outs[r] for r in ranks}

    def ipc_end_ranks(self, ranks: Sequence[int]) -> None:
        _get([self.ranks[r].ipc_end.remote() for r in self._stepping(ranks)])

    def weight_group_address(self) -> tuple[str, int]:
        address, port = _get(self.actor.weight_group_address.remote())
        return str(address), int(port)

    def join_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> None:
        _get(self.actor.join_weight_group.remote(master_address, master_port, world_size, group_name, backend))

    def weight_buckets_begin(self, bucket_bytes: int, dtype: str | None = None) -> None:
        """Start the broadcast path (rank 0 broadcasts; a sharded trainer's ranks make each bucket together)."""
        self._on(0, lambda a: a.weight_buckets_begin.remote(bucket_bytes, dtype))

    def next_weight_bucket(self) -> tuple[list[dict[str, Any]], bool]:
        """The next bucket's tensors' metadata (name, dtype, shape) in broadcast order, and whether it is the last."""
        bucket: BroadcastBucket = self._on(0, lambda a: a.next_weight_bucket.remote())
        return list(bucket.metas), bucket.last

    def broadcast_weight_bucket(self, device: str | None = None) -> int:
        """Broadcast the bucket `next_weight_bucket` described to the weight-update group; bytes sent."""
        return _get(self.actor.broadcast_weight_bucket.remote(device))


# -- critic (advantage_estimator="ppo") ------------------------------------------------------------------
class CriticClient:
    """The critic actor (tasks/train/critic_worker.py:CriticWorker), one rank beside the trainer."""

    def __init__(self, actor: Any):
        self.actor = actor

    def wait_started(self) -> None:
        _get(self.actor.ping.remote())

    def alive(self) -> bool:
        return _alive(self.actor)

    def estimate(self, ref: ArtifactRef, reward_key: str | None = None) -> Pending[CriticEstimate]:
        """Old values + GAE advantages / returns of the artifact: pass it to `TrainerClient.train_on_artifact`."""
        return Pending(self.actor.estimate.remote(ref, reward_key))

    def update(self) -> Pending[dict[str, float]]:
        """Value-loss steps on the last estimated rollout; its `critic/*` metrics."""
        return Pending(self.actor.update.remote())

    def save_checkpoint(self, iteration: int) -> str:
        """The critic's state beside checkpoint `iteration`'s payload (before its commit marker); its URI."""
        return _get(self.actor.save_checkpoint.remote(iteration))

    def restore(self, state_uri: str | None) -> None:
        """Replay: load a state saved by `save_state` (None: the critic's initial state)."""
        _get(self.actor.restore.remote(state_uri))

    def save_state(self, uri: str) -> str:
        return _get(self.actor.save_state.remote(uri))


# -- rollout worker ------------------------------------------------------------------------------------
class EngineClient:
    """The rollout worker actor (engine + tokenizer + prompt source)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def alive(self) -> bool:
        """The actor answers and its engine (server processes) lives."""
        return _alive(self.actor)

    def wait_started(self) -> None:
        _get(self.actor.ping.remote())

    def describe(self) -> EngineDescription:
        return _get(self.actor.describe.remote())

    def weight_version(self) -> int:
        return int(_get(self.actor.weight_version.remote()))

    def rollout(
        self,
        rollout_id: int,
        split: str = "train",
        *,
        greedy: bool = False,
        attempt: int = 0,
        continue_from: str | None = None,
        max_staleness: int = 0,
    ) -> list[Sample]:
        """`attempt` >= 1: a dynamic-sampling over-sampling call; `continue_from`: the artifact URI whose aborted
        groups are continued first (partial rollouts, trained with staleness <= `max_staleness`)."""
        extra = {"attempt": attempt} if attempt else {}
        if continue_from is not None:
            extra |= {"continue_from": continue_from, "max_staleness": max_staleness}
        return _get(self.actor.rollout.remote(rollout_id, split, greedy=greedy, **extra))

    def finish_aborted(self, rollout_id: int, samples: list[Sample]) -> list[Sample]:
        """Partial rollouts: generate the aborted samples of `samples` (groups marked aborted) to the end."""
        return _get(self.actor.finish_aborted.remote(rollout_id, samples))

    def start_rollout(self, rollout_id: int, split: str = "train", *, greedy: bool = False) -> Pending[list[Sample]]:
        """`rollout` without waiting (abort it with `abort`)."""
        return Pending(self.actor.rollout.remote(rollout_id, split, greedy=greedy))

    # control group: answers while a rollout runs
    def abort(self, rids: list[str] | None = None, *, timeout: float | None = 60.0) -> int:
        """Abort the running rollout's requests (all, or these); the abort calls sent."""
        return int(_get(self.actor.abort.options(concurrency_group=CONTROL).remote(rids), timeout))

    def inflight(self, *, timeout: float | None = 60.0) -> list[str]:
        """Request ids in flight now (SGLang engines; empty for in-process ones)."""
        return list(_get(self.actor.inflight.options(concurrency_group=CONTROL).remote(), timeout))

    # colocation (placement=colocate, offload=true)
    def release_memory(self) -> None:
        _get(self.actor.release_memory.remote())

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None = both)."""
        _get(self.actor.resume_memory.remote(tags))

    # weights and parity
    def update_weights(
        self, weights: Pending[dict[str, torch.Tensor]] | dict[str, torch.Tensor], weight_version: int
    ) -> int:
        """Load these weights (e.g. `trainer.named_weights()`, which goes actor to actor); the new version."""
        named = weights.ref if isinstance(weights, Pending) else weights
        return int(_get(self.actor.update_weights.remote(named, weight_version)))

    def weight_checksums(self) -> dict[str, str]:
        return _get(self.actor.weight_checksums.remote())

    def update_lora_adapter(self, adapter: Pending[dict[str, Any]] | dict[str, Any], weight_version: int) -> int:
        """Load a LoRA adapter (e.g. `trainer.lora_adapter()`, actor to actor) as the served one; the new version."""
        ref = adapter.ref if isinstance(adapter, Pending) else adapter
        return int(_get(self.actor.update_lora_adapter.remote(ref, weight_version)))

    def lora_report(self) -> dict[str, Any]:
        """The served adapter's name, its tensors' fingerprints as sent, and what every server lists."""
        return _get(self.actor.lora_report.remote())

    def weight_prefixes(self, names: list[str], n: int) -> dict[str, list[float]] | None:
        """First `n` values of the named tensors as served (None: the model cannot export them)."""
        return _get(self.actor.weight_prefixes.remote(names, n))

    def engine_checks(self, weight_version: int) -> EngineChecks:
        return _get(self.actor.engine_checks.remote(weight_version))

    def probe(self, spec: ProbeSpec) -> list[Sample]:
        """The post-sync probe's sequences, generated as rollouts are, with the engine's log-probs."""
        return _get(self.actor.probe.remote(spec))

    def prepare_overwrite_check(self) -> None:
        _get(self.actor.prepare_overwrite_check.remote())

    def finish_overwrite_check(self) -> WeightOverwriteCheck:
        return _get(self.actor.finish_overwrite_check.remote())

    # weight sync paths (flows/weight_sync.py)
    def weight_sync_mode(self) -> WeightSyncMode:
        return _get(self.actor.weight_sync_mode.remote())

    def payloads_per_bucket(self) -> int:
        return int(_get(self.actor.payloads_per_bucket.remote()))

    def visible_gpu(self) -> str | None:
        """The in-process engine's GPU as the cluster numbers them (None on CPU)."""
        return _get(self.actor.visible_gpu.remote())

    def apply_serialized_bucket(
        self, payloads: list[str], last: bool, weight_version: int, load_format: str | None = None
    ) -> int:
        return int(_get(self.actor.apply_serialized_bucket.remote(payloads, last, weight_version, load_format)))

    def begin_weight_update(self) -> None:
        """Open a weight-update session on every server (SGLang: tensor and distributed updates need one)."""
        _get(self.actor.begin_weight_update.remote())

    def end_weight_update(self, timeout: float | None = None) -> None:
        _get(self.actor.end_weight_update.remote(), timeout)

    def in_weight_group(self, group_name: str) -> bool:
        return bool(_get(self.actor.in_weight_group.remote(group_name)))

    def weight_group_world_size(self) -> int:
        return int(_get(self.actor.weight_group_world_size.remote()))

    def join_weight_group(self, master_address: str, master_port: int, group_name: str, backend: str) -> Pending[None]:
        """Start joining (it completes once the trainer joins too)."""
        return Pending(self.actor.join_weight_group.remote(master_address, master_port, group_name, backend))

    def receive_weight_bucket(
        self, metas: list[dict[str, Any]], last: bool, weight_version: int, group_name: str
    ) -> Pending[int]:
        """Start receiving a bucket (completes when the trainer has broadcast it); the engine's version."""
        return Pending(self.actor.receive_weight_bucket.remote(metas, last, weight_version, group_name))


# -- SGLang server actors --------------------------------------------------------------------------------
class ServerClient:
    """One engine's SGLang server actor."""

    def __init__(self, actor: Any):
        self.actor = actor

    @staticmethod
    def wait_started(servers: Sequence[ServerClient]) -> list[str]:
        """Wait for every server's constructor (launch + /health; they start concurrently); their URLs."""
        _get([s.actor.ping.remote() for s in servers])  # constructor errors (e.g. died at startup) surface here
        return list(_get([s.actor.url.remote() for s in servers]))

    def alive(self) -> bool:
        return bool(_get(self.actor.alive.remote()))

    def url(self) -> str:
        return _get(self.actor.url.remote())

    def info(self) -> ServerInfo:
        return _get(self.actor.info.remote())

    def poll(self) -> int | None:
        return _get(self.actor.poll.remote())

    def log_tail(self, n: int | None = None) -> list[str]:
        return _get(self.actor.log_tail.remote(n))

    def stop(self, timeout: float = 30.0) -> int | None:
        return _get(self.actor.stop.remote(timeout))
