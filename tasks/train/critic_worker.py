"""The critic's stateful worker (`advantage_estimator="ppo"`): value model + optimizer + its checkpoint.

A plain class, run by `infra/` as a Ray actor beside the policy trainer (flows/group.py). Per rollout:

1. `estimate(ref)`: load the artifact, score the old values, GAE -> `CriticEstimate` (values, whitened
   advantages, returns). The estimate goes to the trainer actor by reference (Ray's object store), never
   through the orchestrator.
2. `update()`: value-loss steps on that rollout, fitting the values to its GAE returns; the `critic/*`
   metrics. The flow calls it after the policy's step (flows/iteration.py says why).
3. `save_checkpoint(iteration)`: `critic.pt` in the policy checkpoint's folder, written BEFORE the policy's
   commit marker, so a committed iteration always has its critic state (and an uncommitted one is skipped
   as a whole on resume).

Replay (flows/debug.py) chains states as the trainer does: `restore(start_state_uri)` (None: the initial
critic), estimate, the policy's step, `update`, `save_state(out_state_uri)`.

The critic is a torch model whatever the policy's train.backend (megatron included): it shares no weights
with the engine, so it needs none of the megatron trainer's alignment or sync machinery.
"""

from __future__ import annotations

from rollflow.artifacts.slime import check_token_ids
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.progress import Progress, progress_of
from rollflow.tasks.train.advantages import gae_advantages
from rollflow.tasks.train.batch import TrainBatch, batch_from_samples
from rollflow.tasks.train.checkpoint import CheckpointError, checkpoint_uri, load_state, save_state
from rollflow.tasks.train.critic import CriticBackend, CriticEstimate
from rollflow.tasks.train.settings import AlgoConfig, OptimConfig

CRITIC_PAYLOAD = "critic.pt"


def critic_state_uri(store_root: str, run: str, iteration: int) -> str:
    return checkpoint_uri(store_root, run, iteration, CRITIC_PAYLOAD)


class CriticWorker:
    def __init__(
        self,
        model_spec: str,
        optim: OptimConfig,
        algo: AlgoConfig,
        *,
        store_root: str,
        run: str,
        resume_iteration: int | None = None,
        storage_options: dict | None = None,
    ):
        self.optim, self.algo = optim, algo
        self.store_root, self.run, self.storage_options = store_root, run, storage_options
        self.store = RolloutStore(store_root, storage_options)
        causal_lm = load_model(resolve_model_path(model_spec), dtype=DTYPES[optim.dtype], device=optim.device)
        self.backend = CriticBackend(causal_lm, optim, algo)
        self._batch: TrainBatch | None = None  # the last estimated rollout, which `update` trains on
        self._progress = Progress()  # estimates and updates done, for a stall deadline
        # kept by the first `restore` (replay only; rl_train never restores): what `restore(None)` loads
        self._initial_state: bytes | None = None
        if resume_iteration:
            uri = critic_state_uri(store_root, run, resume_iteration)
            try:
                state = load_state(uri, storage_options=storage_options)
            except CheckpointError as exc:
                raise CheckpointError(
                    f"checkpoint {resume_iteration} of run {run!r} has no usable critic state "
                    f"({exc}); a ppo run resumes with its critic"
                ) from None
            self.backend.load_checkpoint_bytes(state)

    def ping(self) -> bool:
        return True

    def progress(self) -> int:
        return self._progress.value + progress_of(self.backend)

    def estimate(self, ref: ArtifactRef, reward_key: str | None = None) -> CriticEstimate:
        """Old values and GAE advantages / returns of the artifact's samples, in their order."""
        uri = ref.uri
        artifact = self.store.load_uri(uri)
        samples = artifact.samples
        check_token_ids(
            samples,
            self.backend.vocab_size,
            rollout_id=artifact.manifest.rollout_id,
            split=artifact.manifest.split,
            uri=uri,
        )
        if reward_key is not None:  # the run's key of dict rewards, as the trainer applies it
            for sample in samples:
                if isinstance(sample.reward, dict):
                    sample.reward_key = reward_key
        # GAE works per sample: no prompt groups needed (group_size 1 always divides).
        batch = batch_from_samples(samples, group_size=1)
        batch.values = self.backend.compute_values(batch)
        batch.advantages, batch.returns = gae_advantages(
            batch.rewards, batch.values, batch.response_mask, gamma=self.algo.gamma, lambd=self.algo.lambd
        )
        self._batch = batch
        self._progress.tick()
        return CriticEstimate(values=batch.values, advantages=batch.advantages.float(), returns=batch.returns)

    def update(self) -> dict[str, float]:
        """Fit the values to the returns of the last `estimate`; the `critic/*` metrics."""
        if self._batch is None:
            raise RuntimeError("CriticWorker.update before estimate: nothing to train on")
        batch, self._batch = self._batch, None
        metrics = self.backend.train(batch)
        self._progress.tick()
        return metrics

    def restore(self, state_uri: str | None) -> None:
        """Load a saved critic state (`save_state`), or with None the state this worker started in."""
        self._batch = None
        if self._initial_state is None:
            # A replay's first restore, before this worker trained: the state it started in, as host bytes.
            self._initial_state = self.backend.checkpoint_bytes()
            if state_uri is None:
                return
        data = load_state(state_uri, storage_options=self.storage_options) if state_uri else self._initial_state
        self.backend.load_checkpoint_bytes(data)

    def save_state(self, uri: str) -> str:
        """The critic's state (model + optimizer) at `uri`, e.g. beside a replay step's trainer state."""
        return save_state(uri, self.backend.checkpoint_bytes(), storage_options=self.storage_options)

    def save_checkpoint(self, iteration: int) -> str:
        """`critic.pt` (+ its sha256 sidecar) in checkpoint `iteration`'s folder; its URI."""
        return save_state(
            critic_state_uri(self.store_root, self.run, iteration),
            self.backend.checkpoint_bytes(),
            storage_options=self.storage_options,
        )
