"""At most one active flow run per rollflow run name: a Prefect global concurrency limit keyed on it.

Two runs of one name would share (and kill) each other's named Ray actors and interleave commits, so
the second waits `wait_s` for the name and then fails with a message. The slot is a Prefect lease
(renewed every RENEW_S while held, expiring LEASE_S after the holder stops renewing). Who holds it is
recorded in a Prefect variable, so a slot left by a dead holder is reclaimed at once instead of after
the lease expires: a holder process on this machine that no longer exists, or a holder flow run that is
already in a final state (Crashed included: the heartbeat automation marks killed runs). That is what
makes "kill -9, run the same command again" resume immediately.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional
from uuid import UUID

from rollflow.flows.prefect_ops.heartbeats import flow_heartbeats, keep_flow_signature

LEASE_S = 60.0  # Prefect's minimum lease
RENEW_S = 15.0


class RunBusy(RuntimeError):
    """Another flow run holds this rollflow run name."""


@dataclass(frozen=True)
class Holder:
    lease_id: str
    host: str
    pid: int
    flow_run_id: Optional[str]


def limit_name(run: str) -> str:
    return f"rollflow-run:{run}"


def _holder_variable(run: str) -> str:
    # variable names allow lowercase letters, digits, '-' and '_': a digest of the (case-sensitive) run name
    return "rollflow-run-holder-" + hashlib.sha256(run.encode()).hexdigest()[:20]


def ensure_limit(run: str) -> str:
    """The run name's limit (1 slot), created if missing; idempotent."""
    from prefect.client.orchestration import get_client

    name = limit_name(run)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit=1)
    return name


def _current_flow_run_id() -> Optional[str]:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def _try_acquire(client, name: str) -> Optional[UUID]:
    """A lease on the name's slot, or None when another holder has it (HTTP 423)."""
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[name], slots=1, mode="concurrency", lease_duration=LEASE_S
        )
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code == 423:
            return None
        raise
    return UUID(str(response.json()["lease_id"]))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead(client, holder: Holder) -> Optional[str]:
    """Why `holder` cannot be running any more, or None if it may be."""
    if holder.host == socket.gethostname() and holder.pid != os.getpid() and not _pid_alive(holder.pid):
        return f"its process {holder.pid} on {holder.host} is gone"
    if holder.flow_run_id:
        try:
            state = client.read_flow_run(UUID(holder.flow_run_id)).state
        except Exception:  # noqa: BLE001 - a deleted run holds nothing
            return f"its flow run {holder.flow_run_id} no longer exists"
        if state is not None and state.is_final():
            return f"its flow run {holder.flow_run_id} is {state.name}"
    return None


def _read_holder(run: str) -> Optional[Holder]:
    from prefect.variables import Variable

    value = Variable.get(_holder_variable(run), default=None)
    if not isinstance(value, dict):
        return None
    try:
        return Holder(**value)
    except TypeError:
        return None


def _renew_until(stop: threading.Event, lease_id: UUID) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not stop.wait(RENEW_S):
            try:
                client.renew_concurrency_lease(lease_id, LEASE_S)
            except Exception:  # noqa: BLE001 - a missed renewal is retried; the lease outlives two misses
                pass


@contextlib.contextmanager
def exclusive_run(run: str, wait_s: float = 5.0) -> Iterator[None]:
    """Hold the run name's slot for the block; RunBusy after `wait_s` if a live holder keeps it."""
    from prefect.client.orchestration import get_client
    from prefect.variables import Variable

    name = ensure_limit(run)
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            lease_id = _try_acquire(client, name)
            if lease_id is not None:
                break
            holder = _read_holder(run)
            why = _dead(client, holder) if holder is not None else None
            if holder is not None and why is not None:
                client.release_concurrency_slots_with_lease(UUID(holder.lease_id))  # reclaim, then try again
                continue
            if time.monotonic() > deadline:
                who = f" (flow run {holder.flow_run_id}, pid {holder.pid} on {holder.host})" if holder else ""
                raise RunBusy(
                    f"run {run!r} is active in another flow run{who}: wait for it to end, cancel it in the UI, "
                    f"or choose another run name (--set run=NAME); Prefect concurrency limit {name!r}"
                )
            time.sleep(1.0)
        holder = Holder(
            lease_id=str(lease_id), host=socket.gethostname(), pid=os.getpid(), flow_run_id=_current_flow_run_id()
        )
        Variable.set(_holder_variable(run), asdict(holder), overwrite=True)
        stop = threading.Event()
        renewer = threading.Thread(
            target=_renew_until, args=(stop, lease_id), daemon=True, name=f"rollflow-lease-{run}"
        )
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join(timeout=5)
            client.release_concurrency_slots_with_lease(lease_id)


def one_run_at_a_time(run_of: Callable[[Any], str] = lambda params: params.run):
    """Decorator for a flow function whose first argument is its parameter model (flows/params.py) or RunConfig:
    the body holds the slot of the run name `run_of` reads from it."""

    def wrap(fn):
        @functools.wraps(fn)
        def locked(params, *args, **kwargs):
            with exclusive_run(run_of(params)), flow_heartbeats():
                return fn(params, *args, **kwargs)

        return keep_flow_signature(locked, fn)

    return wrap
