"""`alignment_check`: the precision-alignment checks as a Prefect flow, and its nightly deployment.

The flow starts its own engine and trainer actors (run `{run}-align`, fresh weights, one optimizer
step per rollout), runs `rollflow.tasks.debug.alignment.run_alignment` on them (each phase a task), publishes a
markdown and a table artifact, writes `{store.root}/{run}/alignment/{timestamp}.json` and ends
Failed when any check fails.

    rollflow align                     # once, prints the report; exit code 1 on a failed check
    rollflow serve                     # nightly at 02:00 UTC (serves the deployment, blocks)
    rollflow serve --register-only     # register the deployment + schedule, run nothing
    rollflow serve --repro --drill-resume   # nightly, with the reproducibility gate and the kill-and-resume drill
"""

from __future__ import annotations

import datetime as _dt
import posixpath
import subprocess
from typing import Any, Callable, Optional
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.flows import reporting, tracking
from rollflow.flows.actor_calls import ActorRunner, stop_and_wait
from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup, connect_ray
from rollflow.flows.params import AlignmentParams, params_of
from rollflow.flows.prefect_ops.cancellation import actors_running
from rollflow.flows.prefect_ops.naming import flow_run_name, tag_current_run
from rollflow.flows.prefect_ops.run_lock import one_run_at_a_time
from rollflow.flows.repro_gate import run_repro_gate
from rollflow.flows.resume_drill import DRILL, drill_markdown, run_resume_drill
from rollflow.infra.automations import apply_with_alert
from rollflow.tasks.debug.alignment import refuse_faults_it_cannot_take, run_alignment
from rollflow.tasks.debug.checks import FAIL, AlignmentReport, AlignmentThresholds, CheckResult
from rollflow.tasks.debug.faults import AlignmentFaults

NIGHTLY = "nightly-alignment"
NIGHTLY_CRON = "0 2 * * *"
FLOW_NAME = "alignment_check"


class AlignmentFailed(RuntimeError):
    """At least one alignment check failed; `report` is the report dict, `path` its JSON file."""

    def __init__(self, message: str, report: dict | None = None, path: str | None = None):
        super().__init__(message)
        self.report = report
        self.path = path

    def __reduce__(self):
        return (type(self), (str(self), self.report, self.path))


def alignment_config(cfg: RunConfig) -> RunConfig:
    """The config the check runs under: its own actors (`{run}-align`), one optimizer step per rollout."""
    data = cfg.model_dump()
    data["run"] = f"{cfg.run[:94]}-align"
    data["resume"] = False
    data["train"]["num_steps_per_rollout"] = 1
    return RunConfig.model_validate(data)


def _phase_as_task(name: str, fn: Callable[[], Any]) -> Any:
    """Each phase of the checks is a Prefect task run (visible in the UI); no retries, no cache."""
    reporting.stage(name)

    def body() -> Any:
        return fn()

    return task(name=name, cache_policy=NO_CACHE, retries=0)(body)()


class CheckFailed(RuntimeError):
    """One alignment check failed (its task ends Failed; the flow fails after publishing the report)."""


@task(name="check", cache_policy=NO_CACHE, retries=0)
def check_task(check: dict) -> dict:
    """A check's verdict as a task state: Completed (pass / warn) or Failed (fail), with its message."""
    if check["status"] == "fail":
        causes = "; ".join(check.get("causes") or [])
        raise CheckFailed(f"{check['name']}: {check['message']}" + (f" (likely causes: {causes})" if causes else ""))
    return check


class DrillFailed(RuntimeError):
    """The kill-and-resume drill failed (its task ends Failed); `check` is its CheckResult dict."""

    def __init__(self, message: str, check: dict):
        super().__init__(message)
        self.check = check

    def __reduce__(self):
        return (type(self), (str(self), self.check))


def resume_drill_task(cfg: RunConfig) -> CheckResult:
    """The kill-and-resume drill (flows/resume_drill.py) as the `resume-drill` task: red when the resumed run
    differs from the uninterrupted one or a leg of the drill did not finish; its report is the
    `{run}-resume-drill` markdown artifact either way."""
    from prefect.artifacts import create_markdown_artifact

    reporting.stage("resume-drill")

    def body() -> dict:
        try:
            check = run_resume_drill(cfg).check
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            # a leg that crashed or never reached its checkpoint: still a verdict, with the reason, in the artifact
            check = CheckResult(DRILL, FAIL, {}, f"the drill did not finish: {exc}")
        create_markdown_artifact(
            key=reporting.artifact_key(cfg.run, "resume-drill"),
            markdown=drill_markdown(cfg, check),
            description=f"Kill-and-resume drill of run `{cfg.run}`: {check.status.upper()}"[:500],
        )
        if check.failed:
            raise DrillFailed(f"{DRILL}: {check.message}", check.to_dict())
        return check.to_dict()

    state = task(name="resume-drill", cache_policy=NO_CACHE, retries=0)(body)(return_state=True)
    if state.is_completed():
        return CheckResult.from_dict(state.result())
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, DrillFailed):
        return CheckResult.from_dict(exc.check)
    return CheckResult(DRILL, FAIL, {}, f"the drill task ended {state.type.value}: {exc}")


def report_path(cfg: RunConfig, stamp: str) -> tuple[Any, str]:
    fs, path = reporting.run_file(cfg, posixpath.join("alignment", f"{stamp}.json"))
    return fs, path


def write_report_json(cfg: RunConfig, report: AlignmentReport) -> str:
    """`{store.root}/{run}/alignment/{timestamp}.json` (any fsspec root); returns the path."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    fs, path = report_path(cfg, stamp)
    n = 1
    while fs.exists(path):  # two runs within one second
        n += 1
        fs, path = report_path(cfg, f"{stamp}-{n}")
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(report.to_json())
    return path


def publish_report(cfg: RunConfig, report: AlignmentReport, json_path: str) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(
        key=reporting.artifact_key(cfg.run, "alignment"),
        markdown=report.to_markdown() + f"\nJSON report: `{json_path}`\n",
        description=f"Precision alignment report of run `{cfg.run}`: {report.summary()}"[:500],
    )
    create_table_artifact(
        key=reporting.artifact_key(cfg.run, "alignment-checks"),
        table=report.table_rows(),
        description=f"Alignment checks of run `{cfg.run}` ({report.status})",
    )


@flow(name=FLOW_NAME, flow_run_name=flow_run_name("/align"))
@one_run_at_a_time(lambda params: alignment_config(params.run_config()).run)
def alignment_check(
    params: AlignmentParams,
    memory_budget_mb: Optional[float] = None,  # type: ignore[valid-type]
    thresholds: Optional[AlignmentThresholds] = None,
    faults: Optional[AlignmentFaults] = None,
    reproducibility: bool = False,
    resume_drill: bool = False,
) -> dict:
    """Precision alignment check of engine and trainer (slime's debug.md step 1 / step 2), on fresh actors.

    Fails (after publishing the report) when any check fails. `params`: the RunConfig sections it reads, or a
    whole RunConfig (flows/params.py); `memory_budget_mb` bounds the largest worker peak (host RSS or CUDA);
    `faults` injects known failures, to see what they look like; `reproducibility` adds the bitwise
    reproducibility gate and the group-diversity guard (the config run twice in fresh workers: flows/repro_gate.py);
    `resume_drill` the kill-and-resume drill (the config run straight through, then killed after a committed
    checkpoint and resumed: flows/resume_drill.py), its own `resume-drill` task.
    """
    cfg = params.run_config()
    if faults is not None and faults.repro_only and not reproducibility:
        raise ValueError(
            f"faults {', '.join(faults.repro_only)} act on the reproducibility gate only: pass "
            "reproducibility=True (`rollflow align --repro`)"
        )
    refuse_faults_it_cannot_take(cfg, faults)
    tag_current_run(cfg.run, "align")
    logger = get_run_logger()
    acfg = alignment_config(cfg)
    connect_ray(acfg)
    group = WorkerGroup.for_run(acfg)
    stop_and_wait(group)
    # The clients are held for the flow's lifetime (a named, non-detached actor ends with its handles).
    # UI cancel of a run no runner watches (a CLI `rollflow align`): stop the actors, end Cancelled.
    workers: list = []
    with actors_running(group.stop_all, cleanup=lambda: stop_and_wait(group)) as watcher:
        workers += [group.start_trainer(None), group.start_engine(None)]
        trainer, engine = workers
        report = run_alignment(
            ActorRunner(engine.actor),
            ActorRunner(trainer.actor),
            acfg,
            thresholds=thresholds,
            memory_budget_mb=memory_budget_mb,
            faults=faults,
            call_phase=_phase_as_task,
        )
    workers.clear()
    if watcher.cancelled:
        return watcher.cancelled_state()
    report.context["run"] = cfg.run
    report.context["actors"] = acfg.run
    if reproducibility:
        reporting.stage("reproducibility")
        report.checks.extend(run_repro_gate(cfg, faults))
    for check in report.checks:  # one task per check: a failed check is a red task in the UI, not only the flow
        check_task.with_options(name=f"check-{check.name}")(check.to_dict(), return_state=True)
    if resume_drill:  # after the checks' tasks: the drill's own task already shows its verdict
        report.checks.append(resume_drill_task(cfg))
    path = write_report_json(cfg, report)
    publish_report(cfg, report, path)
    out = report.to_dict() | {"json_path": path}
    tracking.log_alignment(cfg, out, path)  # one point per check figure per run: the nightly trend
    if not report.ok:
        logger.error(report.summary())
        raise AlignmentFailed(f"{report.summary()} (report: {path})", out, path)
    logger.info(report.summary())
    return out


# ---- the nightly deployment ---------------------------------------------------------------------------


def nightly_parameters(
    cfg: RunConfig | None = None,
    memory_budget_mb: float | None = None,
    thresholds: AlignmentThresholds | None = None,
    reproducibility: bool = False,
    resume_drill: bool = False,
) -> dict[str, Any]:
    """The nightly deployment's parameters: the alignment form (only the sections the check reads);
    `reproducibility`: the nightly run also runs the bitwise reproducibility gate (twice the config's iterations);
    `resume_drill`: and the kill-and-resume drill (twice the config's iterations, three process launches)."""
    cfg = cfg or RunConfig(run="nightly")
    params: dict[str, Any] = {
        "params": params_of(FLOW_NAME, cfg),
        "memory_budget_mb": memory_budget_mb,
        "reproducibility": reproducibility,
        "resume_drill": resume_drill,
    }
    if thresholds is not None:
        params["thresholds"] = thresholds.model_dump(mode="json")
    return params


def nightly_deployment(
    cron: str = NIGHTLY_CRON,
    cfg: RunConfig | None = None,
    *,
    memory_budget_mb: float | None = None,
    thresholds: AlignmentThresholds | None = None,
    timezone: str = "UTC",
    reproducibility: bool = False,
    resume_drill: bool = False,
):
    """The `nightly-alignment` deployment with a cron schedule (a RunnerDeployment): the same one `rollflow
    worker` serves next to the other flows (flows/prefect_ops/deployments.py), so the two commands never disagree."""
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    return alignment_check.to_deployment(
        name=NIGHTLY,
        entrypoint_type=EntrypointType.MODULE_PATH,
        schedules=[Cron(cron, timezone=timezone)],
        parameters=nightly_parameters(cfg, memory_budget_mb, thresholds, reproducibility, resume_drill),
        description="Nightly precision-alignment check (coherence, step-1 log-prob equality, train/rollout "
        "mismatch, one-step update, weight-sync parity, step-2 load and peak memory).",
        tags=["rollflow", "alignment", "nightly"],
    )


def serve_nightly(
    cron: str = NIGHTLY_CRON,
    cfg: RunConfig | None = None,
    *,
    memory_budget_mb: float | None = None,
    thresholds: AlignmentThresholds | None = None,
    reproducibility: bool = False,
    resume_drill: bool = False,
) -> None:
    """Register the nightly deployment and execute its scheduled runs in this process (blocks)."""
    from prefect import serve

    deployment = nightly_deployment(
        cron,
        cfg,
        memory_budget_mb=memory_budget_mb,
        thresholds=thresholds,
        reproducibility=reproducibility,
        resume_drill=resume_drill,
    )
    apply_with_alert(deployment)  # the alert on Failed/Crashed/Late nightly runs exists before any run
    serve(deployment)


def register_nightly(
    cron: str = NIGHTLY_CRON,
    cfg: RunConfig | None = None,
    *,
    memory_budget_mb: float | None = None,
    thresholds: AlignmentThresholds | None = None,
    reproducibility: bool = False,
    resume_drill: bool = False,
) -> UUID:
    """Register (create or update) the nightly deployment and its schedule with the current API; returns
    its id. Scheduled runs execute while `serve_nightly` / `rollflow serve` runs (no work pool needed).
    Also creates (idempotently) the automation that fires on a Failed, Crashed or Late nightly run."""
    deployment = nightly_deployment(
        cron,
        cfg,
        memory_budget_mb=memory_budget_mb,
        thresholds=thresholds,
        reproducibility=reproducibility,
        resume_drill=resume_drill,
    )
    return apply_with_alert(deployment)[0]
