"""`rl_train`: N iterations with checkpoints, eval and resume; the engine and trainer live across them."""

from __future__ import annotations

from prefect import flow, get_run_logger

from rollflow.artifacts.store import RolloutStore
from rollflow.flows import reporting
from rollflow.flows.config import RunConfig
from rollflow.flows.group import connect_ray, start_engine, start_placement, start_trainer, stop_all
from rollflow.flows.iteration import check_weight_update_task, eval_metrics, rl_iteration
from rollflow.tasks.train.checkpoint import latest_checkpoint


class RunExistsError(RuntimeError):
    pass


def resume_point(cfg: RunConfig) -> int:
    """Iterations already done: the last committed checkpoint (0 for a fresh run)."""
    store = RolloutStore(cfg.store.root)
    # Unreachable endpoint, bad credentials, missing bucket: one clear error before any actor starts.
    store.check_access()
    last = latest_checkpoint(cfg.store.root, cfg.run)
    if not cfg.resume and (last is not None or store.list_ids(cfg.run, "train")):
        raise RunExistsError(
            f"run {cfg.run!r} already has artifacts under {cfg.store.root}: set resume=true to continue it, "
            "or choose another run name"
        )
    return last or 0


@flow(name="rl_train")
def rl_train(cfg: RunConfig) -> dict:
    if cfg.debug.rollout_only or cfg.debug.train_only:
        raise ValueError(
            "rl_train runs the full loop; debug.rollout_only / debug.train_only select the rollout_only and "
            "replay_train flows (`rollflow rollout` / `rollflow replay`)"
        )
    connect_ray(cfg)
    start = resume_point(cfg)
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
    start_placement(cfg)
    try:
        start_trainer(cfg, start)
        start_engine(cfg, start)
        if cfg.debug.check_weight_update_equal and cfg.rollout.engine == "sglang":
            reporting.stage("check weight update")
            check_weight_update_task(cfg, start)
        for rollout_id in range(start, cfg.iterations):
            row = rl_iteration(cfg, rollout_id)
            get_run_logger().info(reporting.metrics_line(row))
        if cfg.eval_every:
            reporting.stage("final eval")
            final = eval_metrics(cfg, cfg.iterations)
            rows = reporting.read_metrics(cfg)
            rows[-1]["eval/final_accuracy"] = final["eval/accuracy"]
            rows[-1].update({k.replace("eval/", "eval/final_"): v for k, v in final.items() if "pass@" in k})
            reporting.write_metrics(cfg, rows)
    finally:
        stop_all(cfg)
    rows = reporting.read_metrics(cfg)
    reporting.plot_rewards(cfg, rows)
    return summarize(cfg, rows, start)


def check_data_resume(cfg: RunConfig, start: int) -> dict:
    """The data cursor at `start`, checked against the one saved with checkpoint `start`.

    Raises `DataResumeMismatch` (before any actor starts) when resuming would continue at another
    sample than the interrupted run would have: changed data file, batch size, seed or shuffle.
    """
    from rollflow.tasks.rollout.dataset import check_resume, data_state
    from rollflow.tasks.train.checkpoint import load_checkpoint_meta

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
