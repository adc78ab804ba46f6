"""A local Ray start whose node misses Ray's fixed 30 s registration window (a saturated host: it failed a CI run's
resume drill) is started once more; any other failure, or a second timeout, is raised as it came."""

from __future__ import annotations

import pytest

# Ray's own words (ray/_private/node.py) when the raylet does not register in time
TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed to startup or "
    "the GCS has become overloaded."
)


class _RayStub:
    def __init__(self, failures: list[Exception]):
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        assert kwargs["address"] == "local"
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def stub(monkeypatch):
    import ray

    from rollflow.infra import workers

    def install(failures: list[Exception]) -> _RayStub:
        s = _RayStub(failures)
        for name in ("is_initialized", "init", "shutdown"):
            monkeypatch.setattr(ray, name, getattr(s, name))
        return s

    return install, workers.ensure_ray


def test_a_node_that_timed_out_during_startup_is_started_once_more(stub, caplog):
    install, ensure_ray = stub
    ray = install([Exception(TIMED_OUT)])
    ensure_ray(None, num_cpus=1)
    assert (ray.inits, ray.shutdowns) == (2, 1)
    assert "did not register in time" in caplog.text


def test_a_second_timeout_and_other_failures_are_raised(stub):
    install, ensure_ray = stub
    ray = install([Exception(TIMED_OUT), Exception(TIMED_OUT)])
    with pytest.raises(Exception, match="timed out during startup"):
        ensure_ray(None, num_cpus=1)
    assert ray.inits == 2
    ray = install([ValueError("num_cpus must be a non-negative integer")])
    with pytest.raises(ValueError, match="num_cpus"):
        ensure_ray(None, num_cpus=1)
    assert (ray.inits, ray.shutdowns) == (1, 0)
