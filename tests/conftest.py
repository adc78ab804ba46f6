"""Shared fixtures: one real Prefect API and one local Ray per test session (both cost seconds)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid

import pytest

from rollflow.tasks.net import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Ray's log monitor re-globs its node's log folder every 0.1 s until that folder holds 1,000 files, and the folder
# grows by two files per actor: over a session-long local Ray that was 20-30 CPU-s per node on a 2-core box. With
# the threshold at 0 it looks for new files every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S, Ray's default); lines of files
# it already follows still go to the driver every 0.1 s. Every Ray node the tests start inherits this.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

PREFECT_OFFLINE = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}


# Seconds each of the longest files took in `make test`'s first stage on a 2-core box (4 xdist workers, summed test
# durations, 2026-12-06). Longest first: a long file that starts last runs alone at the end while the other workers
# idle. A file not listed is ordered by its number of `slow` tests, after these.
MEASURED_FILE_SECONDS = {
    "tests/test_run_states.py": 462,
    "tests/test_watchdog.py": 397,
    "tests/test_deployments.py": 368,
    "tests/test_megatron_flow.py": 325,
    "tests/test_resume_drill.py": 276,
    "tests/test_deployment_forms.py": 217,
    "tests/test_sglang_ray.py": 209,
    "tests/test_fault_drills.py": 200,
    "tests/test_group_placement.py": 184,
    "tests/test_stage_replay.py": 155,
    "tests/test_tracking.py": 147,
    "tests/test_moe.py": 137,
    "tests/test_checkpoint_commit.py": 136,
    "tests/test_repro_gate.py": 130,
    "tests/test_debug_flows.py": 122,
    "tests/test_async_pipeline.py": 104,
    "tests/test_critic.py": 91,
    "tests/test_sync_probe.py": 87,
    "tests/test_megatron_parallel.py": 75,
    "tests/test_lora.py": 74,
}


def pytest_collection_modifyitems(config, items):
    """The longest files first (MEASURED_FILE_SECONDS), then files with the most `slow` (end-to-end) tests, the rest
    in their usual order. `make test` hands whole files to pytest-xdist workers in this order (with
    --no-loadscope-reorder: by default xdist re-sorts files by their number of tests)."""
    slow: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)

    def order(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return -MEASURED_FILE_SECONDS.get(path, 0), -slow[path]

    items.sort(key=order)  # stable: order within a file is kept


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_between_modules():
    """In-process Megatron backends join a one-process torch.distributed group (and Megatron's groups) in the
    pytest process; tear them down after each module so later modules start clean (tests/test_train_dp.py
    checks that nothing is initialised before its ranks join)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (temporary server + database) for the whole session; yields its URL."""
    import httpx
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    attempts = 3
    for attempt in range(attempts):
        harness = prefect_test_harness(server_startup_timeout=120)
        try:
            harness.__enter__()
        except httpx.TimeoutException:
            # The server answered its first health check after httpx's default 5 s read timeout (a loaded box):
            # Prefect's harness raises instead of asking again and leaves that server running. Stop it, start anew.
            leftover = SubprocessASGIServer._instances.pop(None, None)
            if leftover is not None:
                leftover.stop()
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield PREFECT_API_URL.value()
        finally:
            harness.__exit__(None, None, None)
        return


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` in a subprocess (its own PREFECT_HOME and database, a free loopback port) for the
    session: what deployments, workers and automations need. Yields the API URL; stopped by pid. Tests set
    it as their current API themselves (temporary_settings / env), so it never leaks into other tests."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    def healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback
                return resp.status == 200
        except OSError:
            return False

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port("127.0.0.1")
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **PREFECT_OFFLINE, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not healthy(api + "/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield api
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


# Dummy credentials for the loopback S3 endpoint. The secret is distinctive so tests can assert it
# never shows up in messages, logs or artifacts.
TEST_AWS_KEY_ID = "ROLLFLOWTESTKEYID0001"
TEST_AWS_SECRET = "rollflow-test-SECRET-never-log-this-0123456789"
TEST_BUCKET = "rollflow-test"


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    url: str
    bucket: str

    def root(self, name: str = "root") -> str:
        """A fresh `s3://` root (a unique prefix in the test bucket)."""
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:10]}"


def _create_bucket(endpoint: str, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.call_s3("create_bucket", Bucket=bucket)


def _s3_available() -> bool:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session", autouse=True)
def _loopback_s3_environment():
    """A real S3 endpoint on loopback for the whole session: CI's (ROLLFLOW_TEST_S3_ENDPOINT) or a
    moto server started here (~1 s). Autouse, so the standard AWS variables (dummy credentials,
    AWS_ENDPOINT_URL) are set before anything starts Ray workers or CLI subprocesses, which inherit
    them - and so no test can ever reach real AWS. Yields None when moto/s3fs are not installed.
    """
    if not _s3_available():
        yield None
        return
    server = None
    endpoint = os.environ.get("ROLLFLOW_TEST_S3_ENDPOINT")
    if not endpoint:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    names = (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
        "AWS_EC2_METADATA_DISABLED",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL_S3",
    )
    saved = {name: os.environ.get(name) for name in names}
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": TEST_AWS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": TEST_AWS_SECRET,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    try:
        _create_bucket(endpoint, TEST_BUCKET)
        yield S3Endpoint(url=endpoint, bucket=TEST_BUCKET)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(_loopback_s3_environment):
    """The loopback S3 endpoint (url, bucket; `.root()` gives a fresh s3:// root)."""
    if _loopback_s3_environment is None:
        pytest.skip("moto[server] and s3fs are needed for the s3:// tests (pip install -e '.[dev]')")
    return _loopback_s3_environment


@pytest.fixture(params=["file", "s3"])
def any_root(request, tmp_path):
    """An artifact root URL: file:// under tmp_path, or a fresh prefix on the loopback S3 endpoint."""
    if request.param == "file":
        return f"file://{tmp_path}/root"
    return request.getfixturevalue("s3_endpoint").root()


@pytest.fixture(scope="session")
def ray_local(_loopback_s3_environment):
    """The session's local Ray cluster; yields its GCS address, for child processes (`rollflow train`) that join it."""
    # After the S3 environment: Ray's workers inherit the environment at ray.init.
    import ray

    from rollflow.infra.workers import ensure_ray

    # fake_gpu: a custom resource standing in for GPUs in the placement tests (tests/test_placement.py);
    # num_gpus=4: Ray-only GPUs (ids 0-3, no CUDA behind them) for the bundle -> GPU id mapping tests
    ensure_ray(None, num_cpus=2, num_gpus=4, resources={"fake_gpu": 8})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def small_config(root, run: str = "t", **overrides):
    """A RunConfig sized for tests: 32 prompts x 4 samples, one optimizer step per rollout."""
    from rollflow.flows.config import RunConfig

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


@contextlib.contextmanager
def watching_syncs(observe):
    """rl_iteration's sync task with `observe(cfg, result)` called after each sync, in the flow's process (where
    the actors can still be asked what they hold); the task is restored afterwards."""
    import rollflow.flows.iteration as iteration

    original = iteration.sync_task.fn

    def spy(cfg, weight_version):
        out = original(cfg, weight_version)
        observe(cfg, out)
        return out

    iteration.sync_task.fn = spy
    try:
        yield
    finally:
        iteration.sync_task.fn = original
