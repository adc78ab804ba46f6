"""Stall deadlines around the iteration's tasks: the watch each task's actor waits run under, and what a stall
publishes (docs/checks.md). The deadline itself lives in infra/deadline.py; this is the Prefect side of it.

`@watched("generate")` under `@task`: every client wait in the task body runs under a `StallWatch` built from the
task's `RunConfig` (its first argument, `watchdog.stall_s`). On a stall the task fails with the infra's one-line
`StallError`; before that, the stack file goes into a markdown artifact and a `rollflow.stall` event is emitted
(an automation can fire on it). The task's retry policy then applies: `generate` retries and `ensure_engine`
restarts the killed engine; `sync` retries after a stall (`retry_after_stall`); `train` never retries (the
optimizer may have stepped) and rl_train's flow-level retries (`retries`) resume from the last checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run

from rollflow.artifacts.storage import open_fs
from rollflow.flows.config import RunConfig
from rollflow.flows.reporting import artifact_key
from rollflow.infra.deadline import StallError, StallWatch, stacks_uri, watching

F = TypeVar("F", bound=Callable[..., Any])
STALL_EVENT = "rollflow.stall"
REPORT_CHARS = 60_000  # the artifact holds the head of the stack file; the file holds all of it


def current_iteration() -> int:
    """The iteration of the rl_iteration flow run this task runs in (rollout_id + 1), 0 outside one."""
    rollout_id = (flow_run.parameters or {}).get("rollout_id")
    return int(rollout_id) + 1 if isinstance(rollout_id, int) else 0


def stall_watch(cfg: RunConfig, task: str, iteration: int | None = None) -> StallWatch | None:
    """The watch of `task` under `cfg.watchdog` (None when the deadline is off)."""
    if cfg.watchdog.stall_s <= 0:
        return None
    it = current_iteration() if iteration is None else iteration
    return StallWatch(
        run=cfg.run,
        task=task,
        iteration=it,
        stall_s=cfg.watchdog.stall_s,
        stacks_uri=stacks_uri(cfg.store.root, cfg.run, it, task),
    )


def watched(task: str) -> Callable[[F], F]:
    """Run the decorated task body (first argument: the RunConfig) under its stall watch."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(cfg: RunConfig, *args: Any, **kwargs: Any) -> Any:
            with watching(stall_watch(cfg, task)):
                try:
                    return fn(cfg, *args, **kwargs)
                except StallError as exc:
                    publish_stall(cfg, exc)
                    raise

        return run  # type: ignore[return-value]

    return decorate


def publish_stall(cfg: RunConfig, exc: StallError) -> None:
    """The stall as a markdown artifact (the stack file's head) and a `rollflow.stall` event; never raises."""
    logger = get_run_logger()
    logger.error(str(exc))
    try:
        fs, path = open_fs(exc.stack_file)
        with fs.open(path, "r") as f:
            stacks = f.read(REPORT_CHARS)
    except Exception as err:  # noqa: BLE001 - the report must not replace the stall's own error
        stacks = f"(stack file not readable: {err})"
    markdown = (
        f"## Stall: task `{exc.task}` of run `{cfg.run}`\n\n"
        f"Actor `{exc.actor}` made no progress for {exc.seconds:.0f} s (watchdog.stall_s="
        f"{cfg.watchdog.stall_s:g}) and was killed; stacks of every actor of the run and of the flow process: "
        f"`{exc.stack_file}`\n\n```\n{stacks}\n```\n"
    )
    try:
        create_markdown_artifact(key=artifact_key(cfg.run, "stall"), markdown=markdown, description=str(exc)[:500])
        emit_event(
            event=STALL_EVENT,
            resource={"prefect.resource.id": f"rollflow.run.{cfg.run}", "prefect.resource.name": cfg.run},
            payload={
                "task": exc.task,
                "actor": exc.actor,
                "seconds": round(exc.seconds, 1),
                "stack_file": exc.stack_file,
            },
        )
    except Exception as err:  # noqa: BLE001
        logger.warning(f"stall report not published: {type(err).__name__}: {err}")


def retry_after_stall(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a task only when a stall failed it (its stuck actor is gone; `ensure_engine` restarts an engine)."""
    data = getattr(state, "data", None)
    if not isinstance(data, BaseException):
        try:
            data = state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - an unreadable result: not a stall we know of
            return False
    return isinstance(data, StallError)
