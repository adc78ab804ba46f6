"""`stage_replay`: recompute a stage of a committed run on its pinned artifacts and compare with what it recorded.

    rollflow replay --stage reward|advantage|loss|all --source-run R --ids 0-1

reward runs here (the reward function over the artifact's samples); advantage and loss retrain each pinned
rollout once, on a trainer actor of `{run}-stage`, from the checkpoint the run trained it from. Each (stage,
rollout) is a task that ends Failed on a mismatch; the flow publishes the mismatch table and raises
`StageReplayFailed` (carrying the report) when any value differs. Comparisons: tasks/debug/stage_replay.py.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from rollflow.artifacts.storage import open_fs
from rollflow.artifacts.store import ArtifactRef, RolloutStore
from rollflow.flows import reporting
from rollflow.flows.actor_calls import ActorRunner, stop_and_wait
from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup, connect_ray
from rollflow.flows.params import ReplayParams
from rollflow.flows.prefect_ops.cancellation import actors_running
from rollflow.flows.prefect_ops.heartbeats import with_heartbeats
from rollflow.flows.prefect_ops.naming import flow_run_name, tag_current_run
from rollflow.tasks.debug.replay_reward import replay_reward
from rollflow.tasks.debug.stage_replay import (
    EXACT,
    STAGES,
    StageReplayReport,
    StageResult,
    compare_metrics,
    compare_steps,
    compare_values,
    merge,
    tolerance_for,
)
from rollflow.tasks.debug.stage_worker import ReplayedIteration, retrain_iteration
from rollflow.tasks.rollout.rewards import reward_fn_from_config
from rollflow.tasks.train.records import SampleRecords, read_records, train_record_uri


class StageReplayFailed(RuntimeError):
    """A replayed stage differs from the recorded values; `report` is the report dict."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return (type(self), (str(self), self.report))


class StageMismatch(RuntimeError):
    """One (stage, rollout) differs: its task ends Failed (red in the UI)."""


def parse_stages(spec: str) -> list[str]:
    names = list(STAGES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise ValueError(f"--stage {spec!r}: expected one of {', '.join(STAGES)} or all (comma-separated)")
    return names


def stage_config(cfg: RunConfig) -> RunConfig:
    """Its own trainer actor (`{run}-stage`), never the source run's: a replay may run beside the training."""
    data = cfg.model_dump()
    data["run"] = f"{cfg.run[:94]}-stage"
    data["debug"] = {**data["debug"], "train_only": True}
    return RunConfig.model_validate(data)


def recorded_records(cfg: RunConfig, source_run: str, rollout_id: int) -> SampleRecords:
    uri = train_record_uri(cfg.store.root, source_run, rollout_id)
    fs, path = open_fs(uri)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"run {source_run!r} has no train records for rollout {rollout_id} ({uri}): it was "
            "trained before records were written; replay --stage reward still works"
        )
    with fs.open(path, "rb") as f:
        return read_records(f.read())


def recorded_iteration(cfg: RunConfig, source_run: str, rollout_id: int) -> tuple[dict, list[dict]]:
    """metrics.jsonl's row and train_steps.jsonl's rows of the iteration that trained `rollout_id`."""
    source = cfg.model_copy(update={"run": source_run})
    rows = [r for r in reporting.read_metrics(source) if r.get("rollout_id") == rollout_id]
    if not rows:
        raise FileNotFoundError(f"run {source_run!r} recorded no metrics for rollout {rollout_id} (metrics.jsonl)")
    steps = [r for r in reporting.read_train_steps(source) if r.get("iteration") == rollout_id + 1]
    return rows[-1], steps


@task(name="replay-reward", cache_policy=NO_CACHE)
def reward_stage(cfg: RunConfig, store: RolloutStore, ref: ArtifactRef) -> dict:
    samples = store.load_uri(ref.uri).samples
    report = replay_reward(samples, reward_fn_from_config(cfg.rollout), cfg.rollout.reward_key_for("train"))
    result = compare_values("reward", ref.rollout_id, "reward", report.old, report.new, EXACT)
    return result.to_dict()


@task(name="retrain-iteration", cache_policy=NO_CACHE)
def retrain_task(scfg: RunConfig, ref: ArtifactRef, source_run: str) -> ReplayedIteration:
    trainer = WorkerGroup.for_run(scfg).trainer()
    scratch = train_record_uri(scfg.store.root, scfg.run, ref.rollout_id)
    return ActorRunner(trainer.actor).run(
        retrain_iteration, ref, source_root=scfg.store.root, source_run=source_run, record_uri=scratch
    )


def advantage_result(recorded: SampleRecords, replayed: SampleRecords, rollout_id: int, dtype: str) -> StageResult:
    tol = tolerance_for(dtype)
    return merge(
        "advantage",
        rollout_id,
        [
            compare_values(
                "advantage",
                rollout_id,
                "reward",
                recorded.columns["reward"],
                replayed.columns["reward"],
                tolerance_for("float64"),
            ),
            compare_values(
                "advantage", rollout_id, "advantage", recorded.columns["advantage"], replayed.columns["advantage"], tol
            ),
        ],
    )


def loss_result(
    recorded_row: dict,
    recorded_steps: list[dict],
    recorded: SampleRecords,
    replayed: ReplayedIteration,
    rollout_id: int,
    dtype: str,
) -> StageResult:
    tol = tolerance_for(dtype)
    steps = reporting.step_rows(replayed.steps, 1, iteration=rollout_id + 1)
    parts = [
        compare_metrics("loss", rollout_id, recorded_row, replayed.metrics, tol),
        compare_steps(rollout_id, recorded_steps, steps, tol),
    ]
    for name in ("log_prob_sum", "ref_log_prob_sum"):
        parts.append(
            compare_values("loss", rollout_id, name, recorded.columns[name], replayed.records.columns[name], tol)
        )
    return merge("loss", rollout_id, parts)


@task(name="stage-check", cache_policy=NO_CACHE, retries=0)
def stage_check(result: dict) -> dict:
    if not StageResult.from_dict(result).ok:
        bad = result["mismatches"][:3]
        what = "; ".join(f"{m['field']} {m['where']}: recorded {m['recorded']} replayed {m['replayed']}" for m in bad)
        raise StageMismatch(
            f"{result['stage']} of rollout {result['rollout_id']}: {len(result['mismatches'])} "
            f"mismatches of {result['compared']} values ({what or 'nothing recorded to compare'})"
        )
    return result


@flow(name="stage_replay", flow_run_name=flow_run_name("/stage-replay"))
@with_heartbeats
def stage_replay(
    params: ReplayParams,
    stages: list[str],
    rollout_ids: list[int] | None = None,  # type: ignore[valid-type]
    source_run: str | None = None,
) -> dict:
    """Recompute `stages` (reward, advantage, loss) of run `source_run` (default: the config's run) on its pinned
    rollouts and compare with its recorded values; fails, after publishing the mismatch table, on any."""
    cfg = params.run_config(mode="train_only")
    source_run = source_run or cfg.run
    tag_current_run(source_run, "stage-replay")
    store = RolloutStore(cfg.store.root)
    store.check_access()
    ids = rollout_ids if rollout_ids is not None else store.list_ids(source_run, "train")
    if not ids:
        raise FileNotFoundError(f"run {source_run!r} has no committed rollouts under {cfg.store.root}")
    refs = []
    for rid in ids:
        store.manifest(source_run, "train", rid)  # ArtifactNotFound lists the ids that exist
        refs.append(ArtifactRef(cfg.store.root, source_run, "train", rid))
    results: list[StageResult] = []
    if "reward" in stages:
        for ref in refs:
            results.append(StageResult.from_dict(reward_stage(cfg, store, ref)))
    trained = [s for s in stages if s in ("advantage", "loss")]
    if trained:
        results += _trainer_stages(cfg, refs, source_run, trained)
    for result in results:
        stage_check.with_options(name=f"check-{result.stage}-{result.rollout_id}")(result.to_dict(), return_state=True)
    report = StageReplayReport(source_run, results)
    out = report.to_dict()
    create_table_artifact(
        key=reporting.artifact_key(source_run, "stage-replay"),
        table=report.table_rows(200) or [{"stage": ", ".join(stages), "mismatches": 0}],
        description=report.summary()[:500],
    )
    if not report.ok:
        get_run_logger().error(report.summary())
        raise StageReplayFailed(report.summary(), out)
    return out


def _trainer_stages(cfg: RunConfig, refs: list[ArtifactRef], source_run: str, stages: list[str]) -> list[StageResult]:
    scfg = stage_config(cfg)
    connect_ray(scfg)
    group = WorkerGroup.for_run(scfg)
    stop_and_wait(group)
    results: list[StageResult] = []
    dtype = cfg.train.dtype
    with actors_running(group.stop_all, cleanup=lambda: stop_and_wait(group)):
        group.start_trainer(None)
        for ref in refs:
            reporting.stage("replay", ref.rollout_id)
            recorded = recorded_records(cfg, source_run, ref.rollout_id)
            row, steps = recorded_iteration(cfg, source_run, ref.rollout_id)
            replayed = retrain_task(scfg, ref, source_run)
            if "advantage" in stages:
                results.append(advantage_result(recorded, replayed.records, ref.rollout_id, dtype))
            if "loss" in stages:
                results.append(loss_result(row, steps, recorded, replayed, ref.rollout_id, dtype))
    return results


def report_of(value: Any) -> dict | None:
    """The report a finished stage_replay carries: its return value, or the StageReplayFailed's."""
    if isinstance(value, StageReplayFailed):
        return value.report
    return value if isinstance(value, dict) else None
