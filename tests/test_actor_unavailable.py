"""An actor whose connection drops mid-call (its process killed while it may restart: what a killed raylet looks
like to the driver) fails the awaited call with one error naming the actor and its node, not just Ray's actor id."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from rollflow.infra import clients
from rollflow.infra.workers import NAMESPACE

pytestmark = pytest.mark.timeout(180)


def test_a_dropped_actor_mid_call_is_reported_with_its_name_and_node(ray_local):
    import ray

    @ray.remote(max_restarts=1, num_cpus=0)
    class Sleeper:
        def pid(self) -> int:
            return os.getpid()

        def slow(self) -> int:
            time.sleep(60)
            return 1

    actor = Sleeper.options(name="unavail:engine", namespace=NAMESPACE).remote()
    try:
        pid = ray.get(actor.pid.remote())
        ref = actor.slow.remote()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(clients.ActorUnavailable) as info:
            clients.Pending(ref).result()
        err = info.value
        node_id = ray.get_runtime_context().get_node_id()
        assert err.actor == "unavail:engine"
        assert node_id in str(err) and "on node " in str(err), str(err)
        assert isinstance(err.__cause__, ray.exceptions.ActorUnavailableError)  # Ray's own error kept as the cause
        again = pickle.loads(pickle.dumps(err))  # Prefect stores task exceptions pickled
        assert str(again) == str(err)
    finally:
        ray.kill(actor, no_restart=True)


def test_other_actor_errors_pass_through_unchanged(ray_local):
    import ray

    @ray.remote(num_cpus=0)
    class Failing:
        def boom(self) -> None:
            raise ValueError("boom")

    actor = Failing.remote()
    with pytest.raises(ValueError, match="boom"):
        clients.Pending(actor.boom.remote()).result()
    ray.kill(actor)
