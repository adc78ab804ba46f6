"""The run's worker group: engine and trainer as long-lived, named Ray actors.

Prefect tasks stay thin and stateless: they look the actors up by run name and call methods,
passing artifact references, never tensors (weights go actor -> actor through the object store).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

NAMESPACE = "rollflow"
# Every actor has a small "control" concurrency group next to its serial default group, so ping,
# abort and describe answer while a long rollout or train step runs.
CONTROL = "control"
CONTROL_THREADS = 2


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               resources: dict[str, float] | None = None, num_gpus: int | None = None) -> None:
    """Join `address`, or start a local Ray (with custom `resources`, e.g. fake GPUs in tests).
    Never silently joins a stale cluster."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=True, resources=resources)


def actor_name(run: str, role: str) -> str:
    return f"{run}:{role}"


@dataclasses.dataclass
class Handle:
    """A Ray actor, called synchronously; `submit` returns an ObjectRef another actor can take."""

    actor: Any

    def call(self, method: str, *args, **kwargs):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args, **kwargs))

    def submit(self, method: str, *args, **kwargs):
        return getattr(self.actor, method).remote(*args, **kwargs)

    def control(self, method: str, *args, timeout: float | None = 60.0, **kwargs):
        """Call `method` in the actor's control group: it runs even while the default group is busy."""
        import ray

        ref = getattr(self.actor, method).options(concurrency_group=CONTROL).remote(*args, **kwargs)
        return ray.get(ref, timeout=timeout)

    def alive(self) -> bool:
        try:
            return bool(self.control("ping"))
        except Exception:  # noqa: BLE001 - any failure means "not usable"
            return False


def get_actor(run: str, role: str) -> Handle | None:
    import ray

    try:
        return Handle(ray.get_actor(actor_name(run, role), namespace=NAMESPACE))
    except ValueError:
        return None


def start_actor(run_name: str, role: str, cls: type, *args, options: dict[str, Any] | None = None,
                wait: bool = True, **kwargs) -> Handle:
    """Start the named actor of `role` for `run`, replacing a leftover one (a fresh start is a restart).

    `options`: extra Ray `.options(...)` (a placement group bundle and its GPU share, from
    `rollflow.infra.placement.actor_options`); they override the defaults below. `wait=False` returns before
    the constructor has run (start several, then `ray.get` their pings).
    """
    import ray

    stale = get_actor(run_name, role)
    if stale is not None:
        ray.kill(stale.actor, no_restart=True)
    remote_cls = ray.remote(concurrency_groups={CONTROL: CONTROL_THREADS})(cls).options(
        name=actor_name(run_name, role), namespace=NAMESPACE,
        # Detached: the actor outlives the task that (re)started it; flows stop it explicitly.
        lifetime="detached",
        # Scheduling must not wait for CPUs the driver and the other actor also use; threads are
        # fixed inside the worker instead.
        **({"num_cpus": 0, "max_concurrency": 1} | dict(options or {})),
    )
    handle = Handle(remote_cls.remote(*args, **kwargs))
    if wait:
        handle.call("ping")  # surface constructor errors here, with their traceback
    return handle


def stop_actor(run: str, role: str) -> None:
    import ray

    handle = get_actor(run, role)
    if handle is not None:
        ray.kill(handle.actor, no_restart=True)
