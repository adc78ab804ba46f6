"""The rollout side's stateful worker: engine + tokenizer + prompt source.

A plain class; `infra/` runs it as a Ray actor, GPU scripts and tests may call it directly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from rollflow.artifacts.sample import Sample
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.tasks.compile_cache import CompileCacheSaver, load_compile_cache
from rollflow.tasks.model.dtypes import DTYPES
from rollflow.tasks.model.source import resolve_model_path
from rollflow.tasks.model.teacher_forced import ScoringLayout
from rollflow.tasks.model.tiny import load_model
from rollflow.tasks.model.tokenizer import load_tokenizer
from rollflow.tasks.progress import Progress, progress_of
from rollflow.tasks.rollout.agent import resolve_rollout_fn, run_rollout_function
from rollflow.tasks.rollout.capabilities import (
    Abortable,
    BucketedWeightSync,
    Liveness,
    Offloadable,
    ReportsInflight,
    ReportsModelInfo,
    ServesWeightsByName,
    StickyAbort,
    TakesBuckets,
    WeightGroupMember,
    WeightUpdateSession,
)
from rollflow.tasks.rollout.dynamic_sampling import oversample_prompts
from rollflow.tasks.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, sample_seed
from rollflow.tasks.rollout.generate import generate_samples
from rollflow.tasks.rollout.hf_engine import HFEngine
from rollflow.tasks.rollout.partial import aborted_groups, continue_groups, renumber
from rollflow.tasks.rollout.probe import probe_samples
from rollflow.tasks.rollout.results import EngineChecks, EngineDescription, WeightOverwriteCheck
from rollflow.tasks.rollout.settings import DataConfig, RolloutConfig, prompts_for
from rollflow.tasks.rollout.sglang import weights_check
from rollflow.tasks.rollout.sglang.from_config import engine_from_config
from rollflow.tasks.rollout.sglang.payloads import SGLangRequestError
from rollflow.tasks.rollout.sglang.weights_check import WeightsCheckerMissing, compare_engines, engine_checksums
from rollflow.tasks.sync.capabilities import weights_in_place
from rollflow.tasks.sync.ipc import visible_gpu
from rollflow.tasks.sync.parity import checksums, tensor_prefix
from rollflow.tasks.sync.probe import ProbeSpec


def build_engine(
    model_spec: str,
    rollout: RolloutConfig,
    *,
    weight_version: int = 0,
    base_gpu_id: int | None = None,
    servers: list | None = None,
    scoring: ScoringLayout | None = None,
    record_routes: bool = False,
):
    """`servers`: SGLang servers already launched (one actor per engine, see flows/group.py), else
    this worker launches one itself. `base_gpu_id`: that one's first GPU (SGLang `--base-gpu-id`);
    the hf engine ignores both. `scoring`: the trainer's scoring layout, required by (and only used
    with) rollout.logprobs='teacher_forced' (RunConfig.scoring_layout() builds it)."""
    if rollout.logprobs == "teacher_forced" and scoring is None:
        raise ValueError(
            "rollout.logprobs='teacher_forced' needs the trainer's scoring layout: build the worker "
            "with scoring=cfg.scoring_layout(), or set rollout.logprobs='engine'"
        )
    if rollout.engine == "sglang":
        path = resolve_model_path(model_spec)
        engine = engine_from_config(
            path,
            rollout,
            model_name=model_spec,
            weight_version=weight_version,
            base_gpu_id=base_gpu_id,
            servers=servers,
        )
        return engine, load_tokenizer(path)
    if rollout.engine != "hf":
        raise NotImplementedError(
            f"rollout.engine={rollout.engine!r} is not available in this build; use rollout.engine='hf'"
        )
    path = resolve_model_path(model_spec)
    model = load_model(path, dtype=DTYPES[rollout.dtype], device=rollout.device)
    tokenizer = load_tokenizer(path)
    engine = HFEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        model_name=model_spec,
        weight_version=weight_version,
        max_batch_size=rollout.max_batch_size,
        threads=rollout.threads,
        static_cache=rollout.static_cache,
        weight_sync="tensor" if rollout.hf_weight_sync == "tensor" else "object_store",  # auto: RunConfig resolves it
        scoring=scoring if rollout.logprobs == "teacher_forced" else None,
        record_routes=record_routes,
    )
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
    def __init__(
        self,
        model_spec: str,
        rollout: RolloutConfig,
        data: DataConfig,
        *,
        weights: dict[str, torch.Tensor] | None = None,
        weight_version: int = 0,
        base_gpu_id: int | None = None,
        servers: list | None = None,
        scoring: ScoringLayout | None = None,
        record_routes: bool = False,
        compile_cache: str | None = None,
    ):
        """`compile_cache`: a folder URL holding torch.compile's caches (RunConfig.compile_cache_uri()), loaded
        before anything compiles and written after the first rollout that compiled (tasks/compile_cache.py)."""
        load_compile_cache(compile_cache, "engine")
        self._compile_cache = CompileCacheSaver(compile_cache, "engine")
        self.rollout_cfg = rollout
        self.data_cfg = data
        self.engine, self.tokenizer = build_engine(
            model_spec, rollout, base_gpu_id=base_gpu_id, servers=servers, scoring=scoring, record_routes=record_routes
        )
        self.stop_token_ids = extra_stop_ids(model_spec, self.tokenizer)
        self._progress = Progress()  # weight buckets taken (the engine counts its own decode steps or requests)
        if weights is not None:
            # Start from a checkpoint's weights: the engine is at that checkpoint's version.
            self.engine.weight_version = weight_version - 1
            self.engine.update_weights(weights, weight_version)

    def ping(self) -> bool:
        """False when the engine's server process died: `ensure_engine` then restarts this actor."""
        return bool(self.engine.alive()) if isinstance(self.engine, Liveness) else True

    def weight_version(self) -> int:
        return self.engine.weight_version

    def describe(self) -> EngineDescription:
        return EngineDescription.of(self.engine.describe())

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
        """Train: n samples per prompt (greedy: one). Eval: data.eval's sampling when configured.

        `attempt` >= 1: an over-sampling call of dynamic sampling (its own prompts and seed). `continue_from`:
        the previous rollout's artifact URI, whose aborted groups are continued first (partial rollouts)."""
        samples = self._rollout_call(
            rollout_id, split, greedy=greedy, attempt=attempt, continue_from=continue_from, max_staleness=max_staleness
        )
        self._compile_cache.after_work()
        return samples

    def _rollout_call(
        self,
        rollout_id: int,
        split: str,
        *,
        greedy: bool,
        attempt: int,
        continue_from: str | None,
        max_staleness: int,
    ) -> list[Sample]:
        if attempt == 0 and isinstance(self.engine, StickyAbort):
            self.engine.reset_abort()  # an abort meant for the previous rollout does not cut this one
        continued = self._continued(rollout_id, continue_from, max_staleness) if continue_from else []
        if attempt:
            params = self.rollout_cfg.sampling(rollout_id)
            params = dataclasses.replace(
                params,
                seed=sample_seed(params.seed, 1_000_000 + attempt),
                stop_token_ids=params.stop_token_ids + self.stop_token_ids,
            )
            items = oversample_prompts(self.data_cfg, rollout_id, attempt)
            return generate_samples(self.engine, self.tokenizer, items, params, self.rollout_cfg.n_samples_per_prompt)
        fresh = self._rollout(rollout_id, split, greedy=greedy)
        if not continued:
            return fresh

        n = self.rollout_cfg.n_samples_per_prompt
        groups = continued + [fresh[i : i + n] for i in range(0, len(fresh), n)]
        return [dataclasses.replace(s, index=i) for i, s in enumerate(renumber(groups))]

    def _continued(self, rollout_id: int, uri: str, max_staleness: int) -> list[list[Sample]]:
        """The aborted groups of the artifact at `uri`, continued under the engine's current weights."""
        ref = ArtifactRef.from_uri(uri)
        artifact = RolloutStore(ref.root).load_uri(uri)
        return self._continue_groups(rollout_id, aborted_groups(artifact.samples), ref.rollout_id, max_staleness)

    def _continue_groups(
        self, rollout_id: int, groups: list[list[Sample]], source_rollout_id: int, max_staleness: int
    ) -> list[list[Sample]]:
        params = self.rollout_cfg.sampling(rollout_id)
        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.stop_token_ids)
        return continue_groups(
            self.engine,
            self.tokenizer,
            groups,
            params,
            source_rollout_id=source_rollout_id,
            trainer_version=rollout_id,
            max_staleness=max_staleness,
        )

    def finish_aborted(self, rollout_id: int, samples: list[Sample]) -> list[Sample]:
        """Partial rollouts, when an abort left a rollout without one finished group: generate the aborted groups
        of `samples` to the end now, before any weight change (same weights, so the rollout is an ordinary one)."""
        if isinstance(self.engine, StickyAbort):
            self.engine.reset_abort()
        done = self._continue_groups(rollout_id, aborted_groups(samples), rollout_id, max_staleness=rollout_id + 1)
        return [s for group in done for s in group]  # group indices kept: the caller puts them back in place

    def _rollout(self, rollout_id: int, split: str, *, greedy: bool) -> list[Sample]:
        items = prompts_for(self.data_cfg, rollout_id, split)
        if split == "eval" and self.data_cfg.eval is not None:
            n = self.data_cfg.eval_n_samples
            params = self.rollout_cfg.eval_sampling(self.data_cfg, rollout_id)
        else:
            n = 1 if greedy else self.rollout_cfg.n_samples_per_prompt
            params = self.rollout_cfg.sampling(rollout_id, greedy=greedy)
        if self.stop_token_ids:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + self.stop_token_ids)
        if self.rollout_cfg.function != "single_turn":
            return run_rollout_function(
                resolve_rollout_fn(self.rollout_cfg.function),
                self.engine,
                self.tokenizer,
                items,
                params,
                n,
                self.rollout_cfg.agent.limits(),
            )
        return generate_samples(self.engine, self.tokenizer, items, params, n)

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        return self.engine.generate(requests, params)

    def probe(self, spec: ProbeSpec) -> list[Sample]:
        """The post-sync probe's sequences, generated the way rollouts are (tasks/rollout/probe.py)."""
        if isinstance(self.engine, StickyAbort):
            self.engine.reset_abort()  # a partial rollout's abort came before this sync; the probe must run whole
        return probe_samples(self.engine, self.tokenizer, self.data_cfg, self.rollout_cfg, spec, self.stop_token_ids)

    # -- control: infra runs these in the actor's "control" concurrency group, so they answer while a
    # rollout is running in the default group
    def abort(self, rids: list[str] | None = None) -> int:
        """Abort the running rollout's requests (all, or these rids); aborted samples come back with
        status aborted. Returns the number of abort calls sent (0 for engines that cannot abort)."""
        return int(self.engine.abort(rids) or 0) if isinstance(self.engine, Abortable) else 0

    def inflight(self) -> list[str]:
        """Request ids in flight now (SGLang engines; empty for in-process engines)."""
        return list(self.engine.inflight()) if isinstance(self.engine, ReportsInflight) else []

    def progress(self) -> int:
        """Work done so far (decode steps or requests, weight buckets); a stall deadline watches it move."""
        return self._progress.value + progress_of(self.engine)

    def update_weights(self, named: dict[str, torch.Tensor], weight_version: int) -> int:
        self.engine.update_weights(named, weight_version)
        self._progress.tick()
        return self.engine.weight_version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.named_weights()

    def update_lora_adapter(self, adapter: dict, weight_version: int) -> int:
        """A LoRA run's adapter (rollout.sglang.lora_sync=adapter: tasks/rollout/sglang/lora_receiver.py)."""
        self.engine.update_lora_adapter(adapter["tensors"], adapter["config"], weight_version)
        self._progress.tick()
        return self.engine.weight_version

    def lora_report(self) -> dict:
        return self.engine.lora_report()

    # -- colocation (placement=colocate, offload=true): SGLang's order is
    # release -> train -> resume(["weights"]) -> update weights -> resume(["kv_cache"])
    def release_memory(self) -> None:
        """Free the engine's weights and KV cache for the colocated trainer (SGLang: offload())."""
        if isinstance(self.engine, Offloadable):
            self.engine.offload()
        else:
            self.engine.release_memory()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` ("weights", "kv_cache"; None = both)."""
        self.engine.resume_memory(list(tags) if tags is not None else None)

    def weight_prefixes(self, names: list[str], n: int) -> dict[str, list[float]] | None:
        """First `n` values of the named tensors as the engine holds them (SGLang: /get_weights_by_name
        on every server; a server disagreeing with the first one reports the name as `name@url`, so
        parity fails on an engine that missed an update). None when the served model cannot answer
        (SGLang implements /get_weights_by_name per model class; e.g. not for Qwen2 in 0.5.23)."""
        if not isinstance(self.engine, ServesWeightsByName):
            own = self.engine.named_weights()
            return {name: tensor_prefix(own[name], n) for name in names if name in own}

        out: dict[str, list[float]] = {}
        for i, url in enumerate(self.engine.urls):
            for j, name in enumerate(names):
                try:
                    values = self.engine.get_weights_by_name(name, truncate_size=n, url=url)
                except SGLangRequestError:
                    if i == 0 and j == 0:
                        return None  # the model class has no get_weights_by_name at all
                    raise
                if values is None:
                    continue
                head = [float(v) for v in _flatten(values)][:n]
                if i == 0:
                    out[name] = head
                elif out.get(name) != head:
                    out[f"{name}@{url}"] = head
        return out

    def engine_checks(self, weight_version: int) -> EngineChecks:
        """After a sync, engine-side checks needing no trainer data: every server reports the expected
        weight_version, and (several servers) all hold identical tensors by SGLang's /weights_checker
        checksums. Empty for in-process engines."""
        if not isinstance(self.engine, ReportsModelInfo):
            return EngineChecks(mismatched=[], notes=[])

        mismatched, notes = [], []
        for url in self.engine.urls:
            served = str(self.engine.model_info(url).get("weight_version"))
            if served != str(weight_version):
                mismatched.append(f"weight_version@{url}: serves {served}, expected {weight_version}")
        if len(self.engine.urls) > 1:
            try:
                check = compare_engines(engine_checksums(self.engine))
                mismatched += [f"{name}@{url}" for url, names in check.by_url.items() for name in names]
            except WeightsCheckerMissing as exc:
                notes.append(f"servers not compared with each other: {exc}")
        return EngineChecks(mismatched=mismatched, notes=notes)

    # -- whole-tensor check (debug.check_weight_update_equal, slime's --check-weight-update-equal) --------
    def prepare_overwrite_check(self) -> None:
        """Snapshot every server's weights, then randomise them (the next sync must overwrite all)."""
        weights_check.prepare_overwrite_check(self.engine)

    def finish_overwrite_check(self) -> WeightOverwriteCheck:
        """Compare every server's weights with its snapshot, value for value."""
        return WeightOverwriteCheck(**weights_check.finish_overwrite_check(self.engine).to_dict())

    # -- weight sync driven by the trainer (flows/weight_sync/) -------------------------------------
    def weight_sync_mode(self) -> str:
        """How this engine takes weights: object_store (in-process engines), disk, tensor or distributed."""
        return self.engine.weight_sync if isinstance(self.engine, BucketedWeightSync) else "object_store"

    def payloads_per_bucket(self) -> int:
        """Serialized copies of each bucket the trainer makes: one per TP rank of every server."""
        return self.engine.payloads_per_bucket if isinstance(self.engine, BucketedWeightSync) else 1

    def apply_serialized_bucket(
        self, payloads: list[str], last: bool, weight_version: int, load_format: str | None = None
    ) -> int:
        self.engine.apply_serialized_bucket(payloads, last=last, weight_version=weight_version, load_format=load_format)
        self._progress.tick()
        return self.engine.weight_version

    def apply_bucket(self, named: list[tuple[str, torch.Tensor]], last: bool, weight_version: int) -> int:
        """One bucket of tensors straight into an in-process engine (the tensor path without serialization: the
        trainer in this same process, e.g. a benchmark driving both workers)."""
        if not isinstance(self.engine, TakesBuckets):
            raise TypeError(f"{type(self.engine).__name__} takes no tensor buckets in process")
        self.engine.apply_bucket(named, last=last, weight_version=weight_version)
        self._progress.tick()
        return self.engine.weight_version

    def visible_gpu(self) -> str | None:
        """The engine's GPU as the cluster numbers them (None without): the tensor path pairs it with a trainer
        rank on the same GPU."""
        return visible_gpu()

    def begin_weight_update(self) -> None:
        """SGLang's weight-update session around tensor / distributed updates (no-op for other engines)."""
        if isinstance(self.engine, WeightUpdateSession):
            self.engine.begin_weight_update()

    def end_weight_update(self) -> None:
        if isinstance(self.engine, WeightUpdateSession):
            self.engine.end_weight_update()

    def in_weight_group(self, group_name: str) -> bool:
        return isinstance(self.engine, WeightGroupMember) and self.engine.weight_group == group_name

    def weight_group_world_size(self) -> int:
        return self.engine.weight_group_world_size

    def join_weight_group(self, master_address: str, master_port: int, group_name: str, backend: str) -> None:
        self.engine.join_weight_group(master_address, master_port, group_name=group_name, backend=backend)

    def receive_weight_bucket(self, metas: list[dict], last: bool, weight_version: int, group_name: str) -> int:
        self.engine.receive_bucket(metas, last=last, weight_version=weight_version, group_name=group_name)
        self._progress.tick()
        return self.engine.weight_version

    def weight_checksums(self) -> dict[str, str]:
        # Fingerprints computed where the weights live (tasks/sync/parity.py): no copy to the host.
        return checksums(weights_in_place(self.engine))


def _flatten(values) -> list:
    """SGLang returns nested lists for 2-D parameters; parity compares the flat head."""
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flatten(v)]
    return [values]
