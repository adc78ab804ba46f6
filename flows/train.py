"""`rl_train`: N iterations with checkpoints, eval and resume; the engine and trainer live across them."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.artifacts.store import RolloutStore
from rollflow.flows import reporting, tracking
from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup, connect_ray
from rollflow.flows.iteration import check_weight_update_task, eval_metrics, run_iteration
from rollflow.flows.params import TrainParams
from rollflow.flows.prefect_ops.cancellation import actors_running, stop_actors_hook
from rollflow.flows.prefect_ops.naming import flow_run_name, tag_current_run
from rollflow.flows.prefect_ops.run_lock import one_run_at_a_time
from rollflow.tasks.debug.resume_bug import with_resume_bug
from rollflow.tasks.rollout.dataset import check_resume, data_state
from rollflow.tasks.train.checkpoint import CheckpointError, checkpoint_status, load_checkpoint_meta


class RunExistsError(RuntimeError):
    pass


class InjectedFault(RuntimeError):
    """debug.fail_after_iteration fired (a drill, not a bug)."""


def resume_point(cfg: RunConfig, store: RolloutStore) -> int:
    """Iterations already done: the last committed checkpoint whose marker verifies (or `resume_from`; 0 when
    fresh). Checkpoints skipped on the way (no or unreadable marker) are logged, naming the one used."""
    # Unreachable endpoint, bad credentials, missing bucket: one clear error before any actor starts.
    store.check_access()
    committed, skipped = checkpoint_status(cfg.store.root, cfg.run)
    last = committed[-1] if committed else None
    if not cfg.resume and (last is not None or store.list_ids(cfg.run, "train")):
        raise RunExistsError(
            f"run {cfg.run!r} already has artifacts under {cfg.store.root}: set resume=true to continue it, "
            "or choose another run name"
        )
    if cfg.resume_from is not None:
        if cfg.resume_from != 0 and cfg.resume_from not in committed:
            why = f" ({skipped[cfg.resume_from]})" if cfg.resume_from in skipped else ""
            raise CheckpointError(
                f"resume_from={cfg.resume_from}: run {cfg.run!r} has no committed checkpoint "
                f"{cfg.resume_from}{why}; committed: {committed or 'none'}"
            )
        last = cfg.resume_from or None
    newer_skipped = {i: why for i, why in skipped.items() if last is None or i > last}
    if newer_skipped:
        used = f"checkpoint {last}" if last is not None else "no checkpoint (a fresh start)"
        notes = "; ".join(f"{i}: {why}" for i, why in newer_skipped.items())
        get_run_logger().warning(f"run {cfg.run!r}: skipped uncommitted checkpoint(s) {notes}; resuming from {used}")
    return last or 0


# The hooks stop the run's actors and release its placement when the run fails or crashes in-process.
@task(name="start-workers", cache_policy=NO_CACHE)
def start_workers_task(cfg: RunConfig, start: int) -> None:
    """Placement, trainer (+ critic for ppo) and engine (the ~10 s of start-up, its own task in the UI)."""
    # No-op unless the kill-and-resume drill injects its resume bug (tasks/debug/resume_bug.py).
    cfg = cfg.model_copy(update={"data": with_resume_bug(cfg.data, start)})
    group = WorkerGroup.for_run(cfg)
    group.start_placement()
    group.start_trainer(start)
    group.start_critic(start)  # ppo only
    group.start_engine(start)


def retry_note(cfg: RunConfig, start: int) -> str | None:
    """On a retry of this flow run (UI Retry, `prefect flow-run retry`, flow-level retries): what it continues."""
    from prefect.runtime import flow_run

    count = flow_run.run_count or 1
    if count <= 1:
        return None
    where = f"checkpoint {start}" if start else "the start (no committed checkpoint)"
    return (
        f"retry {count - 1} of flow run {flow_run.name} ({flow_run.id}): run {cfg.run!r} resumes from {where}, "
        "reusing every committed rollout"
    )


# The hooks stop the run's actors and release its placement when the run fails or crashes in-process.
@flow(name="rl_train", flow_run_name=flow_run_name(), on_failure=[stop_actors_hook], on_crashed=[stop_actors_hook])
@one_run_at_a_time()
def rl_train(params: TrainParams) -> dict:  # type: ignore[valid-type]
    """RL training: generate -> reward -> persist -> train -> sync per iteration; resumes from the last committed
    checkpoint (also on a retry of the same run). `params`: the sections it reads, or a whole RunConfig."""
    cfg = params.run_config()
    if cfg.debug.rollout_only or cfg.debug.train_only:
        raise ValueError(
            "rl_train runs the full loop; debug.rollout_only / debug.train_only select the rollout_only and "
            "replay_train flows (`rollflow rollout` / `rollflow replay`)"
        )
    from prefect.runtime import flow_run

    tag_current_run(cfg.run, "train")
    for text in cfg.notices:  # settings the config implied: in the run's log, where a deployment's user looks
        get_run_logger().warning(text)
    if (flow_run.run_count or 1) > 1 and not cfg.resume:
        cfg = cfg.model_copy(update={"resume": True})  # a retry of this flow run continues it
    store = RolloutStore(cfg.store.root)  # one per flow run
    start = resume_point(cfg, store)
    note = retry_note(cfg, start)
    if note:
        get_run_logger().warning(note)
        reporting.publish_note(cfg, "resume", note)
    connect_ray(cfg)
    reporting.truncate_metrics(cfg, start)
    if start >= cfg.iterations:
        get_run_logger().warning(f"run {cfg.run!r} already finished {start} iterations; nothing to do")
        return summarize(cfg, reporting.read_metrics(cfg), start)
    if start:
        cursor = check_data_resume(cfg, start)
        where = f", data epoch {cursor['epoch']} offset {cursor['offset']}" if "epoch" in cursor else ""
        get_run_logger().warning(f"resuming run {cfg.run!r} at iteration {start + 1} (checkpoint {start}{where})")
    # Detached actors: they outlive any task that restarts them and are stopped at the end of the run.
    # With GPUs (resources.num_gpus > 0) the run's placement group is reserved once, here; the actors
    # (and any restart of them) go into its bundles, and stop_all releases it.
    group = WorkerGroup.for_run(cfg)
    # TensorBoard / MLflow / W&B (tracking.backends): the same tracking run across resumes; a row is logged
    # once its checkpoint is committed, so no step is logged twice. A failing sink never fails the run.
    with tracking.start_train(cfg, start) as tracker:
        return _train_loop(cfg, store, start, group, tracker, note)


def _train_loop(
    cfg: RunConfig, store: RolloutStore, start: int, group: WorkerGroup, tracker: tracking.Tracker, note: str | None
) -> dict:
    from prefect.runtime import flow_run

    # UI cancel (Cancelling) of a run no runner watches (a CLI call): stop the actors, end Cancelled.
    with actors_running(group.stop_all) as watcher:
        reporting.stage("start-workers")
        start_workers_task(cfg, start)
        if cfg.debug.check_weight_update_equal and cfg.rollout.engine == "sglang":
            reporting.stage("check weight update")
            check_weight_update_task(cfg, start)
        for rollout_id in range(start, cfg.iterations):
            row = run_iteration(cfg, rollout_id)
            get_run_logger().info(reporting.metrics_line(row))
            if tracking.checkpointed(cfg, row["iteration"]):
                tracking.log_committed(tracker, cfg, row["iteration"])
            if cfg.debug.fail_after_iteration == rollout_id + 1 and (flow_run.run_count or 1) == 1:
                raise InjectedFault(
                    f"debug.fail_after_iteration={rollout_id + 1}: failing after the committed "
                    "checkpoint on purpose; retry this flow run to resume it"
                )
        if cfg.eval_every:
            reporting.stage("final eval")
            final = eval_metrics(cfg, store, cfg.iterations)
            rows = reporting.read_metrics(cfg)
            rows[-1]["eval/final_accuracy"] = final["eval/accuracy"]
            rows[-1].update({k.replace("eval/", "eval/final_"): v for k, v in final.items() if "pass@" in k})
            reporting.write_metrics(cfg, rows)
            tracker.log(
                tracking.numeric_metrics({k: v for k, v in rows[-1].items() if k.startswith("eval/final_")}),
                cfg.iterations,
            )
    if watcher.cancelled:
        return watcher.cancelled_state()
    rows = reporting.read_metrics(cfg)
    plot = reporting.plot_rewards(cfg, rows)
    summary = summarize(cfg, rows, start)
    reporting.publish_summary(cfg, store, summary, rows, plot, note=note)
    if tracker.active:
        tracker.log_file(plot if plot and tracking.local_store_root(cfg) else None)
        tracker.set_summary(summary)
    return summary


def check_data_resume(cfg: RunConfig, start: int) -> dict:
    """The data cursor at `start`, checked against the one saved with checkpoint `start`.

    Raises `DataResumeMismatch` (before any actor starts) when resuming would continue at another
    sample than the interrupted run would have: changed data file, batch size, seed or shuffle.
    """
    current = data_state(cfg.data, start)
    saved = load_checkpoint_meta(cfg.store.root, cfg.run, start).get("data")
    check_resume(saved, current, start)
    return current


def summarize(cfg: RunConfig, rows: list[dict], start: int) -> dict:
    out: dict = {"run": cfg.run, "resumed_from": start, "iterations": len(rows)}
    if rows:
        out["first_reward"] = rows[0].get("rollout/raw_reward")
        out["last_reward"] = rows[-1].get("rollout/raw_reward")
        evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
        if evals:
            out["first_eval_accuracy"] = evals[0]
        if "eval/final_accuracy" in rows[-1]:
            out["final_eval_accuracy"] = rows[-1]["eval/final_accuracy"]
    return out
