"""Shared fixtures: one real Prefect API and one local Ray per test session (both cost seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (temporary server + database) for the whole session; yields its URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from infra.workers import ensure_ray

    ensure_ray(None, num_cpus=2)
    yield
    ray.shutdown()


def small_config(root, run: str = "t", **overrides):
    """A RunConfig sized for tests: 32 prompts x 4 samples, one optimizer step per rollout."""
    from flows.config import RunConfig

    data = {
        "run": run,
        "iterations": 2,
        "store": {"root": str(root)},
        "data": {"prompts_per_rollout": 32, "eval_prompts": 32},
        "rollout": {"n_samples_per_prompt": 4},
        "train": {"num_steps_per_rollout": 1, "micro_batch_size": 64},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RunConfig.model_validate(data)
