"""The run's worker group: engine and trainer as long-lived, named Ray actors.

Prefect tasks stay thin and stateless: they look the actors up by run name and call their operations
through the typed clients of `rollflow.infra.clients`, passing artifact references, never tensors
(weights go actor -> actor through the object store). This module starts, finds and stops actors.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

NAMESPACE = "rollflow"
# A local Ray start that times out registering its node (a saturated host) is tried once more.
LOCAL_START_ATTEMPTS = 2
# Every actor has a small "control" concurrency group next to its serial default group, so ping,
# abort and describe answer while a long rollout or train step runs.
CONTROL = "control"
CONTROL_THREADS = 2


def ensure_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    num_gpus: int | None = None,
) -> None:
    """Join `address`, or start a local Ray (with custom `resources`, e.g. fake GPUs in tests).
    Never silently joins a stale cluster."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=True,
                resources=resources,
            )
            return
        except Exception as exc:
            # Ray gives a new local node a fixed 30 s to register its raylet (not configurable); on a host whose
            # CPUs are saturated that can pass. The half-started node is shut down and started once more.
            if "timed out during startup" not in str(exc) or attempt == LOCAL_START_ATTEMPTS:
                raise
            logger.warning("local Ray node did not register in time (a loaded host?): starting it again")
            ray.shutdown()


def actor_name(run: str, role: str) -> str:
    return f"{run}:{role}"


def get_actor(run: str, role: str) -> Any | None:
    """The Ray actor handle of `role` in `run`, or None when there is none."""
    import ray

    try:
        return ray.get_actor(actor_name(run, role), namespace=NAMESPACE)
    except ValueError:
        return None


def start_actor(
    run_name: str, role: str, cls: type, *args, options: dict[str, Any] | None = None, wait: bool = True, **kwargs
) -> Any:
    """Start the named actor of `role` for `run`, replacing a leftover one (a fresh start is a restart).

    `options`: extra Ray `.options(...)` (a placement group bundle and its GPU share, from
    `rollflow.infra.placement.actor_options`); they override the defaults below. `wait=False` returns before
    the constructor has run (start several, then wait for them together: the clients' `wait_started`).
    Returns the Ray actor handle (wrap it in its client, `rollflow.infra.clients`).
    """
    import ray

    stale = get_actor(run_name, role)
    if stale is not None:
        ray.kill(stale, no_restart=True)
    remote_cls = ray.remote(concurrency_groups={CONTROL: CONTROL_THREADS})(cls).options(
        name=actor_name(run_name, role),
        namespace=NAMESPACE,
        # Detached: the actor outlives the task that (re)started it; flows stop it explicitly.
        lifetime="detached",
        # Scheduling must not wait for CPUs the driver and the other actor also use; threads are
        # fixed inside the worker instead.
        **({"num_cpus": 0, "max_concurrency": 1} | dict(options or {})),
    )
    actor = remote_cls.remote(*args, **kwargs)
    _STARTED.add(actor_name(run_name, role))
    if wait:
        strategy = (options or {}).get("scheduling_strategy")
        _wait_placed(run_name, role, actor, getattr(strategy, "placement_group", None))
        ray.get(actor.ping.remote())  # surface constructor errors here, with their traceback
    return actor


# How long an actor may wait for its placement group bundle to be (re)placed: a bundle whose node was lost is
# rescheduled by Ray, and with no alive node that has room the actor would wait for it forever.
PLACEMENT_WAIT_S = 30.0


class ActorUnplaceable(RuntimeError):
    """An actor's placement group bundle has no node: the node holding it was lost and no alive node has room."""


def _wait_placed(run: str, role: str, actor: Any, pg: Any) -> None:
    """Return once `actor` runs (its ping answers) or its placement group is placed; raise `ActorUnplaceable`
    naming the lost node(s) when the group stays unplaced for `PLACEMENT_WAIT_S`."""
    import time

    import ray

    if pg is None:
        return
    ping = actor.ping.remote()
    unplaced_since: float | None = None
    while not ray.wait([ping], timeout=2.0)[0]:
        if pg.wait(timeout_seconds=1):
            unplaced_since = None
            continue
        unplaced_since = unplaced_since or time.monotonic()
        if time.monotonic() - unplaced_since < PLACEMENT_WAIT_S:
            continue
        ray.kill(actor, no_restart=True)
        _STARTED.discard(actor_name(run, role))
        nodes = ray.nodes()
        lost = [f"{n.get('NodeManagerAddress', '?')} ({n.get('NodeID', '?')})" for n in nodes if not n.get("Alive")]
        alive = [n.get("NodeManagerAddress", "?") for n in nodes if n.get("Alive")]
        raise ActorUnplaceable(
            f"the {role} actor of run {run!r} cannot be started: its placement group is not placed after "
            f"{PLACEMENT_WAIT_S:.0f}s, no alive node ({', '.join(alive) or 'none'}) has room for its bundle; "
            f"lost node(s): {', '.join(lost) or 'none known'}. Bring a node back (`ray start --address=<head>`) "
            "and retry the run: it resumes from its last committed checkpoint"
        )


# Actors this process started and has not stopped: one of them missing later means it died.
_STARTED: set[str] = set()


class WorkerDied(RuntimeError):
    """An actor this process started is gone: its worker process exited (crash, OOM kill, node lost)."""


def missing_actor_error(run: str, role: str) -> RuntimeError:
    """The error for an actor that is not running: `WorkerDied` when this process started it, else 'start it'."""
    if actor_name(run, role) in _STARTED:
        return WorkerDied(
            f"the {role} actor of run {run!r} died during the run (its Ray worker process exited: a crash, an "
            "out-of-memory kill or a lost node; its log is under the Ray session's logs, e.g. "
            "/tmp/ray/session_latest/logs); committed rollouts and checkpoints are kept: run the same command "
            "again to resume"
        )
    return RuntimeError(f"no {role} actor for run {run!r}: start the run's workers first (rl_train does)")


def stop_actor(run: str, role: str) -> None:
    import ray

    _STARTED.discard(actor_name(run, role))
    actor = get_actor(run, role)
    if actor is not None:
        ray.kill(actor, no_restart=True)
