"""The train side's stateful worker: backend (policy, reference, optimizer) + checkpoints.

A plain class; `infra/` runs it as a Ray actor, GPU scripts and tests may call it directly. It reads
its inputs from the artifact store by reference, so nothing big crosses the orchestrator.

Data parallel (`dp`, torch backend only): one TrainWorker per rank. Construction, `train_on_artifact`
and `replay_step` run collectives, so they must be called on EVERY rank concurrently with the same
arguments; everything else is local (and the ranks' weights are identical, so rank 0 answers for all).
"""

from __future__ import annotations

import shutil
from typing import Any, Iterator

import torch

from rollflow.artifacts.pipeline_meta import trained_rows
from rollflow.artifacts.sample import Sample
from rollflow.artifacts.slime import check_token_ids
from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.compile_cache import CompileCacheSaver, load_compile_cache
from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.progress import Progress, progress_of
from rollflow.tasks.sync.capabilities import ResidentTensors, weights_in_place
from rollflow.tasks.sync.ipc import visible_gpu
from rollflow.tasks.sync.parity import checksums, checksums_of_buckets, tensor_prefix
from rollflow.tasks.train.capabilities import BucketExporter, KnowsVocabSize, Offloadable, Sharded
from rollflow.tasks.train.checkpoint import (
    checkpoint_dir,
    distributed_payload,
    is_distributed_payload,
    load_checkpoint,
    load_state,
    save_checkpoint,
    save_state,
)
from rollflow.tasks.train.critic import CriticEstimate
from rollflow.tasks.train.data_parallel import DataParallel
from rollflow.tasks.train.dump import train_dump_bytes
from rollflow.tasks.train.lora_backend import LoraTorchBackend
from rollflow.tasks.train.megatron.backend import build_megatron_backend  # megatron-core itself loads on use
from rollflow.tasks.train.memory_fit import check_trainer_fits, safetensors_params
from rollflow.tasks.train.mismatch import corrects
from rollflow.tasks.train.probe import probe_log_probs
from rollflow.tasks.train.records import records_bytes, sample_records
from rollflow.tasks.train.replay import infer_group_size, subsample_groups
from rollflow.tasks.train.results import BroadcastBucket, IpcBucket, TrainerDescription
from rollflow.tasks.train.settings import LORA_BACKEND_REFUSED, AlgoConfig, LoraSettings, OptimConfig
from rollflow.tasks.train.step import train_on_samples
from rollflow.tasks.train.torch_backend import TorchBackend
from rollflow.tasks.train.weight_sender import WeightSender, dict_buckets

# A parity check streams a bucket exporter's weights this much at a time (a layer's tensors are its unit).
PARITY_BUCKET_BYTES = 256 << 20

MEGATRON_DP_REFUSED = (
    "multi-rank Megatron through the train worker runs on CUDA with Megatron's optimizer "
    "(train.device=cuda, train.megatron.optimizer=auto|megatron): megatron-core's DDP, schedule and "
    "optimizer allocate CUDA tensors; use train.backend=torch for data parallel on CPU, or trainer_gpus=1"
)


def megatron_multi_rank_refusal(optim: OptimConfig) -> str | None:
    """Why this megatron config cannot run as several TrainWorker ranks, or None if it can."""
    m = optim.megatron
    if not (str(optim.device).startswith("cuda") and m.optimizer in ("auto", "megatron")):
        return MEGATRON_DP_REFUSED
    return None


def build_backend(
    model_spec: str,
    optim: OptimConfig,
    *,
    temperature: float,
    dp: DataParallel | None = None,
    lora: LoraSettings | None = None,
    parks_on_host: bool = False,
    node_ranks: int = 1,
    engine_host_bytes_per_param: float = 0.0,
):
    """The backend of `optim.backend`; `dp` makes the backend one rank of a data-parallel group; `lora`
    (model.lora) trains adapters on a frozen base (torch only); `parks_on_host`: colocated offload will move
    the state to host memory (counted by the fit check, for `node_ranks` trainer ranks on this node, beside
    `engine_host_bytes_per_param` of its engines' weights)."""
    multi_rank = dp is not None and dp.enabled
    if lora is not None and optim.backend != "torch":
        raise NotImplementedError(LORA_BACKEND_REFUSED)
    if optim.backend == "megatron" and multi_rank and (why := megatron_multi_rank_refusal(optim)):
        # Refused before anything loads or joins a group.
        raise NotImplementedError(f"{why} (got world_size={dp.world_size})")
    model_dir = resolve_model_path(model_spec)  # checked once (config, weight index), then read by what follows
    if optim.check_memory_fit:  # before a weight is read (tasks/train/memory_fit.py)
        check_trainer_fits(
            safetensors_params(model_dir),
            optim,
            world=dp.world_size if multi_rank else 1,
            lora=lora is not None,
            parks_on_host=parks_on_host,
            node_ranks=node_ranks,
            engine_host_bytes_per_param=engine_host_bytes_per_param,
        )
    if optim.backend == "megatron":
        return build_megatron_backend(model_dir, optim, temperature=temperature, dp=dp if multi_rank else None)
    if optim.backend != "torch":
        raise NotImplementedError(f"train.backend={optim.backend!r} is not available; use 'torch' or 'megatron'")

    # Loaded in the trainer's dtype and device (a bf16 model is never materialised in fp32 first).
    model = load_model(model_dir, dtype=DTYPES[optim.dtype], device=optim.device)
    if lora is not None:
        return LoraTorchBackend(model, optim, lora, temperature=temperature, dp=dp)
    return TorchBackend(model, optim, temperature=temperature, dp=dp)


class TrainWorker:
    def __init__(
        self,
        model_spec: str,
        optim: OptimConfig,
        algo: AlgoConfig,
        *,
        store_root: str,
        run: str,
        temperature: float = 1.0,
        resume_iteration: int | None = None,
        storage_options: dict | None = None,
        dp: DataParallel | None = None,
        lora: LoraSettings | None = None,
        compile_cache: str | None = None,
        parks_on_host: bool = False,
        node_ranks: int = 1,
        engine_host_bytes_per_param: float = 0.0,
    ):
        """`dp`: this worker is one rank of a data-parallel trainer (one TrainWorker per rank, all built
        concurrently: construction blocks until every rank has joined). `lora`: model.lora. `compile_cache`: a
        folder URL of torch.compile's caches, loaded before anything compiles; rank 0 writes it after its first train
        call (tasks/compile_cache.py). `parks_on_host`: placement=colocate with offload=true, so the state must also
        fit the node's host memory (tasks/train/memory_fit.py) beside the other `node_ranks` - 1 trainer ranks
        of this node and `engine_host_bytes_per_param` of its engines' weights."""
        load_compile_cache(compile_cache, "trainer")
        self._compile_cache = CompileCacheSaver(compile_cache if (dp is None or dp.rank == 0) else None, "trainer")
        self.optim = optim
        self.dp = dp
        self.algo = algo
        self.run = run
        self.store_root = store_root
        self.storage_options = storage_options
        self.store = RolloutStore(store_root, storage_options)
        self.backend = build_backend(
            model_spec,
            optim,
            temperature=temperature,
            dp=dp,
            lora=lora,
            parks_on_host=parks_on_host,
            node_ranks=node_ranks,
            engine_host_bytes_per_param=engine_host_bytes_per_param,
        )
        # No rank holds the whole state (megatron tp / pp > 1): checkpoints are distributed, weight reads collective.
        self.sharded = isinstance(self.backend, Sharded) and bool(self.backend.sharded)
        self._steps: list[dict[str, float]] = []  # per-optimizer-step statistics of the last train call
        self._consecutive_skips = 0  # optimizer steps skipped in a row (non-finite loss / grad norm)
        self._trained = False  # a train call ran (a sharded trainer's initial state is then gone)
        self._loaded: tuple[str, Any] | None = None  # (uri, artifact) of `load_artifact`, taken by the next train call
        self._weight_sender: WeightSender | None = None  # made on the first weight sync
        self._progress = Progress()  # artifacts loaded, weight buckets sent (the backend counts its micro-batches)
        # The exact starting state (weights, empty optimizer, RNG), so a replay can start from it again.
        self._initial_state = None if self.sharded else self.backend.checkpoint_bytes()
        if resume_iteration is not None:
            payload = load_checkpoint(store_root, run, resume_iteration, storage_options=storage_options)
            if self.sharded:
                self._load_distributed(resume_iteration, payload)
            elif is_distributed_payload(payload):
                raise ValueError(
                    f"checkpoint {resume_iteration} of run {run!r} is a sharded megatron trainer's "
                    "(Megatron's distributed format); this trainer holds the whole state and cannot read "
                    "it: resume with the train.megatron layout and trainer_gpus that wrote it"
                )
            else:
                self.backend.load_checkpoint_bytes(payload)

    def ping(self) -> bool:
        return True

    def progress(self) -> int:
        """Work done so far (micro-batches, weight buckets); a stall deadline watches it move."""
        return self._progress.value + progress_of(self.backend)

    @property
    def is_primary(self) -> bool:
        """Rank 0 (or the only rank): the one that writes checkpoints, states and dumps."""
        return self.dp is None or self.dp.is_primary

    def describe(self) -> TrainerDescription:
        """Backend and data-parallel placement of this worker (for logs and checks)."""
        return TrainerDescription(
            backend=self.backend.name,
            rank=self.dp.rank if self.dp else 0,
            world_size=self.dp.world_size if self.dp else 1,
            dp_backend=self.dp.backend if self.dp and self.dp.enabled else None,
            sharded=self.sharded,
        )

    def load_artifact(self, ref: ArtifactRef) -> int:
        """Load (and checksum) a rollout artifact ahead of `train_on_artifact`; returns its sample count.

        Kept separate so the orchestrator can retry a transient storage failure of the load without
        ever retrying a train step that may already have stepped the optimizer.
        """
        uri = ref.uri
        artifact = self.store.load_uri(uri)
        self._progress.tick()
        self._loaded = (uri, artifact)
        return len(artifact)  # the artifact stays columnar: no Sample objects are built

    def _artifact(self, ref: ArtifactRef):
        uri = ref.uri
        loaded, self._loaded = self._loaded, None
        if loaded is not None and loaded[0] == uri:
            return loaded[1]
        return self.store.load_uri(uri)

    def _vocab_size(self) -> int | None:
        return self.backend.vocab_size if isinstance(self.backend, KnowsVocabSize) else None

    def train_on_artifact(
        self,
        ref: ArtifactRef,
        *,
        subsample: float | None = None,
        dump_uri: str | None = None,
        reward_key: str | None = None,
        critic: CriticEstimate | None = None,
        record_uri: str | None = None,
    ) -> dict[str, float]:
        """`critic`: advantage_estimator='ppo' only, the critic actor's estimate for this same artifact;
        `record_uri`: where the per-sample train records go (tasks/train/records.py; stage replay reads them)."""
        if critic is not None and subsample is not None:
            raise ValueError("a critic estimate covers the whole rollout; it cannot be combined with subsample")

        self._trained = True
        artifact = self._artifact(ref)
        samples = artifact.columns  # the batch is built from the columns: no Python object per token
        # An id >= the vocab would be an IndexError deep in the forward (a device-side assert on GPU).
        check_token_ids(
            samples,
            self._vocab_size(),
            rollout_id=artifact.manifest.rollout_id,
            split=artifact.manifest.split,
            uri=ref.uri,
        )
        if reward_key is not None:  # the run's key of dict rewards wins over the samples' own (as slime)
            samples = samples.with_reward_key(reward_key)
        # Groups kept in the artifact but not trained (dynamic-sampling filter, partial rollouts): a replay of
        # the artifact drops exactly the rows the run dropped.
        samples = trained_rows(samples)
        group_size = artifact.manifest.n_samples_per_prompt
        if group_size <= 1 and len(samples) > 1:
            group_size = infer_group_size(samples)
        if subsample is not None:
            samples = subsample_groups(samples, subsample, group_size)
        # slime dumps without behaviour log-probs import with zeros: never correct with them.
        missing = samples.metadata_flag("rollout_log_probs_missing")
        if missing and (corrects(self.algo) or self.algo.use_rollout_logprobs):
            raise ValueError(
                f"algo.use_tis / use_rs / rs_veto_threshold / use_rollout_logprobs need the rollout engine's "
                f"log-probs, but rollout {artifact.manifest.rollout_id} was imported without them; turn them off "
                "for this replay"
            )
        result = train_on_samples(
            self.backend,
            samples,
            self.algo,
            group_size=group_size,
            compute_ref=self.optim.compute_ref_log_probs,
            critic=critic,
        )
        self._steps = result.steps
        self._count_skips(result.steps, artifact.manifest.rollout_id)
        if dump_uri is not None and self.is_primary:
            self._write(dump_uri, train_dump_bytes(result.batch, artifact.manifest.rollout_id))
        if record_uri is not None and self.is_primary:
            self._write(record_uri, records_bytes(sample_records(result.batch, artifact.manifest.rollout_id)))
        metrics = result.metrics | {"train/n_samples": float(len(samples))}
        self._compile_cache.after_work()
        if missing:
            for key in ("train/train_rollout_logprob_abs_diff", "rollout/rollout_log_probs"):
                metrics.pop(key, None)
            metrics["rollout/rollout_log_probs_missing"] = 1.0
        return metrics

    def _count_skips(self, steps: list[dict[str, float]], rollout_id: int) -> None:
        """Log each skipped optimizer step with its rollout id; fail after too many in a row (across rollouts)."""
        import logging

        for index, step in enumerate(steps):
            if not step.get("skipped"):
                self._consecutive_skips = 0
                continue
            self._consecutive_skips += 1
            logging.getLogger("rollflow.train").warning(
                "rollout %d, optimizer step %d/%d skipped: loss=%s grad_norm=%s (not finite); the weights are "
                "unchanged (%d in a row)",
                rollout_id,
                index + 1,
                len(steps),
                step.get("loss"),
                step.get("grad_norm"),
                self._consecutive_skips,
            )
        limit = self.algo.max_consecutive_skipped_steps
        if self._consecutive_skips >= limit:
            raise FloatingPointError(
                f"{self._consecutive_skips} optimizer steps in a row had a NaN/inf loss or grad norm (last: rollout "
                f"{rollout_id}); stopped before more are lost (algo.max_consecutive_skipped_steps={limit}). "
                f"Replay that rollout with a dump (`rollflow replay`, debug.dump_details) to see which tokens"
            )

    def train_steps(self) -> list[dict[str, float]]:
        """Each optimizer step's statistics of the last `train_on_artifact` / `replay_step` (global on every
        rank, like its metrics). Kept apart from the metrics so their dict stays one row of floats."""
        return list(self._steps)

    def replay_step(
        self,
        ref: ArtifactRef,
        *,
        start_state_uri: str | None,
        out_state_uri: str,
        subsample: float | None = None,
        dump_uri: str | None = None,
        reward_key: str | None = None,
        critic: CriticEstimate | None = None,
    ) -> dict[str, float]:
        """Train on one pinned artifact from a given state, and save the resulting state. `critic`: ppo's
        estimate of this artifact by the replay's critic (restored to the same starting point)."""
        if self.sharded:
            return self._replay_step_distributed(
                ref,
                start_state_uri=start_state_uri,
                out_state_uri=out_state_uri,
                subsample=subsample,
                dump_uri=dump_uri,
                reward_key=reward_key,
                critic=critic,
            )
        start = (
            load_state(start_state_uri, storage_options=self.storage_options)
            if start_state_uri
            else self._initial_state
        )
        if is_distributed_payload(start):
            raise ValueError(
                f"trainer state {start_state_uri} is a sharded trainer's (Megatron distributed checkpoint); "
                "this trainer holds the whole state: replay with the layout that wrote it"
            )
        self.backend.load_checkpoint_bytes(start)
        metrics = self.train_on_artifact(
            ref, subsample=subsample, dump_uri=dump_uri, reward_key=reward_key, critic=critic
        )
        if self.is_primary:  # every rank holds the same state after the step
            save_state(out_state_uri, self.backend.checkpoint_bytes(), storage_options=self.storage_options)
        return metrics

    def _replay_step_distributed(
        self, ref: ArtifactRef, *, start_state_uri: str | None, out_state_uri: str, **train_kwargs
    ) -> dict[str, float]:
        """`replay_step` of a sharded trainer: the states are Megatron distributed checkpoints in a `dist/` folder
        beside the state file, which holds the format's stub and is committed (sidecar) after every rank wrote."""
        if start_state_uri:
            payload = load_state(start_state_uri, storage_options=self.storage_options)
            if not is_distributed_payload(payload):
                raise ValueError(
                    f"trainer state {start_state_uri} holds a whole (single-rank) state; this trainer is "
                    "sharded and loads Megatron's distributed checkpoints: replay with the layout that "
                    "wrote it, or without the cache (--no-cache)"
                )
            self.backend.load_distributed(self._state_dist_dir(start_state_uri))
        elif self._trained:
            # The initial state of a sharded trainer is the model it started from, not a copy kept in memory.
            raise RuntimeError(
                "a sharded trainer replays from its initial state only before it has trained: start "
                "a new replay (its workers start from the model)"
            )
        metrics = self.train_on_artifact(ref, **train_kwargs)
        self._write_shards(self._state_dist_dir(out_state_uri), f"replay state {out_state_uri}")
        if self.is_primary:
            save_state(out_state_uri, distributed_payload(), storage_options=self.storage_options)
        return metrics

    def _write(self, uri: str, data: bytes) -> None:
        import posixpath

        fs, path = open_fs(uri, self.storage_options)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(data)

    def save_checkpoint(self, iteration: int, extra: dict | None = None) -> str:
        """`extra` (JSON) goes into the checkpoint's meta.json, e.g. the data source's cursor.

        Data parallel: rank 0 writes; the other ranks hold the same state and only return the folder.
        No collective, so calling it on rank 0 alone or on every rank are both fine.
        """
        if self.sharded:  # every rank writes its shards: call it on every rank at once
            return self._save_distributed(iteration, extra)
        if not self.is_primary:
            return checkpoint_dir(open_fs(self.store_root, self.storage_options)[1], self.run, iteration)
        bad = [
            name
            for name, t in self.backend.named_weights().items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]
        if bad:  # skipped steps keep NaN out of the weights; this is the last line of defence
            raise FloatingPointError(
                f"not writing checkpoint {iteration}: {len(bad)} weight tensors hold NaN/inf "
                f"(first: {bad[0]}); the last good checkpoint is kept"
            )
        return save_checkpoint(
            self.store_root,
            self.run,
            iteration,
            self.backend.checkpoint_bytes(),
            extra=extra,
            storage_options=self.storage_options,
        )

    def _dist_dir(self, iteration: int) -> str:
        import os

        base = open_fs(self.store_root, self.storage_options)[1]
        return os.path.join(self._local_path(checkpoint_dir(base, self.run, iteration)), "dist")

    def _state_dist_dir(self, state_uri: str) -> str:
        """A sharded replay state's shards: `dist/` beside the state file."""
        import os

        return os.path.join(os.path.dirname(self._local_path(state_uri)), "dist")

    def _local_path(self, uri: str) -> str:
        """`uri` as a local path every rank can write (distributed checkpoints), or one line naming the fix."""
        fs, path = open_fs(uri, self.storage_options)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            raise ValueError(
                f"store.root={self.store_root!r}: a sharded megatron trainer writes Megatron's distributed "
                "checkpoints with every rank on a filesystem path all ranks share (local disk on one "
                "host, NFS / Lustre across hosts); object stores are not supported for them yet"
            )
        return path

    def _save_distributed(self, iteration: int, extra: dict | None) -> str:
        """Megatron's distributed checkpoint in the checkpoint folder (every rank its shards), then rank 0 commits
        the folder as for any checkpoint: a small payload naming the format, the marker last."""
        path = self._dist_dir(iteration)
        self._write_shards(path, f"checkpoint {iteration}", "; the last good checkpoint is kept")
        if not self.is_primary:
            return str(path.rsplit("/", 1)[0])
        return save_checkpoint(
            self.store_root,
            self.run,
            iteration,
            distributed_payload(),
            extra=extra,
            storage_options=self.storage_options,
        )

    def _write_shards(self, path: str, what: str, kept: str = "") -> None:
        """Every rank's shards into `path` (Megatron's own commit marker last, rank 0 after a barrier), an earlier
        write there withdrawn first (a checkpoint redone by --resume-from, a refreshed replay state). The NaN guard
        of the single-file path, over every rank's shards: all ranks refuse together."""
        if not self.backend.all_ranks_finite():
            raise FloatingPointError(f"not writing {what}: a trainer rank's weights hold NaN/inf{kept}")
        if self.is_primary:
            shutil.rmtree(path, ignore_errors=True)
        torch.distributed.barrier()
        self.backend.save_distributed(path)

    def _load_distributed(self, iteration: int, payload: bytes) -> None:
        if not is_distributed_payload(payload):
            raise ValueError(
                f"checkpoint {iteration} of run {self.run!r} was written by a trainer that held the whole "
                "state (one file); this trainer is sharded and loads Megatron's distributed checkpoints: "
                "resume it with the layout that wrote it, or start a new run from the HF model"
            )
        self.backend.load_distributed(self._dist_dir(iteration))

    def score_probe(self, samples: list[Sample]) -> list[list[float]]:
        """The post-sync probe: the policy's teacher-forced log-probs of the engine's probe tokens
        (tasks/train/probe.py). A sharded backend's forward is a collective: every rank is called."""
        return probe_log_probs(self.backend, samples)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.named_weights()

    def lora_adapter(self) -> dict:
        """A LoRA policy's adapter in PEFT form ({"tensors", "config"}; rollout.sglang.lora_sync=adapter)."""
        if not isinstance(self.backend, LoraTorchBackend):
            raise RuntimeError("the trainer has no adapter: rollout.sglang.lora_sync=adapter needs model.lora")
        return self.backend.lora_adapter()

    def lora_adapter_checksums(self) -> dict[str, str]:
        """Fingerprints of the adapter tensors as `lora_adapter` hands them out (adapter-mode parity)."""
        return checksums(self.lora_adapter()["tensors"])

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The HF-named weights from rank 0, {} from the others. A sharded trainer gathers them over its model-
        parallel groups, so every rank must call this at once; other ranks of an unsharded one return at once."""
        if not (self.sharded or self.is_primary):
            return {}
        named = self.backend.named_weights()  # sharded: a collective
        return named if self.is_primary else {}

    # -- colocated placement (offload=true): the engine generates while the trainer's state is on the host ----
    def offload(self) -> bool:
        """Weights, grads and optimizer state of this rank to host memory; False when the backend keeps them
        (it has no offload). Nothing that reads the weights may run until `onload`."""
        if not isinstance(self.backend, Offloadable):
            return False
        self.backend.offload()
        return True

    def onload(self) -> bool:
        if not isinstance(self.backend, Offloadable):
            return False
        self.backend.onload()
        return True

    def weight_prefixes(self, n: int, as_dtype: str | None = None) -> dict[str, list[float]]:
        """First `n` values of every tensor (cast like the engine holds them), for prefix parity."""
        dtype = DTYPES[as_dtype] if as_dtype else None
        return {k: tensor_prefix(v.to(dtype) if dtype else v, n) for k, v in self.backend.named_weights().items()}

    def weight_checksums(self, as_dtype: str | None = None) -> dict[str, str]:
        """Checksums of the trainer's tensors, cast to the engine's dtype when it differs (bf16 engines)."""
        # Fingerprints computed where the weights live (tasks/sync/parity.py): no copy to the host.
        backend = self.backend
        if isinstance(backend, BucketExporter) and not isinstance(backend, ResidentTensors):
            # megatron: its HF-named tensors are made layer by layer on the device (a collective when sharded);
            # fingerprinting each as it is made replaces host copies of the whole model (docs/performance.md 7).
            dtype = DTYPES[as_dtype] if as_dtype else None
            return checksums_of_buckets(backend.export_buckets(PARITY_BUCKET_BYTES, dtype))
        named = weights_in_place(backend)
        if as_dtype is not None:
            named = {k: v.to(DTYPES[as_dtype]) for k, v in named.items()}
        return checksums(named)

    # -- weight sync into SGLang engines, driven by flows/weight_sync/ (rank 0 only) ---------------------
    def _sender(self) -> WeightSender:
        if self._weight_sender is None:
            backend = self.backend
            if isinstance(backend, BucketExporter):  # megatron: streamed per layer, no whole-model copy

                def source(size: int, dtype: str | None):  # (a collective when sharded)
                    return backend.export_buckets(size, DTYPES[dtype] if dtype else None)
            else:
                source = dict_buckets(self._device_weights)
            self._weight_sender = WeightSender(source)
        return self._weight_sender

    def _device_weights(self) -> dict[str, torch.Tensor]:
        """HF-named tensors where they live (the trainer's GPU): IPC handles and broadcasts need no copy."""
        if isinstance(self.backend, TorchBackend):  # a LoRA policy's are merged (tasks/train/lora_backend.py)
            return {k: v.detach() for k, v in self.backend.weight_tensors().items()}
        return self.backend.named_weights()

    def ipc_begin(self, bucket_bytes: int, tp_size: int = 1, dtype: str | None = None, flattened: bool = False) -> None:
        """`tp_size` 0: a sharded trainer's rank that no engine reads from; it steps along (`ipc_next`) and sends
        nothing."""
        device = self.optim.device if str(self.optim.device).startswith("cuda") else None
        self._sender().ipc_begin(bucket_bytes, tp_size, dtype, device, flattened)

    def weight_buckets(
        self, bucket_bytes: int, dtype: str | None = None
    ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
        """The HF-named weights as (bucket, is_last) where the trainer makes them (its GPU), for an engine in this
        same process (a generator: not an actor call; between actors the tensor path is `ipc_begin`/`ipc_next`)."""
        return self._sender().buckets(bucket_bytes, dtype)

    def ipc_next(self) -> IpcBucket:
        self._progress.tick()
        return self._sender().ipc_next()

    def visible_gpu(self) -> str | None:
        """This rank's GPU as the cluster numbers them (Ray sets CUDA_VISIBLE_DEVICES), None without."""
        return visible_gpu()

    def ipc_end(self) -> None:
        self._sender().ipc_end()

    def weight_group_address(self) -> tuple[str, int]:
        return self._sender().group_address()

    def join_weight_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> None:
        self._sender().join_group(master_address, master_port, world_size, group_name, backend)

    def weight_buckets_begin(self, bucket_bytes: int, dtype: str | None = None) -> None:
        self._sender().buckets_begin(bucket_bytes, dtype)

    def next_weight_bucket(self) -> BroadcastBucket:
        """The next bucket's metadata; rank 0 keeps its tensors to broadcast, a sharded trainer's other ranks only
        take part in making it."""
        self._progress.tick()
        return self._sender().next_bucket(keep=self.is_primary)

    def broadcast_weight_bucket(self, device: str | None = None) -> int:
        self._progress.tick()
        return self._sender().broadcast_current(device)
