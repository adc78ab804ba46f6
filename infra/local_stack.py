"""The local stack: a Prefect server (and, for tests and demos, an S3 endpoint) on loopback.

Each service runs as a background process with a pid file under `~/.rollflow/`, so `rollflow
server stop` and CI can stop what they started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STATE_DIR = Path(os.environ.get("ROLLFLOW_HOME", Path.home() / ".rollflow"))
OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URL we built
            return resp.status == 200
    except OSError:
        return False


def _pid_file(name: str) -> Path:
    return STATE_DIR / f"{name}.pid"


def _spawn(name: str, argv: list[str], env: dict[str, str]) -> int:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log = open(STATE_DIR / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )
    _pid_file(name).write_text(str(proc.pid))
    return proc.pid


def _wait(url: str, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if healthy(url):
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"{name} did not become healthy at {url} within {timeout:.0f}s; see {STATE_DIR / (name + '.log')}"
    )


def prefect_api_url(port: int = 4200) -> str:
    return f"http://127.0.0.1:{port}/api"


def start_prefect(port: int = 4200, timeout: float = 90.0) -> str:
    """Start (or reuse) a Prefect server on 127.0.0.1:port; returns its API URL."""
    api = prefect_api_url(port)
    if healthy(api + "/health"):
        return api
    if not port_free("127.0.0.1", port):
        raise RuntimeError(f"port {port} is taken by something that is not a Prefect server; pass another --port")
    prefect = Path(sys.executable).with_name("prefect")
    argv = [
        str(prefect) if prefect.exists() else "prefect",
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    # the browser app asks PREFECT_UI_API_URL (default port 4200): point it at this server's port
    _spawn("prefect", argv, {**OFFLINE_ENV, "PREFECT_UI_API_URL": api})
    _wait(api + "/health", timeout, "prefect")
    return api


def start_s3(port: int = 5555, timeout: float = 30.0) -> str:
    """Start (or reuse) a moto S3 server on 127.0.0.1:port; returns its endpoint URL."""
    endpoint = f"http://127.0.0.1:{port}"
    if healthy(endpoint + "/moto-api/"):
        return endpoint
    moto = Path(sys.executable).with_name("moto_server")
    argv = [str(moto) if moto.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)]
    _spawn("s3", argv, {})
    _wait(endpoint + "/moto-api/", timeout, "s3")
    return endpoint


def stop(name: str) -> bool:
    """Stop a service started by this module; False if it was not running."""
    pid_file = _pid_file(name)
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text())
    pid_file.unlink()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m rollflow.infra.local_stack start|stop prefect|s3` (used by .ci/run and the Makefile)."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] not in ("start", "stop") or args[1] not in ("prefect", "s3"):
        print("usage: python -m rollflow.infra.local_stack start|stop prefect|s3", file=sys.stderr)
        return 2
    action, name = args
    if action == "start":
        print(start_prefect() if name == "prefect" else start_s3())
    else:
        print("stopped" if stop(name) else "not running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
