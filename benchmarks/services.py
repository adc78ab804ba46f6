"""Loopback services the CPU suites need: a Prefect server, a moto S3 endpoint and a local Ray.

Each is started on first use, on a free port, with its state under the run's work folder (so a
developer's own `~/.prefect` database or `rollflow server` is never touched), and stopped at the end.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolate_env(workdir: Path) -> None:
    """Environment for Prefect / Ray / boto in this process and its children; call before importing them."""
    os.environ["ROLLFLOW_HOME"] = str(workdir / "rollflow-home")  # pid files of rollflow.infra.local_stack
    os.environ["PREFECT_HOME"] = str(workdir / "prefect-home")
    port = free_port()
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    os.environ["BENCH_PREFECT_PORT"] = str(port)
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ[key] = value


class Services:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.prefect_api: Optional[str] = None
        self.prefect_start_s: Optional[float] = None
        self.s3: Optional[dict[str, Any]] = None
        self._moto = None
        self.ray_started = False
        self.ray_start_s: Optional[float] = None

    # -- Prefect

    def prefect(self) -> str:
        if self.prefect_api is None:
            from rollflow.infra.local_stack import start_prefect

            start = time.perf_counter()
            self.prefect_api = start_prefect(int(os.environ["BENCH_PREFECT_PORT"]), timeout=120)
            self.prefect_start_s = time.perf_counter() - start
        return self.prefect_api

    # -- S3 (moto, in a thread of this process)

    def s3_options(self) -> dict[str, Any]:
        """storage_options for s3fs against a loopback moto endpoint with one bucket, `bench`."""
        if self.s3 is None:
            from moto.server import ThreadedMotoServer

            port = free_port()
            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self._moto.start()
            endpoint = f"http://127.0.0.1:{port}"
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
            # No region_name in client_kwargs: s3fs then fails mkdir with a location constraint.
            self.s3 = {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint},
                "skip_instance_cache": True,
            }
        return self.s3

    # -- Ray

    def ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        from rollflow.infra.workers import ensure_ray

        start = time.perf_counter()
        ensure_ray(None, num_cpus=os.cpu_count() or 2)
        self.ray_started = True
        self.ray_start_s = time.perf_counter() - start

    def close(self) -> None:
        if self.ray_started:
            import ray

            ray.shutdown()
            self.ray_started = False
        if self._moto is not None:
            self._moto.stop()
            self._moto = None
        if self.prefect_api is not None:
            from rollflow.infra.local_stack import stop

            stop("prefect")
            self.prefect_api = None
