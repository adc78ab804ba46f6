"""The train side's stateful worker: backend (policy, reference, optimizer) + checkpoints.

A plain class; `infra/` runs it as a Ray actor, GPU scripts and tests may call it directly. It reads
its inputs from the artifact store by reference, so nothing big crosses the orchestrator.
"""

from __future__ import annotations

import torch

from artifacts.store import ArtifactRef, RolloutStore
from tasks.model.source import resolve_model_path
from tasks.model.tiny import load_model
from tasks.sync.parity import checksums
from tasks.train.checkpoint import load_checkpoint, load_state, save_checkpoint, save_state
from tasks.train.dump import train_dump_bytes
from tasks.train.replay import infer_group_size, subsample_groups
from tasks.train.settings import AlgoConfig, OptimConfig
from tasks.train.step import train_on_samples
from tasks.train.torch_backend import TorchBackend


def build_backend(model_spec: str, optim: OptimConfig, *, temperature: float):
    if optim.backend == "megatron":
        from tasks.train.megatron_backend import build_megatron_backend  # imports megatron-core lazily

        return build_megatron_backend(resolve_model_path(model_spec), optim, temperature=temperature)
    if optim.backend != "torch":
        raise NotImplementedError(f"train.backend={optim.backend!r} is not available; use 'torch' or 'megatron'")
    from tasks.train.torch_backend import DTYPES

    # Loaded in the trainer's dtype and device (a bf16 model is never materialised in fp32 first).
    model = load_model(resolve_model_path(model_spec), dtype=DTYPES[optim.dtype], device=optim.device)
    return TorchBackend(model, optim, temperature=temperature)


class TrainWorker:
    def __init__(self, model_spec: str, optim: OptimConfig, algo: AlgoConfig, *, store_root: str, run: str,
                 temperature: float = 1.0, resume_iteration: int | None = None,
                 storage_options: dict | None = None):
        self.optim = optim
        self.algo = algo
        self.run = run
        self.store_root = store_root
        self.storage_options = storage_options
        self.store = RolloutStore(store_root, storage_options)
        self.backend = build_backend(model_spec, optim, temperature=temperature)
        # The exact starting state (weights, empty optimizer, RNG), so a replay can start from it again.
        self._initial_state = self.backend.checkpoint_bytes()
        if resume_iteration is not None:
            self.backend.load_checkpoint_bytes(
                load_checkpoint(store_root, run, resume_iteration, storage_options=storage_options))

    def ping(self) -> bool:
        return True

    def load_artifact(self, ref: dict) -> int:
        """Load (and checksum) a rollout artifact ahead of `train_on_artifact`; returns its sample count.

        Kept separate so the orchestrator can retry a transient storage failure of the load without
        ever retrying a train step that may already have stepped the optimizer.
        """
        uri = ArtifactRef.from_dict(ref).uri
        artifact = self.store.load_uri(uri)
        self._loaded = (uri, artifact)
        return len(artifact.samples)

    def _artifact(self, ref: dict):
        uri = ArtifactRef.from_dict(ref).uri
        loaded, self._loaded = getattr(self, "_loaded", None), None
        if loaded is not None and loaded[0] == uri:
            return loaded[1]
        return self.store.load_uri(uri)

    def train_on_artifact(self, ref: dict, *, subsample: float | None = None,
                          dump_uri: str | None = None) -> dict[str, float]:
        artifact = self._artifact(ref)
        samples = artifact.samples
        group_size = artifact.manifest.n_samples_per_prompt
        if group_size <= 1 and len(samples) > 1:
            group_size = infer_group_size(samples)
        if subsample is not None:
            samples = subsample_groups(samples, subsample, group_size)
        # slime dumps without behaviour log-probs import with zeros: never correct with them.
        missing = any(s.metadata.get("rollout_log_probs_missing") for s in samples)
        if missing and self.algo.tis is not None:
            raise ValueError(
                f"algo.tis={self.algo.tis!r} needs the rollout engine's log-probs, but rollout "
                f"{artifact.manifest.rollout_id} was imported without them; set algo.tis=null for this replay"
            )
        result = train_on_samples(self.backend, samples, self.algo, group_size=group_size,
                                  compute_ref=self.optim.compute_ref_log_probs)
        if dump_uri is not None:
            self._write(dump_uri, train_dump_bytes(result.batch, artifact.manifest.rollout_id))
        metrics = result.metrics | {"train/n_samples": float(len(samples))}
        if missing:
            for key in ("train/train_rollout_logprob_abs_diff", "rollout/rollout_log_probs"):
                metrics.pop(key, None)
            metrics["rollout/rollout_log_probs_missing"] = 1.0
        return metrics

    def replay_step(self, ref: dict, *, start_state_uri: str | None, out_state_uri: str,
                    subsample: float | None = None, dump_uri: str | None = None) -> dict[str, float]:
        """Train on one pinned artifact from a given state, and save the resulting state."""
        start = load_state(start_state_uri, storage_options=self.storage_options) if start_state_uri \
            else self._initial_state
        self.backend.load_checkpoint_bytes(start)
        metrics = self.train_on_artifact(ref, subsample=subsample, dump_uri=dump_uri)
        save_state(out_state_uri, self.backend.checkpoint_bytes(), storage_options=self.storage_options)
        return metrics

    def _write(self, uri: str, data: bytes) -> None:
        import posixpath

        from artifacts.storage import open_fs

        fs, path = open_fs(uri, self.storage_options)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(data)

    def save_checkpoint(self, iteration: int, extra: dict | None = None) -> str:
        """`extra` (JSON) goes into the checkpoint's meta.json, e.g. the data source's cursor."""
        return save_checkpoint(self.store_root, self.run, iteration, self.backend.checkpoint_bytes(),
                               extra=extra, storage_options=self.storage_options)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.named_weights()

    def weight_prefixes(self, n: int, as_dtype: str | None = None) -> dict[str, list[float]]:
        """First `n` values of every tensor (cast like the engine holds them), for prefix parity."""
        from tasks.sync.parity import tensor_prefix
        from tasks.train.torch_backend import DTYPES

        dtype = DTYPES[as_dtype] if as_dtype else None
        return {k: tensor_prefix(v.to(dtype) if dtype else v, n) for k, v in self.backend.named_weights().items()}

    def weight_checksums(self, as_dtype: str | None = None) -> dict[str, str]:
        """Checksums of the trainer's tensors, cast to the engine's dtype when it differs (bf16 engines)."""
        named = self.backend.named_weights()
        if as_dtype is not None:
            from tasks.train.torch_backend import DTYPES

            named = {k: v.to(DTYPES[as_dtype]) for k, v in named.items()}
        return checksums(named)
