"""Debug flows: the worker group with parts missing (docs/architecture.md sections 6.6 and 9).

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

from rollflow.artifacts.sample import Status
from rollflow.artifacts.slime import check_token_ids, discover_template_ids, expand_template, import_slime_into_store
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.flows import reporting, tracking
from rollflow.flows.config import RunConfig
from rollflow.flows.exports import copy_to_dump, dump_uri, side_exports
from rollflow.flows.group import WorkerGroup, connect_ray, has_critic
from rollflow.flows.iteration import committed_or_generate, eval_metrics
from rollflow.flows.params import ReplayParams, RolloutParams
from rollflow.flows.prefect_ops.cancellation import actors_running, stop_actors_hook
from rollflow.flows.prefect_ops.naming import flow_run_name, tag_current_run
from rollflow.flows.prefect_ops.run_lock import one_run_at_a_time
from rollflow.flows.preflight import model_vocab_size, parse_ids  # noqa: F401 - parse_ids re-exported
from rollflow.tasks.rollout.evaluation import eval_summary
from rollflow.tasks.train.checkpoint import state_exists
from rollflow.tasks.train.critic_worker import CRITIC_PAYLOAD


@flow(
    name="rollout_only",
    flow_run_name=flow_run_name("/rollout"),
    on_failure=[stop_actors_hook],
    on_crashed=[stop_actors_hook],
)
@one_run_at_a_time()
def rollout_only(
    params: RolloutParams,
    rollout_ids: list[int] | None = None,  # type: ignore[valid-type]
    checkpoint: int | None = None,
    save_debug_rollout_data: str | None = None,
) -> dict:
    """Rollout only (slime --debug-rollout-only): engines generate and persist artifacts, no trainer.

    `params`: the RunConfig sections it reads, or a whole RunConfig (flows/params.py);
    `save_debug_rollout_data`: also export slime `.pt` files (a template with {rollout_id})."""
    cfg = params.run_config(mode="rollout_only", save_debug_rollout_data=save_debug_rollout_data)
    store = RolloutStore(cfg.store.root)  # one per flow run
    tag_current_run(cfg.run, "rollout")
    log = get_run_logger()
    for notice in cfg.notices:
        log.warning(notice)
    connect_ray(cfg)
    store.check_access()  # endpoint / credentials / bucket: fail before any actor
    ids = rollout_ids if rollout_ids is not None else list(range(cfg.iterations))
    tracker = tracking.start(cfg, "rollout_only", suffix="-rollout")  # a new tracking run per call; step = rollout id
    group = WorkerGroup.for_run(cfg)  # engines only: no trainer
    group.start_placement()  # GPUs only (resources.num_gpus > 0); released by stop_all
    # UI cancel of a run no runner watches (a CLI `rollflow rollout`): stop the engines, end Cancelled.
    # The tracker closes first, as failed on any error (a cancel included).
    with actors_running(group.stop_all) as watcher, tracker:
        engine = group.start_engine(checkpoint)
        out: dict = {"run": cfg.run, "rollouts": {}, "weight_version": engine.weight_version()}
        for rollout_id in ids:
            reporting.stage("start", rollout_id)
            ref = committed_or_generate(cfg, store, rollout_id, weight_version=checkpoint or 0)
            side_exports(cfg, store, ref)
            row: dict = {"uri": ref.uri}
            samples = store.load_uri(row["uri"]).samples
            row["raw_reward"] = sum(s.scalar_reward(cfg.rollout.reward_key) for s in samples) / len(samples)
            # the rollout/* keys rl_train logs for the same rollout (tasks/train/step.py), so runs compare
            rollout = {
                "rollout/raw_reward": row["raw_reward"],
                "rollout/response_len": sum(s.response_length for s in samples) / len(samples),
                "rollout/truncated_ratio": sum(Status.parse(s.status) is Status.TRUNCATED for s in samples)
                / len(samples),
                "rollout/n_samples": float(len(samples)),
            }
            if cfg.eval_every and rollout_id % cfg.eval_every == 0:
                row.update(eval_metrics(cfg, store, rollout_id, weight_version=checkpoint or 0))
            out["rollouts"][rollout_id] = row
            tracker.log(
                tracking.numeric_metrics({**rollout, **{k: v for k, v in row.items() if k.startswith("eval/")}}),
                rollout_id,
            )
            reporting.stage("done", rollout_id, f"rollout {rollout_id}: reward {row['raw_reward']:.4f}  {row['uri']}")
    if watcher.cancelled:
        return watcher.cancelled_state()
    return out


@task(name="import-slime", cache_policy=NO_CACHE)
def import_slime_task(
    cfg: RunConfig,
    store: RolloutStore,
    rollout_id: int,
    split: str = "train",
    import_run: str | None = None,
    vocab_size: int | None = None,
) -> ArtifactRef:
    """A slime `.pt` dump becomes a committed artifact of this run (so replay reads one format).

    Content-addressed: the same dump again is a no-op; a changed dump under an id the run already
    imported is refused with both checksums (never trained on silently stale data)."""
    path = expand_template(cfg.debug.load_debug_rollout_data, rollout_id, split)
    run = import_run or cfg.run
    ref, _ = import_slime_into_store(
        store,
        run,
        split,
        rollout_id,
        path,
        backend="slime-dump",
        model=path,
        config_hash=cfg.config_hash(),
        vocab_size=vocab_size,
        new_run_hint="replay it into a new run with `rollflow replay --import-run NEW_NAME` (or --set run=NEW_NAME)",
    )
    return ref


def replay_cache_key(context, parameters: dict) -> str:
    return parameters["cache_key"]


def start_replay_workers(cfg: RunConfig) -> None:
    """Ray, the run's placement (GPUs only) and its trainer ranks; no engine."""
    connect_ray(cfg)
    group = WorkerGroup.for_run(cfg)
    group.start_placement()  # GPUs only (resources.num_gpus > 0); released by stop_all
    group.start_trainer(None)
    group.start_critic(None)  # ppo only: its state follows the trainer's from step to step


@task(name="start-workers", cache_policy=NO_CACHE)
def start_replay_workers_task(cfg: RunConfig) -> None:
    start_replay_workers(cfg)


def replay_trainer(cfg: RunConfig):
    """The run's trainer; started here if the cache pre-check expected a hit that then missed (a result
    deleted in between), so a replay never fails for want of a worker."""
    connect_ray(cfg)
    group = WorkerGroup.for_run(cfg)
    if not group.any_running():
        start_replay_workers(cfg)
    return group.trainer()


def replay_keys(cfg: RunConfig, store: RolloutStore, refs: list[ArtifactRef]) -> list[str]:
    """One cache key per step: content, starting state (the previous step's key), train config; never the run
    name, so an identical replay under another run name hits."""
    keys, start_key = [], "initial"
    for ref in refs:
        parts = [
            artifact_digest(store, ref),
            start_key,
            cfg.train_hash(),
            str(cfg.debug.load_debug_rollout_data_subsample),
            str(cfg.rollout.reward_key_for("train")),
        ]
        start_key = "replay-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
        keys.append(start_key)
    return keys


def cached_step(store: RolloutStore, key: str, result_storage, *, critic: bool = False) -> bool:
    """Whether step `key` is a cache hit: its Prefect result and its resulting trainer (and ppo critic) state
    exist."""
    if not states_exist(store, key, critic=critic):
        return False
    from prefect.results import get_result_store

    task_obj = replay_train_task.with_options(result_storage=result_storage) if result_storage else replay_train_task
    try:
        return get_result_store().update_for_task(task_obj, _sync=True).exists(key)
    except Exception:  # noqa: BLE001 - unknown means "train": correct, only slower
        return False


STEPS_KEY = "train_steps"  # in a replay step's cached result; results cached before it have none


@task(name="replay-train", cache_key_fn=replay_cache_key, persist_result=True)
def replay_train_task(
    cfg: RunConfig, ref: ArtifactRef, *, cache_key: str, start_state_uri: str | None, out_state_uri: str
) -> dict:
    """Train on one pinned artifact from a fixed starting state; cached on `cache_key`. The train metrics, plus
    each optimizer step's statistics under STEPS_KEY (cached with them, so a cache hit still charts its steps)."""
    trainer = replay_trainer(cfg)
    critic = None
    if has_critic(cfg):
        # The critic restarts where the trainer does (the previous step's states), so the step's GAE is the run's.
        critic = WorkerGroup.for_run(cfg).critic()
        critic.restore(critic_state_of(start_state_uri) if start_state_uri else None)
    reward_key = cfg.rollout.reward_key_for(ref.split)
    metrics = trainer.replay_step(
        ref,
        start_state_uri=start_state_uri,
        out_state_uri=out_state_uri,
        subsample=cfg.debug.load_debug_rollout_data_subsample,
        dump_uri=dump_uri(cfg, ref.rollout_id),
        reward_key=reward_key,
        critic=critic.estimate(ref, reward_key) if critic else None,
    )
    if critic is not None:
        metrics |= critic.update().result()
        critic.save_state(critic_state_of(out_state_uri))
    return metrics | {STEPS_KEY: trainer.train_steps()}


def replay_cache_uri(store: RolloutStore, key: str) -> str:
    """Where a replay step's resulting trainer state lives: by cache key, not by run name, so an identical
    replay under another run name reuses it."""
    return store.path_uri(f"_replay_cache/{key}/trainer.pt")


def critic_state_of(trainer_state_uri: str) -> str:
    """ppo: the critic's state of a replay step, beside its trainer state."""
    return trainer_state_uri.rsplit("/", 1)[0] + "/" + CRITIC_PAYLOAD


def states_exist(store: RolloutStore, key: str, *, critic: bool) -> bool:
    uri = replay_cache_uri(store, key)
    return state_exists(uri) and (not critic or state_exists(critic_state_of(uri)))


def replay_result_storage(cfg: RunConfig):
    """Prefect result storage of the replay step's cached metrics: `store.results` (a local path or a saved
    Prefect filesystem block such as 'remote-file-system/rollflow-results' for S3), else Prefect's default."""
    value = cfg.store.results
    if not value:
        return None
    if "/" in value and not value.startswith(("/", ".", "~")) and "://" not in value:
        from prefect.blocks.core import Block
        from prefect.filesystems import WritableFileSystem

        # "type-slug/name": Block.load finds the block type from the slug (WritableFileSystem.load would look
        # for a block type named "writablefilesystem" and miss every saved filesystem block)
        block = Block.load(value)
        if not isinstance(block, WritableFileSystem):
            raise ValueError(f"store.results={value!r} is a {type(block).__name__} block, not a writable filesystem")
        return block
    from pathlib import Path

    return Path(value).expanduser()


def artifact_digest(store: RolloutStore, ref: ArtifactRef) -> str:
    """Identity of an artifact's content: its payload digests (not where it is stored); an old artifact's
    (sha256) identity is what it was before manifests recorded xxh3-128."""
    manifest = store.manifest(ref.run, ref.split, ref.rollout_id)
    files = sorted((f.name, f.content_digest) for f in manifest.files)
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:24]


def pinned_refs(
    cfg: RunConfig,
    store: RolloutStore,
    rollout_ids: list[int] | None,
    source_run: str,
    *,
    import_run: str | None = None,
    vocab_size: int | None = None,
) -> tuple[list[ArtifactRef], dict[int, ArtifactRef]]:
    """(train refs to replay in order, {rollout id: eval ref}) - slime's `eval_{id}` dumps come along."""
    if cfg.debug.load_debug_rollout_data:
        found = discover_template_ids(cfg.debug.load_debug_rollout_data)
        if rollout_ids is None:
            rollout_ids = found.get("train", [])
            if not rollout_ids:
                raise FileNotFoundError(f"no slime dumps match {cfg.debug.load_debug_rollout_data!r}")
        train = [import_slime_task(cfg, store, rid, "train", import_run, vocab_size) for rid in rollout_ids]
        evals = {
            rid: import_slime_task(cfg, store, rid, "eval", import_run, vocab_size)
            for rid in found.get("eval", [])
            if rid in rollout_ids
        }
        return train, evals
    if rollout_ids is None:
        rollout_ids = store.list_ids(source_run, "train")
        if not rollout_ids:
            raise FileNotFoundError(f"run {source_run!r} has no committed rollouts under {cfg.store.root}")
    refs = []
    for rid in rollout_ids:
        store.manifest(source_run, "train", rid)  # ArtifactNotFound lists the ids that exist
        refs.append(ArtifactRef(cfg.store.root, source_run, "train", rid))
    evals = {
        rid: ArtifactRef(cfg.store.root, source_run, "eval", rid)
        for rid in store.list_ids(source_run, "eval")
        if rid in rollout_ids
    }
    return refs, evals


def verify_pinned(cfg: RunConfig, store: RolloutStore, refs: list[ArtifactRef], vocab_size: int | None) -> None:
    """Every pinned artifact's payload checksum (and token ids against the model's vocab), before any training:
    a corrupt rollout 3 fails the replay before rollout 0 trains, not after."""
    for art in refs:
        # Columns: no Sample objects for a check over the token buffers. ArtifactCorrupt names the file.
        samples = store.load_uri(art.uri).columns
        check_token_ids(samples, vocab_size, rollout_id=art.rollout_id, split=art.split, uri=art.uri)


def replay_eval_metrics(cfg: RunConfig, store: RolloutStore, ref: ArtifactRef) -> dict[str, float]:
    """eval/* of a replayed rollout's eval artifact, with the run's eval reward key (as slime)."""
    samples = store.load_uri(ref.uri).samples
    ev = cfg.data.eval
    out = eval_summary(
        samples,
        ks=ev.pass_k if ev else (),
        threshold=ev.pass_threshold if ev else 1.0,
        reward_key=cfg.rollout.reward_key_for("eval"),
    )
    return out | {"eval/raw_reward": out["eval/accuracy"], "eval/n_samples": float(len(samples))}


@flow(
    name="replay_train",
    flow_run_name=flow_run_name("/replay"),
    on_failure=[stop_actors_hook],
    on_crashed=[stop_actors_hook],
)
@one_run_at_a_time()
def replay_train(
    params: ReplayParams,
    rollout_ids: list[int] | None = None,  # type: ignore[valid-type]
    source_run: str | None = None,
    load_debug_rollout_data: str | None = None,
    subsample: float | None = None,
    dump_details: str | None = None,
    use_cache: bool = True,
    import_run: str | None = None,
) -> dict:
    """Replay training (slime --debug-train-only): train on rollouts pinned by id, no engine; cached per artifact
    checksums + starting state + train config.

    `params`: the RunConfig sections it reads, or a whole RunConfig (flows/params.py). `load_debug_rollout_data`
    (slime `.pt` dumps, a template with {rollout_id}), `subsample` and `dump_details` set the debug fields of the
    same names. Eval artifacts of the pinned ids (slime's `eval_{id}` dumps) are imported too; with eval_every > 0
    their eval metrics are added to the rows of ids that are multiples of it."""
    cfg = params.run_config(
        mode="train_only",
        load_debug_rollout_data=load_debug_rollout_data,
        load_debug_rollout_data_subsample=subsample,
        dump_details=dump_details,
    )
    store = RolloutStore(cfg.store.root)  # one per flow run
    tag_current_run(cfg.run, "replay")
    log = get_run_logger()
    for notice in cfg.notices:
        log.warning(notice)
    store.check_access()  # endpoint / credentials / bucket: fail before any actor
    source_run = source_run or cfg.run
    vocab_size = model_vocab_size(cfg.model.path)
    refs, eval_refs = pinned_refs(cfg, store, rollout_ids, source_run, import_run=import_run, vocab_size=vocab_size)
    verify_pinned(cfg, store, [*refs, *eval_refs.values()], vocab_size)
    # Opened before any worker starts: a tracking setup that cannot work is one line now, not after the replay.
    tracker = tracking.start(cfg, "replay_train", suffix="-replay")  # step = rollout id
    with tracker:
        rows: list[dict] = []
        steps: list[dict] = []  # optimizer steps of the whole replay, numbered 1.. in order
        start_state = None
        result_storage = replay_result_storage(cfg)
        keys = replay_keys(cfg, store, refs)
        # The cache is consulted before any worker exists: an all-hit replay starts no Ray and no trainer.
        ppo = has_critic(cfg)
        all_cached = use_cache and all(cached_step(store, key, result_storage, critic=ppo) for key in keys)
        # UI cancel of a CLI `rollflow replay`: stop the trainer (if one was started), end Cancelled.
        with actors_running(lambda: WorkerGroup.for_run(cfg).stop_all() if _ray_started() else None) as watcher:
            if not all_cached:
                reporting.stage("start-workers")
                start_replay_workers_task(cfg)
            for art, key in zip(refs, keys):
                reporting.stage("start", art.rollout_id)
                copy_to_dump(cfg, store, art)
                out_state = replay_cache_uri(store, key)
                reporting.stage("train")
                hit = use_cache and states_exist(store, key, critic=ppo)
                options: dict = {} if hit else {"refresh_cache": True}
                if result_storage is not None:
                    options["result_storage"] = result_storage
                state = replay_train_task.with_options(**options)(
                    cfg, art, cache_key=key, start_state_uri=start_state, out_state_uri=out_state, return_state=True
                )
                metrics = dict(state.result())
                steps += reporting.step_rows(metrics.pop(STEPS_KEY, []), len(steps) + 1, rollout_id=art.rollout_id)
                row = {"rollout_id": art.rollout_id, "source": art.uri, "cached": state.name == "Cached", **metrics}
                if art.rollout_id in eval_refs and cfg.eval_every and art.rollout_id % cfg.eval_every == 0:
                    row.update(replay_eval_metrics(cfg, store, eval_refs[art.rollout_id]))
                    row["eval_source"] = eval_refs[art.rollout_id].uri
                rows.append(row)
                reporting.stage(
                    "done",
                    art.rollout_id,
                    f"replay {art.rollout_id}: {'cached' if row['cached'] else 'trained'}  "
                    f"ppo_kl={metrics.get('train/ppo_kl', 0):.4g}  loss={metrics.get('train/loss', 0):.4g}",
                )
                start_state = out_state
        if watcher.cancelled:
            return watcher.cancelled_state()
        _publish_replay(cfg, rows)
        tracker.log_rows(rows, step_key="rollout_id")
        tracking.log_steps(tracker, steps)
        return {
            "run": cfg.run,
            "source_run": import_run or source_run,
            "steps": rows,
            "final_state": start_state,
            "eval_ids": sorted(eval_refs),
            "workers_started": not all_cached,
            "optimizer_steps": steps,
        }


def _ray_started() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _publish_replay(cfg: RunConfig, rows: list[dict]) -> None:
    from prefect.artifacts import create_table_artifact

    fs, path = reporting.run_file(cfg, "replay_metrics.jsonl")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    keys = [
        "rollout_id",
        "cached",
        "rollout/raw_reward",
        "rollout/kl",
        "train/loss",
        "train/ppo_kl",
        "train/pg_clipfrac",
        "train/grad_norm",
    ]
    create_table_artifact(
        key=reporting.artifact_key(cfg.run, "replay"),
        table=[{k: r.get(k) for k in keys} for r in rows],
        description=f"Replay training of run `{cfg.run}` on pinned rollouts",
    )
