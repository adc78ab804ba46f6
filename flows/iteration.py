"""`rl_iteration`: generate -> reward -> persist -> train -> sync -> checkpoint, one flow run.

Tasks are thin: they call the run's actors and exchange artifact references, never tensors.
"""

from __future__ import annotations

import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

from rollflow.artifacts.manifest import EngineInfo
from rollflow.artifacts.pipeline_meta import filtered_reason, pipeline_stats
from rollflow.artifacts.sample import Sample, Status
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.flows import reporting
from rollflow.flows.config import RunConfig
from rollflow.flows.exports import dump_uri, side_exports
from rollflow.flows.group import WorkerGroup, has_critic
from rollflow.flows.mismatch_trend import SLOPE_METRIC, mismatch_trend_task, trend_with
from rollflow.flows.prefect_ops.heartbeats import with_heartbeats, without_prefect_heartbeats
from rollflow.flows.prefect_ops.naming import flow_run_name
from rollflow.flows.prefect_ops.retrying import (
    STORAGE_RETRIES,
    STORAGE_RETRY_DELAYS,
    retry_if_transient,
    retry_unless_permanent,
)
from rollflow.flows.stall_watch import retry_after_stall, watched
from rollflow.flows.weight_sync.dispatch import adapter_sync, push_weights
from rollflow.flows.weight_sync.probe import probe_due, probe_task
from rollflow.flows.weight_sync.shared import SyncResult, engine_dtype
from rollflow.tasks.rollout.dataset import data_state
from rollflow.tasks.rollout.dynamic_sampling import load_filter, select_groups, split_groups
from rollflow.tasks.rollout.evaluation import eval_summary
from rollflow.tasks.rollout.partial import defer_aborted, mark_waited, too_old_to_continue
from rollflow.tasks.rollout.rewards import reward_fn_from_config, score_samples
from rollflow.tasks.sync.parity import compare, compare_prefixes
from rollflow.tasks.train.records import train_record_uri

PARITY_PREFIX = 64  # values per tensor compared when an engine cannot export whole tensors


@task(name="generate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
@watched("generate")
def generate_task(
    cfg: RunConfig,
    rollout_id: int,
    split: str = "train",
    greedy: bool = False,
    weight_version: int | None = None,
    attempt: int = 0,
    continue_from: str | None = None,
) -> list[Sample]:
    """On a retry after the engine died, `ensure_engine` restarts it at the expected weights.
    `attempt` >= 1: dynamic sampling's over-sampling call; `continue_from`: partial rollouts' previous artifact."""
    version = rollout_id if weight_version is None else weight_version
    return (
        WorkerGroup.for_run(cfg)
        .ensure_engine(version)
        .rollout(
            rollout_id,
            split,
            greedy=greedy,
            attempt=attempt,
            continue_from=continue_from,
            max_staleness=cfg.pipeline.max_staleness,
        )
    )


@task(name="reward", cache_policy=NO_CACHE)
def reward_task(cfg: RunConfig, samples: list[Sample]) -> list[Sample]:
    return score_samples(samples, reward_fn_from_config(cfg.rollout), reward_key=cfg.rollout.reward_key)


@task(
    name="persist",
    cache_policy=NO_CACHE,
    retries=STORAGE_RETRIES,
    retry_delay_seconds=STORAGE_RETRY_DELAYS,
    retry_condition_fn=retry_unless_permanent,
)
@watched("persist")
def persist_task(
    cfg: RunConfig, store: RolloutStore, rollout_id: int, samples: list[Sample], split: str = "train"
) -> ArtifactRef:
    """Commit the rollout. Retried with backoff (endpoint down, timeouts), not on permanent errors
    (schema, ArtifactExists from another writer, credentials, missing bucket)."""
    if store.exists(cfg.run, split, rollout_id):
        # A retry after a commit whose acknowledgement was lost: the committed artifact stands.
        return ArtifactRef(cfg.store.root, cfg.run, split, rollout_id)
    engine = WorkerGroup.for_run(cfg).engine().describe()
    info = EngineInfo(backend=engine.backend, model=engine.model, weight_version=engine.weight_version)
    n = cfg.data.eval_n_samples if split == "eval" else cfg.rollout.n_samples_per_prompt
    ref = store.write(
        cfg.run, split, rollout_id, samples, n_samples_per_prompt=n, engine=info, config_hash=cfg.config_hash()
    )
    return ref


@task(
    name="load-rollout",
    cache_policy=NO_CACHE,
    retries=STORAGE_RETRIES,
    retry_delay_seconds=STORAGE_RETRY_DELAYS,
    retry_condition_fn=retry_if_transient,
)
@watched("load-rollout")
def load_task(cfg: RunConfig, ref: ArtifactRef) -> int:
    """The trainer loads (and checksums) the artifact; transient storage failures retry here."""
    return WorkerGroup.for_run(cfg).trainer().load_artifact(ref)


@task(name="train", cache_policy=NO_CACHE)
@watched("train")
def train_task(cfg: RunConfig, ref: ArtifactRef) -> tuple[dict[str, float], list[dict[str, float]]]:
    """No retries: a failure after the optimizer stepped must not step it twice (load_task retries).
    Returns the iteration's train metrics and each optimizer step's own statistics."""
    group = WorkerGroup.for_run(cfg)
    trainer = group.trainer()
    dump = dump_uri(cfg, ref.rollout_id)
    # a few numbers per sample, every iteration: what stage replay and the reproducibility gate compare with
    record = train_record_uri(cfg.store.root, cfg.run, ref.rollout_id)
    if not has_critic(cfg):
        # every data-parallel rank trains on its share of the same artifact (rank 0's metrics are global)
        return trainer.train_on_artifact(ref, dump_uri=dump, record_uri=record), trainer.train_steps()
    # ppo: the critic scores the old values and computes GAE; the estimate goes critic -> trainer ranks through
    # Ray's object store. The critic's update runs after the policy's, not beside it: on a CPU box two torch
    # thread pools at once oversubscribe the cores (critic and trainer both use train.threads).
    critic = group.critic()
    metrics = trainer.train_on_artifact(ref, dump_uri=dump, critic=critic.estimate(ref), record_uri=record)
    return metrics | critic.update().result(), trainer.train_steps()


@task(
    name="checkpoint",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_permanent,
)
@watched("checkpoint")
def checkpoint_task(cfg: RunConfig, iteration: int) -> str:
    # The data source's cursor goes into meta.json: a resume checks it continues at the same sample.
    group = WorkerGroup.for_run(cfg)
    if has_critic(cfg):
        # Before the policy's payload and marker: the marker commits the iteration, critic state included.
        group.critic().save_checkpoint(iteration)
    return group.trainer().save_checkpoint(iteration, extra={"data": data_state(cfg.data, iteration)})


def offloads(cfg: RunConfig) -> bool:
    """placement=colocate with offload=true: the engine frees its GPU memory while the trainer runs."""
    return cfg.placement == "colocate" and cfg.offload


@task(name="release-engine-memory", cache_policy=NO_CACHE)
def release_memory_task(cfg: RunConfig) -> None:
    """Colocation, before training: the engine frees its weights and KV cache."""
    WorkerGroup.for_run(cfg).engine().release_memory()


@task(name="resume-engine-memory", cache_policy=NO_CACHE)
def resume_memory_task(cfg: RunConfig, tags: list[str]) -> None:
    """Colocation, around the sync: weights back before the update, KV cache after it."""
    WorkerGroup.for_run(cfg).engine().resume_memory(tags)


@task(name="offload-trainer", cache_policy=NO_CACHE)
def trainer_offload_task(cfg: RunConfig) -> bool:
    """Colocation, after the sync and checkpoint: the trainer's state to host memory while the engine generates."""
    return WorkerGroup.for_run(cfg).trainer().offload()


@task(name="onload-trainer", cache_policy=NO_CACHE)
def trainer_onload_task(cfg: RunConfig) -> bool:
    """Colocation, after the engine released its memory: the trainer's state back on the GPU for training."""
    return WorkerGroup.for_run(cfg).trainer().onload()


# Retried only after a stall: the stuck actor is gone, and a killed engine comes back at the trainer's weights.
@task(name="sync", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=retry_after_stall)
@watched("sync")
def sync_task(cfg: RunConfig, weight_version: int) -> dict:
    """Trainer weights -> engine by the engine's path (flows/weight_sync/), then parity checked."""
    group = WorkerGroup.for_run(cfg)
    trainer, engine = group.trainer(), group.ensure_engine(weight_version)
    if engine.weight_version() == weight_version:
        # A retry after a stall: ensure_engine restarted the engine from the trainer's weights of this version, or
        # the stalled attempt's update had landed. Pushing again would repeat the sync; parity below still checks it.
        pushed = SyncResult(mode=engine.weight_sync_mode(), weight_version=weight_version)
    else:
        pushed = push_weights(cfg, trainer, engine, weight_version)
    # The engine may hold another dtype (e.g. bf16): compare what it should hold, bit for bit.
    cast = engine_dtype(cfg)
    notes: list[str] = []
    if adapter_sync(cfg):
        # The servers keep the base weights and apply the adapter: the adapter tensors as the servers read them
        # (decoded from the payload, or read back from the directory) against the trainer's, every server listing
        # exactly the current adapter, and every server's weight_version (docs/architecture.md, LoRA).
        served = engine.lora_report()
        report = compare(trainer.lora_adapter_checksums(), served["checksums"])
        for url, listed in sorted(served["listed"].items()):
            if sorted(listed) != [served["name"]]:
                report.mismatched.append(f"adapters@{url}: lists {sorted(listed)}, expected [{served['name']}]")
        checks = engine.engine_checks(pushed.weight_version)
        report.mismatched.extend(checks.mismatched)
        notes += checks.notes
    elif cfg.rollout.engine == "sglang":
        # SGLang exports no whole tensors: compare the head of every tensor on every server (a server
        # that disagrees with the first shows up as a mismatch), every server's weight_version, and the
        # servers' whole-tensor checksums with each other; debug.check_weight_update_equal adds the
        # whole-tensor trainer-vs-engine check at startup.
        trainer_heads = trainer.weight_prefixes(PARITY_PREFIX, cast)
        engine_heads = engine.weight_prefixes(sorted(trainer_heads), PARITY_PREFIX)
        if engine_heads is None:
            notes.append("the served model has no /get_weights_by_name: tensor heads not compared")
            report = compare_prefixes({}, {})
        else:
            report = compare_prefixes(trainer_heads, engine_heads)
        checks = engine.engine_checks(pushed.weight_version)
        report.mismatched.extend(checks.mismatched)
        notes += checks.notes
    else:
        report = compare(trainer.weight_checksums(cast), engine.weight_checksums())
    if not report.ok:
        raise RuntimeError(report.summary())
    if notes:
        from prefect import get_run_logger

        for note in notes:
            get_run_logger().warning(note)
    return report.to_dict() | {
        "weight_version": pushed.weight_version,
        "sync_mode": pushed.mode,
        "sync_buckets": pushed.buckets,
        "sync_sources": list(pushed.sources),
        "notes": notes,
    }


@task(name="check-weight-update", cache_policy=NO_CACHE)
def check_weight_update_task(cfg: RunConfig, weight_version: int) -> dict:
    """slime's --check-weight-update-equal: the engine snapshots its weights (loaded from the same
    checkpoint the trainer holds now), randomises them, takes the trainer's by the configured path, and
    every tensor must come back bit for bit. Fails the run before its first step otherwise."""
    group = WorkerGroup.for_run(cfg)
    trainer, engine = group.trainer(), group.engine()
    engine.prepare_overwrite_check()
    push_weights(cfg, trainer, engine, weight_version)  # a re-sync of the version the engine holds
    result = engine.finish_overwrite_check()
    if not result.ok:
        raise RuntimeError(
            f"weight update check FAILED (the engine now holds random values for those tensors): {result.summary}"
        )
    return result.to_dict()


def committed_or_generate(
    cfg: RunConfig,
    store: RolloutStore,
    rollout_id: int,
    split: str = "train",
    greedy: bool = False,
    weight_version: int | None = None,
) -> ArtifactRef:
    """The committed artifact of this id if there is one (resume never regenerates), else a new one."""
    return committed_rollout(cfg, store, rollout_id, split) or generate_rollout(
        cfg, store, rollout_id, split, greedy, weight_version
    )


def committed_rollout(cfg: RunConfig, store: RolloutStore, rollout_id: int, split: str = "train") -> ArtifactRef | None:
    """The committed artifact of this id, or None (one existence check: a HEAD and a listing on S3)."""
    return ArtifactRef(cfg.store.root, cfg.run, split, rollout_id) if store.exists(cfg.run, split, rollout_id) else None


def generate_rollout(
    cfg: RunConfig,
    store: RolloutStore,
    rollout_id: int,
    split: str = "train",
    greedy: bool = False,
    weight_version: int | None = None,
) -> ArtifactRef:
    """Generate, reward and commit rollout `rollout_id` (not committed yet)."""
    reporting.stage("generate")
    if split == "train" and (cfg.pipeline.dynamic_sampling.enabled or cfg.pipeline.partial_rollout):
        samples = filtered_train_samples(cfg, store, rollout_id, weight_version)
    else:
        # distinct task names in the UI: the train rollout and the (greedy) eval rollout
        samples = generate_task.with_options(name=f"generate-{split}")(cfg, rollout_id, split, greedy, weight_version)
        reporting.stage("reward")
        # quote(): Prefect would otherwise walk every Sample of the argument twice (~0.4 s at 2,048).
        samples = reward_task(cfg, quote(samples))
    reporting.stage("persist")
    return persist_task(cfg, store, rollout_id, quote(samples), split)


def filtered_train_samples(
    cfg: RunConfig, store: RolloutStore, rollout_id: int, weight_version: int | None
) -> list[Sample]:
    """A train rollout with dynamic sampling and/or partial rollouts (docs/async.md): generate (continuing the
    previous rollout's aborted groups), reward, defer groups cut by an abort, filter groups and over-sample
    until data.prompts_per_rollout groups pass or pipeline.dynamic_sampling.max_tries calls were made. Every
    group generated stays in the rollout; the untrained ones are marked `filtered` with the reason."""
    pipe, n = cfg.pipeline, cfg.rollout.n_samples_per_prompt
    ds = pipe.dynamic_sampling
    group_filter = load_filter(ds.filter_path) if ds.enabled else None
    continue_from = previous_train_artifact(cfg, store, rollout_id) if pipe.partial_rollout else None
    groups: list[list[Sample]] = []
    keep: list[bool] = []
    generate = generate_task.with_options(name="generate-train")
    for attempt in range(ds.max_tries if ds.enabled else 1):
        samples = generate(
            cfg, rollout_id, "train", False, weight_version, attempt, continue_from if attempt == 0 else None
        )
        samples = reward_task(cfg, quote(samples))
        if pipe.partial_rollout:
            if attempt == 0:
                log_dropped(cfg, samples)
            samples = defer_aborted(samples, n)
            late = too_old_to_continue(samples, rollout_id + 1, pipe.max_staleness)
            if late and pipe.stale_policy == "wait":
                # Continued next rollout, these groups would exceed the bound: finish them under the weights they
                # began with, before the sync that waits for this generation.
                samples = finish_now(cfg, rollout_id, samples, late, waited=True)
            if all(filtered_reason(s) for s in samples) and all(filtered_reason(g[0]) for g in groups):
                # The abort left nothing to train on: finish the cut generations now (the weights have not
                # changed yet), rather than train on an empty batch.
                samples = finish_now(cfg, rollout_id, samples)
        new = split_groups(samples, n)
        groups += new
        keep += [group_filter(g) if group_filter is not None and not filtered_reason(g[0]) else True for g in new]
        aborted = any(Status.parse(s.status) is Status.ABORTED for s in samples)
        passing = sum(1 for g, k in zip(groups, keep) if k and not filtered_reason(g[0]))
        if group_filter is None or aborted or passing >= cfg.data.prompts_per_rollout:
            break  # an abort means the weights are about to change: no more calls for this rollout
    marked = [bool(filtered_reason(g[0])) for g in groups]
    target = cfg.data.prompts_per_rollout if ds.enabled else sum(not m for m in marked)
    return select_groups(groups, keep, target, already_marked=marked).samples()


def finish_now(
    cfg: RunConfig, rollout_id: int, samples: list[Sample], groups: set[int] | None = None, waited: bool = False
) -> list[Sample]:
    """`samples` with their deferred groups (those of `groups`, or all) generated to the end by the engine's current
    weights, rewarded and put back in place; `waited` records them as finished before the sync."""
    n = cfg.rollout.n_samples_per_prompt
    picked = samples if groups is None else [s for s in samples if s.group_index in groups]
    done = finish_aborted_task(cfg, rollout_id, quote(picked))
    finished = {g[0].group_index: mark_waited(g) if waited else g for g in split_groups(done, n)}
    samples = [s for g in split_groups(samples, n) for s in finished.get(g[0].group_index, g)]
    return reward_task(cfg, quote(samples))


def log_dropped(cfg: RunConfig, samples: list[Sample]) -> None:
    """pipeline.stale_policy=drop: one warning naming the groups a continuation would have made too stale."""
    stale = sorted({s.group_index for s in samples if filtered_reason(s) == "stale"})
    if stale:
        from prefect import get_run_logger

        get_run_logger().warning(
            f"dropped {len(stale)} cut group(s) {stale[:8]}{' ...' if len(stale) > 8 else ''}: continued now they "
            f"would hold tokens more than pipeline.max_staleness={cfg.pipeline.max_staleness} versions old "
            "(pipeline.stale_policy=drop; 'wait' finishes them before the sync instead)"
        )


def previous_train_artifact(cfg: RunConfig, store: RolloutStore, rollout_id: int) -> str | None:
    """The URI of train rollout `rollout_id - 1` when committed (its aborted groups are continued now)."""
    if rollout_id == 0 or not store.exists(cfg.run, "train", rollout_id - 1):
        return None
    return ArtifactRef(cfg.store.root, cfg.run, "train", rollout_id - 1).uri


@task(name="finish-aborted", cache_policy=NO_CACHE)
def finish_aborted_task(cfg: RunConfig, rollout_id: int, samples: list[Sample]) -> list[Sample]:
    return WorkerGroup.for_run(cfg).engine().finish_aborted(rollout_id, samples)


@task(name="generate-next", cache_policy=NO_CACHE)
def prefetch_task(
    cfg: RunConfig, store: RolloutStore, rollout_ids: list[int], weight_version: int
) -> tuple[list[ArtifactRef], float]:
    """Async training: rollouts `rollout_ids` generated (in order, with the engine's weights `weight_version`),
    rewarded and committed while the trainer trains on an earlier one (their generate / reward / persist show as
    this task's children in the UI). Returns their refs and the seconds the generator was busy."""
    reporting.STAGE_HOOK.set(None)  # this thread's copy of the context: the progress bar follows the train step
    started = time.perf_counter()
    refs = [committed_or_generate(cfg, store, rid, weight_version=weight_version) for rid in rollout_ids]
    return refs, time.perf_counter() - started


def rollouts_ahead(cfg: RunConfig, store: RolloutStore, rollout_id: int) -> list[int]:
    """The train rollouts iteration `rollout_id` generates beside its train step: those up to `pipeline.depth`
    ahead (and before the run's last) not committed yet. Lock step: in steady state that is rollout_id + depth,
    generated with weights rollout_id; the first iteration fills the queue (weights 0); a resumed run finds
    the queue committed before its checkpoint and generates what the uninterrupted run generated there."""
    last = min(rollout_id + cfg.pipeline.depth, cfg.iterations - 1)
    return [j for j in range(rollout_id + 1, last + 1) if not store.exists(cfg.run, "train", j)]


def queue_depth(cfg: RunConfig, store: RolloutStore, rollout_id: int) -> int:
    """Committed train rollouts ahead of the one being trained (what the trainer can consume without waiting)."""
    return sum(1 for j in store.list_ids(cfg.run, "train") if j > rollout_id)


@task(name="abort-generation", cache_policy=NO_CACHE)
def abort_task(cfg: RunConfig) -> int:
    """Partial rollouts: the trainer is done, the weights change now; unfinished generations stop here."""
    return WorkerGroup.for_run(cfg).abort_rollout()


def eval_metrics(
    cfg: RunConfig, store: RolloutStore, rollout_id: int, weight_version: int | None = None
) -> dict[str, float]:
    ref = committed_or_generate(cfg, store, rollout_id, "eval", greedy=True, weight_version=weight_version)
    samples = store.load_uri(ref.uri).samples
    ev = cfg.data.eval  # pass@k only with an eval section (its own n samples per prompt)
    return eval_summary(
        samples,
        ks=ev.pass_k if ev else (),
        threshold=ev.pass_threshold if ev else 1.0,
        reward_key=cfg.rollout.reward_key_for("eval"),
    )


def pipeline_metrics_on(cfg: RunConfig) -> bool:
    pipe = cfg.pipeline
    return pipe.pipelined or pipe.partial_rollout or pipe.dynamic_sampling.enabled


def pipeline_metrics(cfg: RunConfig, store: RolloutStore, ref: ArtifactRef, trainer_version: int) -> dict[str, float]:
    """`pipeline/*`: staleness of the trained tokens, filtered groups by reason, continued samples."""
    artifact = store.load_uri(ref.uri)
    stats = pipeline_stats(artifact.columns, trainer_version, artifact.manifest.n_samples_per_prompt)
    return stats.metrics()


def run_iteration(cfg: RunConfig, rollout_id: int) -> dict:
    """The `rl_iteration` sub-flow, as the run loops call it: with rollflow's heartbeats and without Prefect's
    (prefect_ops/heartbeats.py: Prefect's would add ~0.9 s to every iteration)."""
    with without_prefect_heartbeats():
        return rl_iteration(cfg, rollout_id)


@flow(name="rl_iteration", flow_run_name=flow_run_name("/iter-{rollout_id:04d}"))
@with_heartbeats
def rl_iteration(cfg: RunConfig, rollout_id: int) -> dict:
    """One RL iteration on rollout `rollout_id`; afterwards the engine holds weight version rollout_id + 1."""
    started = time.perf_counter()
    store = RolloutStore(cfg.store.root)  # one per flow run: every task and helper below shares it
    iteration = rollout_id + 1
    row: dict = {"iteration": iteration, "rollout_id": rollout_id}
    reporting.stage("start", iteration)
    if cfg.eval_every and rollout_id % cfg.eval_every == 0:
        reporting.stage("eval")
        row.update(eval_metrics(cfg, store, rollout_id))
    generating = time.perf_counter()
    ref = committed_rollout(cfg, store, rollout_id)
    generated_here = ref is None  # the queue was empty (first iteration)
    ref = ref or generate_rollout(cfg, store, rollout_id)
    generator_busy_s = time.perf_counter() - generating if generated_here else 0.0
    side_exports(cfg, store, ref)
    reporting.stage("train")
    offload = offloads(cfg)
    if offload:
        # Colocation order: engine release -> trainer onload -> train -> engine resume weights -> update weights
        # -> (checkpoint) -> trainer offload -> engine resume KV cache; the engine then generates alone.
        release_memory_task(cfg)
        trainer_onload_task(cfg)
    load_task(cfg, ref)
    prefetch = None
    ahead = rollouts_ahead(cfg, store, rollout_id) if cfg.pipeline.pipelined else []
    if ahead:
        # The engine (weights of version rollout_id) generates the rollouts ahead while the trainer trains on this
        # one; they are committed before this iteration's checkpoint, so a resume never redoes them.
        prefetch = prefetch_task.submit(cfg, store, ahead, rollout_id)
    metrics, steps = train_task(cfg, ref)
    row.update(metrics)
    if prefetch is not None:
        trained = time.perf_counter()
        if cfg.pipeline.partial_rollout and not prefetch.state.is_final():
            abort_task(cfg)
        _refs, busy_s = prefetch.result()  # committed (or raises) before the engine's weights change
        row["pipeline/trainer_wait_s"] = time.perf_counter() - trained
        generator_busy_s += busy_s
        row["pipeline/generated_ahead"] = float(len(ahead))
    if cfg.pipeline.pipelined:
        row["pipeline/queue_depth"] = float(queue_depth(cfg, store, rollout_id))
    if pipeline_metrics_on(cfg):
        row.update(pipeline_metrics(cfg, store, ref, trainer_version=rollout_id))
    reporting.stage("sync")
    if offload:
        resume_memory_task(cfg, ["weights"])
    parity = sync_task(cfg, iteration)
    row["sync/weight_version"] = parity["weight_version"]
    row["sync/parity_ok"] = float(parity["ok"])
    if probe_due(cfg, parity["weight_version"]) and not offload:
        # Checksums passed: the engine holds the trainer's tensors; the probe checks it also serves them. Under
        # offload the engine has no KV cache until the trainer is offloaded, so both cannot score at once.
        probe_started = time.perf_counter()
        row["sync/probe_logprob_diff"] = probe_task(cfg, parity["weight_version"])
        row["perf/sync_probe_s"] = time.perf_counter() - probe_started
    row["perf/iteration_s"] = time.perf_counter() - started
    if cfg.pipeline.pipelined:
        row["pipeline/generator_busy_s"] = generator_busy_s
        row["pipeline/generator_idle_s"] = max(0.0, row["perf/iteration_s"] - generator_busy_s)
    row["rollout_uri"] = ref.uri
    trend = trend_with(cfg, row)
    if trend.verdict != "short":
        row[SLOPE_METRIC] = trend.slope
    # Metrics before the checkpoint: the checkpoint commits the iteration, and a resume drops rows
    # of iterations after the last checkpoint.
    rows = reporting.record_iteration(cfg, row)
    reporting.record_train_steps(cfg, iteration, steps)  # train_steps.jsonl, committed with the same checkpoint
    if iteration % cfg.checkpoint_every == 0 or iteration == cfg.iterations:
        reporting.stage("checkpoint")
        checkpoint_task(cfg, iteration)
    if offload:  # after the checkpoint, which reads the weights
        trainer_offload_task(cfg)
        resume_memory_task(cfg, ["kv_cache"])
    reporting.publish_iteration(cfg, rows, row["rollout_uri"])
    if trend.verdict != "short":
        mismatch_trend_task(cfg, trend)  # after the commit: a failing trend stops the run after this iteration
    reporting.stage("done", iteration, reporting.metrics_line(row))
    return row
