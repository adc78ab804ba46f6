"""The rollout side's stateful worker: engine + tokenizer + prompt source.

A plain class; `infra/` runs it as a Ray actor, GPU scripts and tests may call it directly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from artifacts.sample import Sample
from tasks.model.source import resolve_model_path
from tasks.model.tiny import load_model
from tasks.model.tokenizer import load_tokenizer
from tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams
from tasks.rollout.generate import generate_samples
from tasks.rollout.hf_engine import HFEngine
from tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
from tasks.sync.parity import checksums
from tasks.train.torch_backend import DTYPES


def build_engine(model_spec: str, rollout: RolloutConfig, *, weight_version: int = 0,
                 base_gpu_id: int | None = None):
    """`base_gpu_id`: the engine's first GPU (SGLang `--base-gpu-id`, set by the placement group when an
    engine spans several GPUs); the hf engine ignores it."""
    if rollout.engine == "sglang":
        from tasks.rollout.sglang_engine import engine_from_config

        path = resolve_model_path(model_spec)
        engine = engine_from_config(path, rollout, model_name=model_spec, weight_version=weight_version,
                                    base_gpu_id=base_gpu_id)
        return engine, load_tokenizer(path)
    if rollout.engine != "hf":
        raise NotImplementedError(
            f"rollout.engine={rollout.engine!r} is not available in this build; use rollout.engine='hf'"
        )
    path = resolve_model_path(model_spec)
    model = load_model(path, dtype=DTYPES[rollout.dtype], device=rollout.device)
    tokenizer = load_tokenizer(path)
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      model_name=model_spec, weight_version=weight_version, max_batch_size=rollout.max_batch_size,
                      threads=rollout.threads, static_cache=rollout.static_cache)
    return engine, tokenizer


def extra_stop_ids(model_spec: str, tokenizer) -> tuple[int, ...]:
    """Stop ids of the model's generation_config.json besides the tokenizer's eos (Qwen's <|endoftext|>)."""
    if model_spec.startswith("builtin:"):
        return ()
    try:
        config = json.loads((Path(resolve_model_path(model_spec)) / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ()
    ids = config.get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    return tuple(int(i) for i in ids if int(i) != tokenizer.eos_token_id)


class RolloutWorker:
    def __init__(self, model_spec: str, rollout: RolloutConfig, data: DataConfig, *,
                 weights: dict[str, torch.Tensor] | None = None, weight_version: int = 0,
                 base_gpu_id: int | None = None):
        self.rollout_cfg = rollout
        self.data_cfg = data
        self.engine, self.tokenizer = build_engine(model_spec, rollout, base_gpu_id=base_gpu_id)
        self.stop_token_ids = extra_stop_ids(model_spec, self.tokenizer)
        if weights is not None:
            # Start from a checkpoint's weights: the engine is at that checkpoint's version.
            self.engine.weight_version = weight_version - 1
            self.engine.update_weights(weights, weight_version)

    def ping(self) -> bool:
        """False when the engine's server process died: `ensure_engine` then restarts this actor."""
        alive = getattr(self.engine, "alive", None)
        return True if alive is None else bool(alive())

    def weight_version(self) -> int:
        return self.engine.weight_version

    def describe(self) -> dict[str, str]:
        return self.engine.describe()

    def rollout(self, rollout_id: int, split: str = "train", *, greedy: bool = False) -> list[Sample]:
        """Train: n samples per prompt (greedy: one). Eval: data.eval's sampling when configured."""
        items = prompts_for(self.data_cfg, rollout_id, split)
        if split == "eval" and self.data_cfg.eval is not None:
            n = self.data_cfg.eval_n_samples
            params = self.rollout_cfg.eval_sampling(self.data_cfg, rollout_id)
        else:
            n = 1 if greedy else self.rollout_cfg.n_samples_per_prompt
            params = self.rollout_cfg.sampling(rollout_id, greedy=greedy)
        if self.stop_token_ids:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.stop_token_ids)
        return generate_samples(self.engine, self.tokenizer, items, params, n)

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        return self.engine.generate(requests, params)

    def update_weights(self, named: dict[str, torch.Tensor], weight_version: int) -> int:
        self.engine.update_weights(named, weight_version)
        return self.engine.weight_version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.named_weights()

    # -- colocation (placement=colocate, offload=true): SGLang's order is
    # release -> train -> resume(["weights"]) -> update weights -> resume(["kv_cache"])
    def release_memory(self) -> None:
        """Free the engine's weights and KV cache for the colocated trainer (SGLang: offload())."""
        if hasattr(self.engine, "offload"):
            self.engine.offload()
        else:
            self.engine.release_memory()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None = both)."""
        self.engine.resume_memory(list(tags) if tags is not None else None)

    def weight_prefixes(self, names: list[str], n: int) -> dict[str, list[float]]:
        """First `n` values of the named tensors as the engine holds them (SGLang: /get_weights_by_name)."""
        from tasks.sync.parity import tensor_prefix

        if hasattr(self.engine, "get_weights_by_name"):
            out = {}
            for name in names:
                values = self.engine.get_weights_by_name(name, truncate_size=n)
                if values is not None:
                    out[name] = [float(v) for v in _flatten(values)][:n]
            return out
        own = self.engine.named_weights()
        return {name: tensor_prefix(own[name], n) for name in names if name in own}

    def weight_checksums(self) -> dict[str, str]:
        return checksums(self.engine.named_weights())


def _flatten(values) -> list:
    """SGLang returns nested lists for 2-D parameters; parity compares the flat head."""
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flatten(v)]
    return [values]
