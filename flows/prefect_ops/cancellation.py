"""UI cancellation of flow runs that no runner watches (a CLI call of `rl_train`), and actor cleanup hooks.

Prefect's Cancel button sets the run `Cancelling` and relies on the runner or worker that started the
process to kill it; a flow called directly from `rollflow train` has neither, so the run would stay
`Cancelling`. `CancellationWatcher` closes the gap from inside the flow:

- a daemon thread reads the flow run's state every `poll_s` (2 s);
- on `Cancelling` it calls `on_cancel` (stop the run's Ray actors by name), interrupts the flow's
  thread with `RunCancelled` (a signal on the main thread, so a sleeping task retry wakes up too),
  and keeps stopping actors until the flow has ended (a task retry that restarted one is undone);
- `actors_running` swallows `RunCancelled` (or whatever the dead actors raised) once the run is
  cancelled, and the flow returns `watcher.cancelled_state()`, a Prefect `Cancelled` state, so the run
  (and its unfinished sub-flow runs) end `Cancelled`. The actors are stopped when the block ends, however.

    with actors_running(group.stop_all) as watcher:
        ...flow body...
    if watcher.cancelled:
        return watcher.cancelled_state()
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional
from uuid import UUID

from rollflow.flows.config import RunConfig
from rollflow.flows.group import WorkerGroup, connect_ray

logger = logging.getLogger("rollflow.cancellation")

POLL_S = 2.0
INTERRUPT_SIGNAL = signal.SIGUSR1


class RunCancelled(BaseException):
    """Raised in the flow's thread when its run was cancelled (UI / API). A BaseException, so task
    retries and `except Exception` blocks let it through."""


def stop_actors(cfg: Any) -> None:
    """Stop the run's actors and release its placement group."""
    WorkerGroup.for_run(cfg).stop_all()


def stop_actors_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """`on_failure` / `on_crashed` / `on_cancellation` hook of flows whose `cfg` parameter is a RunConfig:
    stop the run's actors and release its placement (a failed run must not hold GPUs)."""
    from pydantic import BaseModel

    params = getattr(flow_run, "parameters", None) or {}
    # `cfg` (the flows) or `params` (a deployment's parameter model: RunConfig sections)
    value = params.get("cfg", params.get("params"))
    if value is None:
        return
    try:
        import ray

        cfg = (
            value
            if isinstance(value, RunConfig)
            else RunConfig.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
        )
        if not ray.is_initialized() and not cfg.ray.address:
            return  # no local Ray in this process: the run started no actors here
        connect_ray(cfg)
        stop_actors(cfg)
    except Exception:  # noqa: BLE001 - a hook must not mask the run's own state
        logger.warning("could not stop the actors of flow run %s", getattr(flow_run, "id", "?"), exc_info=True)


@contextlib.contextmanager
def actors_running(
    stop: Callable[[], None], cleanup: Optional[Callable[[], None]] = None
) -> Iterator["CancellationWatcher"]:
    """The `with` block of a flow that runs actors: a UI cancel calls `stop` (and interrupts the block), which
    then ends without an error, leaving `watcher.cancelled` set for the flow to return `cancelled_state()`;
    any other error propagates. However the block ends, `cleanup` (default: `stop`) stops the actors."""
    watcher = CancellationWatcher(current_flow_run_id(), stop).start()
    try:
        yield watcher
    except BaseException:
        if not watcher.cancelled:
            raise
    finally:
        watcher.stop()
        (cleanup or stop)()


def current_flow_run_id() -> Optional[UUID]:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None


def _async_raise(thread_id: int, exc_type: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))


class CancellationWatcher:
    def __init__(
        self,
        flow_run_id: UUID | str | None,
        on_cancel: Callable[[], None],
        *,
        poll_s: float = POLL_S,
        interrupt: bool = True,
    ):
        self.flow_run_id = flow_run_id
        self.on_cancel = on_cancel
        self.poll_s = poll_s
        self.interrupt = interrupt
        self._cancelled = threading.Event()
        self._stop = threading.Event()
        self._armed = False  # the interrupt may be delivered (between start and stop)
        self._delivered = False
        self._thread: threading.Thread | None = None
        self._target: threading.Thread | None = None
        self._old_handler: Any = None
        self.detected_at: float | None = None  # wall-clock time (epoch s) the cancel was seen

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "CancellationWatcher":
        if self.flow_run_id is None:
            return self  # not inside a flow run: nothing to watch
        self._target = threading.current_thread()
        if self.interrupt and self._target is threading.main_thread():
            self._old_handler = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
        self._armed = True
        self._thread = threading.Thread(target=self._loop, name=f"rollflow-cancel-{self.flow_run_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._armed = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._old_handler is not None:
            signal.signal(INTERRUPT_SIGNAL, self._old_handler)
            self._old_handler = None

    def __enter__(self) -> "CancellationWatcher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the watching thread ---------------------------------------------------------------------------
    def _read_state(self, client: Any):
        return client.read_flow_run(self.flow_run_id).state

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                while not self._stop.wait(self.poll_s):
                    try:
                        state = self._read_state(client)
                    except Exception:  # noqa: BLE001 - API blip: try again next poll
                        logger.debug("reading flow run %s failed", self.flow_run_id, exc_info=True)
                        continue
                    if state is not None and (state.is_cancelling() or state.is_cancelled()):
                        self._trigger()
                        break
        except Exception:  # noqa: BLE001
            logger.warning("cancellation watcher of flow run %s stopped", self.flow_run_id, exc_info=True)
            return
        # Cancelled: keep the run's actors down until the flow has ended (a task retry may restart one),
        # and interrupt again: a RunCancelled raised inside library code that swallows BaseException
        # (Prefect's own handlers, logging) is lost; the flow's `except` stops the watcher.
        while not self._stop.wait(1.0):
            self._call_on_cancel()
            self._interrupt()

    def _call_on_cancel(self) -> None:
        try:
            self.on_cancel()
        except Exception:  # noqa: BLE001
            logger.warning("stopping actors of cancelled flow run %s failed", self.flow_run_id, exc_info=True)

    def _trigger(self) -> None:
        self.detected_at = time.time()
        self._cancelled.set()
        logger.warning("flow run %s is cancelling: stopping its actors", self.flow_run_id)
        self._interrupt()  # first, so the flow does not start new work on the actors being stopped
        self._call_on_cancel()

    def _interrupt(self) -> None:
        if not (self.interrupt and self._armed) or self._target is None:
            return
        if self._old_handler is not None:
            signal.pthread_kill(self._target.ident, INTERRUPT_SIGNAL)  # wakes sleeps too
        elif self._target.ident is not None:
            _async_raise(self._target.ident, RunCancelled)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._armed and self._cancelled.is_set():
            self._delivered = True
            raise RunCancelled(f"flow run {self.flow_run_id} was cancelled")

    # -- the flow's end -------------------------------------------------------------------------------
    def cancelled_state(self, message: str | None = None):
        """The flow's return value after a cancellation: a `Cancelled` state. Unfinished or interrupted
        sub-flow runs of this run are marked Cancelled too (they were stopped with it)."""
        from prefect.states import Cancelled

        self.stop()
        message = message or "Cancelled: the run's actors were stopped"
        self._cancel_children(message)
        return Cancelled(message=message)

    def _cancel_children(self, message: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        if self.flow_run_id is None:
            return
        try:
            with get_client(sync_client=True) as client:
                children = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(str(self.flow_run_id))])
                    )
                )
                since = (self.detected_at or time.time()) - self.poll_s - 1.0
                for run in children:
                    state = run.state
                    if state is None:
                        continue
                    unfinished = state.type in (StateType.RUNNING, StateType.CANCELLING, StateType.PENDING)
                    # interrupted by the cancel (not a failure of their own before it)
                    interrupted = (
                        state.type in (StateType.CRASHED, StateType.FAILED)
                        and state.timestamp is not None
                        and state.timestamp.timestamp() >= since
                    )
                    if unfinished or interrupted:
                        client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
        except Exception:  # noqa: BLE001 - the parent's state is what matters
            logger.warning("could not mark the sub-flow runs of %s cancelled", self.flow_run_id, exc_info=True)
