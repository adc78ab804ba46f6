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
from tasks.train.checkpoint import load_checkpoint, save_checkpoint
from tasks.train.settings import AlgoConfig, OptimConfig
from tasks.train.step import TrainResult, train_on_samples
from tasks.train.torch_backend import TorchBackend


def build_backend(model_spec: str, optim: OptimConfig, *, temperature: float):
    if optim.backend != "torch":
        raise NotImplementedError(
            f"train.backend={optim.backend!r} is not available in this build; use train.backend='torch'"
        )
    model = load_model(resolve_model_path(model_spec))
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
        self.last_result: TrainResult | None = None
        if resume_iteration is not None:
            self.backend.load_checkpoint_bytes(
                load_checkpoint(store_root, run, resume_iteration, storage_options=storage_options))

    def ping(self) -> bool:
        return True

    def train_on_artifact(self, ref: dict) -> dict[str, float]:
        artifact = self.store.load_uri(ArtifactRef.from_dict(ref).uri)
        result = train_on_samples(self.backend, artifact.samples, self.algo,
                                  group_size=artifact.manifest.n_samples_per_prompt,
                                  compute_ref=self.optim.compute_ref_log_probs)
        self.last_result = result
        return result.metrics

    def save_checkpoint(self, iteration: int) -> str:
        return save_checkpoint(self.store_root, self.run, iteration, self.backend.checkpoint_bytes(),
                               storage_options=self.storage_options)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.named_weights()

    def weight_checksums(self) -> dict[str, str]:
        return checksums(self.backend.named_weights())
