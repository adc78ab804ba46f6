"""Heartbeats of every rollflow flow run, however it was started.

Crash detection (infra/automations.py) marks a rollflow flow run Crashed when no `rollflow.flow-run.heartbeat`
follows the last one within CRASH_AFTER_S (90 s). `flow_heartbeats()`, entered by each rollflow flow body, sends
that event every HEARTBEAT_S (30 s) from a daemon thread, whatever Prefect's own heartbeat setting is: a
Python-API user who imported prefect first gets Prefect's default (none on older Prefect, 180 s on 3.9), and
other teams' flows on a shared server keep theirs, never judged by rollflow's automation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import typing
from typing import Iterator

from rollflow.infra.automations import HEARTBEAT_EVENT, HEARTBEAT_S, prepare_flow_runs


@contextlib.contextmanager
def flow_heartbeats(interval_s: float = HEARTBEAT_S) -> Iterator[bool]:
    """Inside a flow run: rollflow heartbeats every `interval_s` until the block ends (yields whether it sends them:
    False outside a flow run)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx is not None else None
    if run is None:
        yield False
        return
    from prefect.events import emit_event
    from prefect.settings import get_current_settings

    # the automation that reads these beats, created once per process and API (the CLI does it at start)
    prepare_flow_runs(str(get_current_settings().api.url))
    resource = {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name}
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                emit_event(event=HEARTBEAT_EVENT, resource=resource)
            except Exception:  # noqa: BLE001 - a missed beat only delays crash detection
                logging.getLogger("rollflow.heartbeats").debug("heartbeat not sent", exc_info=True)
            if stop.wait(interval_s):
                return

    # in this context's copy: the API URL of a temporary settings context (tests, a second server) carries over
    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(beat,), daemon=True, name=f"rollflow-heartbeat-{run.id}"
    )
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join(timeout=5)


@contextlib.contextmanager
def without_prefect_heartbeats() -> Iterator[None]:
    """Flow runs started inside this block have no heartbeat thread of Prefect's own (rollflow's beats, above,
    are what crash detection reads). For sub-flows called once per iteration: a sync flow run joins Prefect's
    heartbeat thread at its end, and that thread sleeps in 1 s steps, so each short sub-flow run took ~0.9 s
    longer than with no thread (an empty sub-flow: ~1.15 s against ~0.25 s, Prefect 3.9, CPU)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def with_heartbeats(fn):
    """Decorator (under `@flow`) for a flow body that is not wrapped by `one_run_at_a_time` (sub-flows)."""

    @functools.wraps(fn)
    def beating(*args, **kwargs):
        with flow_heartbeats():
            return fn(*args, **kwargs)

    return keep_flow_signature(beating, fn)


def keep_flow_signature(wrapper, fn):
    """`wrapper` (a functools.wraps of `fn`) with `fn`'s resolved annotations and signature: Prefect builds a flow's
    parameter model from these, and `fn`'s postponed annotations resolve only in `fn`'s own module."""
    wrapper.__annotations__ = typing.get_type_hints(fn)
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return wrapper
