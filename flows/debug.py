"""Debug flows: the worker group with parts missing (DESIGN.md sections 3 and 6).

- `rollout_only`: engines only; no trainer is ever created; weights are the model's or a checkpoint's.
- `replay_train`: trainer only; inputs are artifacts pinned by rollout id (or slime `.pt` dumps);
  no engine is created and nothing is generated. Each step is cached on (artifact checksum,
  starting state, train config), so re-running an identical replay is a Prefect cache hit.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.flows import reporting
from rollflow.flows.config import RunConfig
from rollflow.flows.exports import copy_to_dump, dump_uri, side_exports
from rollflow.flows.group import call_all_ranks, connect_ray, start_engine, start_placement, start_trainer, stop_all
from rollflow.flows.iteration import committed_or_generate, eval_metrics
from rollflow.tasks.train.checkpoint import state_exists
from rollflow.tasks.train.replay import infer_group_size


def parse_ids(spec: str | None) -> list[int] | None:
    """'3', '0,2,5', '0-4' (inclusive) or a mix; None -> None."""
    if spec is None or not str(spec).strip():
        return None
    ids: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                ids.extend(range(int(lo), int(hi) + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise ValueError(f"--ids {spec!r}: {part!r} is not an id or a range like 0-4") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"--ids {spec!r}: rollout ids are >= 0")
    return sorted(set(ids))


@flow(name="rollout_only")
def rollout_only(cfg: RunConfig, rollout_ids: list[int] | None = None, checkpoint: int | None = None) -> dict:
    """Generate, score and persist rollouts with engines only (`--debug-rollout-only`)."""
    log = get_run_logger()
    for notice in cfg.notices:
        log.warning(notice)
    connect_ray(cfg)
    RolloutStore(cfg.store.root).check_access()  # endpoint / credentials / bucket: fail before any actor
    ids = rollout_ids if rollout_ids is not None else list(range(cfg.iterations))
    start_placement(cfg)  # GPUs only (resources.num_gpus > 0); released by stop_all
    try:
        engine = start_engine(cfg, checkpoint)
        out: dict = {"run": cfg.run, "rollouts": {}, "weight_version": engine.call("weight_version")}
        for rollout_id in ids:
            reporting.stage("start", rollout_id)
            ref = committed_or_generate(cfg, rollout_id, weight_version=checkpoint or 0)
            side_exports(cfg, ref)
            row: dict = {"uri": ArtifactRef.from_dict(ref).uri}
            samples = RolloutStore(cfg.store.root).load_uri(row["uri"]).samples
            row["raw_reward"] = sum(s.scalar_reward() for s in samples) / len(samples)
            if cfg.eval_every and rollout_id % cfg.eval_every == 0:
                row.update(eval_metrics(cfg, rollout_id, weight_version=checkpoint or 0))
            out["rollouts"][rollout_id] = row
            reporting.stage("done", rollout_id, f"rollout {rollout_id}: reward {row['raw_reward']:.4f}  {row['uri']}")
    finally:
        stop_all(cfg)
    return out


@task(name="import-slime", cache_policy=NO_CACHE)
def import_slime_task(cfg: RunConfig, rollout_id: int) -> dict:
    """A slime `.pt` dump becomes a committed artifact of this run (so replay reads one format)."""
    from rollflow.artifacts.slime import expand_template, import_slime_pt

    store = RolloutStore(cfg.store.root)
    if store.exists(cfg.run, "train", rollout_id):
        return ArtifactRef(cfg.store.root, cfg.run, "train", rollout_id).to_dict()
    path = expand_template(cfg.debug.load_debug_rollout_data, rollout_id, "train")
    _, samples = import_slime_pt(path)
    versions = {s.weight_version for s in samples}
    ref = store.write(cfg.run, "train", rollout_id, samples, n_samples_per_prompt=infer_group_size(samples),
                      engine=EngineInfo(backend="slime-dump", model=path, weight_version=max(versions)),
                      config_hash=cfg.config_hash(), extra={"imported_from": path})
    return ref.to_dict()


def replay_cache_key(context, parameters: dict) -> str:
    return parameters["cache_key"]


@task(name="replay-train", cache_key_fn=replay_cache_key, persist_result=True)
def replay_train_task(cfg: RunConfig, ref: dict, *, cache_key: str, start_state_uri: str | None,
                      out_state_uri: str) -> dict[str, float]:
    """Train on one pinned artifact from a fixed starting state; cached on `cache_key`."""
    return call_all_ranks(
        cfg, "replay_step", ref, start_state_uri=start_state_uri, out_state_uri=out_state_uri,
        subsample=cfg.debug.load_debug_rollout_data_subsample, dump_uri=dump_uri(cfg, ref["rollout_id"]),
    )


def artifact_digest(store: RolloutStore, ref: ArtifactRef) -> str:
    """Identity of an artifact's content: its payload checksums (not where it is stored)."""
    manifest = store.manifest(ref.run, ref.split, ref.rollout_id)
    files = sorted((f.name, f.sha256) for f in manifest.files)
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:24]


def pinned_refs(cfg: RunConfig, rollout_ids: list[int] | None, source_run: str) -> list[dict]:
    if cfg.debug.load_debug_rollout_data:
        from rollflow.artifacts.slime import discover_template_ids

        if rollout_ids is None:
            rollout_ids = discover_template_ids(cfg.debug.load_debug_rollout_data).get("train", [])
            if not rollout_ids:
                raise FileNotFoundError(f"no slime dumps match {cfg.debug.load_debug_rollout_data!r}")
        return [import_slime_task(cfg, rid) for rid in rollout_ids]
    store = RolloutStore(cfg.store.root)
    if rollout_ids is None:
        rollout_ids = store.list_ids(source_run, "train")
        if not rollout_ids:
            raise FileNotFoundError(f"run {source_run!r} has no committed rollouts under {cfg.store.root}")
    refs = []
    for rid in rollout_ids:
        store.manifest(source_run, "train", rid)  # ArtifactNotFound lists the ids that exist
        refs.append(ArtifactRef(cfg.store.root, source_run, "train", rid).to_dict())
    return refs


@flow(name="replay_train")
def replay_train(cfg: RunConfig, rollout_ids: list[int] | None = None, source_run: str | None = None,
                 use_cache: bool = True) -> dict:
    """Train on pinned rollouts without any engine (`--debug-train-only` / `--load-debug-rollout-data`)."""
    log = get_run_logger()
    for notice in cfg.notices:
        log.warning(notice)
    connect_ray(cfg)
    RolloutStore(cfg.store.root).check_access()  # endpoint / credentials / bucket: fail before any actor
    source_run = source_run or cfg.run
    refs = pinned_refs(cfg, rollout_ids, source_run)
    store = RolloutStore(cfg.store.root)
    rows: list[dict] = []
    start_state, start_key = None, "initial"
    start_placement(cfg)  # GPUs only (resources.num_gpus > 0); released by stop_all
    try:
        start_trainer(cfg, None)
        for ref in refs:
            art = ArtifactRef.from_dict(ref)
            reporting.stage("start", art.rollout_id)
            copy_to_dump(cfg, ref)
            key_parts = [artifact_digest(store, art), start_key, cfg.train_hash(),
                         str(cfg.debug.load_debug_rollout_data_subsample)]
            key = "replay-" + hashlib.sha256("|".join(key_parts).encode()).hexdigest()[:32]
            out_state = f"{store.run_uri(cfg.run)}/replay_states/{key}/trainer.pt"
            reporting.stage("train")
            options = {} if use_cache and state_exists(out_state) else {"refresh_cache": True}
            state = replay_train_task.with_options(**options)(
                cfg, ref, cache_key=key, start_state_uri=start_state, out_state_uri=out_state, return_state=True)
            metrics = state.result()
            row = {"rollout_id": art.rollout_id, "source": art.uri, "cached": state.name == "Cached", **metrics}
            rows.append(row)
            reporting.stage("done", art.rollout_id,
                            f"replay {art.rollout_id}: {'cached' if row['cached'] else 'trained'}  "
                            f"ppo_kl={metrics.get('train/ppo_kl', 0):.4g}  loss={metrics.get('train/loss', 0):.4g}")
            start_state, start_key = out_state, key
    finally:
        stop_all(cfg)
    _publish_replay(cfg, rows)
    return {"run": cfg.run, "source_run": source_run, "steps": rows, "final_state": start_state}


def _publish_replay(cfg: RunConfig, rows: list[dict]) -> None:
    from prefect.artifacts import create_table_artifact

    fs, path = reporting.run_file(cfg, "replay_metrics.jsonl")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    keys = ["rollout_id", "cached", "rollout/raw_reward", "rollout/kl", "train/loss", "train/ppo_kl",
            "train/pg_clipfrac", "train/grad_norm"]
    create_table_artifact(key=reporting.artifact_key(cfg.run, "replay"),
                          table=[{k: r.get(k) for k in keys} for r in rows],
                          description=f"Replay training of run `{cfg.run}` on pinned rollouts")
