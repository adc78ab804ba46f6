"""Small flows for tests/test_run_states.py, run in a subprocess (`python -m tests.run_state_flows ...`).

    plain <seconds>          another team's flow: sleeps with Prefect's own heartbeats only
    watched <run> <seconds>  a flow with the run's Ray actors (engine + trainer, named as rl_train names
                             them), watched by CancellationWatcher, doing task work with retries
    fail                     a flow that raises (for the alert automation)

Each prints `FLOW_RUN_ID <id>` as soon as its run exists.
"""

from __future__ import annotations

import sys
import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from rollflow.flows.prefect_ops.cancellation import CancellationWatcher, current_flow_run_id, stop_actors


def announce() -> None:
    print(f"FLOW_RUN_ID {current_flow_run_id()}", flush=True)


@flow(name="test_plain_beat")
def plain(seconds: float) -> None:
    announce()
    time.sleep(seconds)


class Sleeper:
    def ping(self) -> str:
        return "pong"

    def work(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@task(name="actor-work", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=5)
def actor_work(run: str, seconds: float) -> float:
    import ray

    from rollflow.infra.workers import get_actor

    actor = get_actor(run, "engine")
    if actor is None:
        raise RuntimeError("no engine actor")
    return ray.get(actor.work.remote(seconds))


@flow(name="test_watched")
def watched(run: str, seconds: float) -> str:
    from rollflow.flows.config import RunConfig
    from rollflow.infra.workers import ensure_ray, start_actor

    cfg = RunConfig(run=run)
    ensure_ray(None, num_cpus=1)
    start_actor(run, "engine", Sleeper)
    start_actor(run, "trainer", Sleeper)
    with CancellationWatcher(current_flow_run_id(), lambda: stop_actors(cfg)) as watcher:
        try:
            announce()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                actor_work(run, 1.0)
        except BaseException:
            if watcher.cancelled:
                return watcher.cancelled_state()
            raise
        finally:
            if watcher.cancelled:
                stop_actors(cfg)
    stop_actors(cfg)
    return "done"


def live_actors(run: str, wait_s: float = 10.0) -> list[str]:
    """The run's named actors still registered in this process's Ray cluster (killed ones deregister
    within moments; waits up to `wait_s` for that)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        names = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"{run}:")
        )
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


@flow(name="test_fail")
def fail() -> None:
    announce()
    raise RuntimeError("forced failure")


def main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "plain":
        plain(float(rest[0]))
    elif kind == "watched":
        state = watched(rest[0], float(rest[1]), return_state=True)
        print(f"FINAL {state.type.value}", flush=True)
        print(f"ACTORS {live_actors(rest[0])}", flush=True)
    elif kind == "fail":
        fail(return_state=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
