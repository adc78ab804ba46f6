"""Processes the test cluster starts and stops (infra/cluster.py): run a command, wait for a service, stop a
process we started by its pid with its process group and descendants (never by name)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


class ClusterError(RuntimeError):
    """The cluster could not be brought up (the message names the service and its log)."""


def sh(*argv: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): {why}")
    return proc.stdout


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own addresses
            return resp.status == 200
    except OSError:
        return False


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def wait_until(check, what: str, timeout: float, log: Path | None = None, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if pid is not None and not alive(pid):
            break
        time.sleep(0.3)
    tail = ""
    if log is not None and log.exists():
        tail = "; last log lines: " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
    state = "exited" if pid is not None and not alive(pid) else f"not ready after {timeout:.0f}s"
    raise ClusterError(f"{what} {state} (log {log}){tail}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        return []


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM a process we started, its process group and its descendants; SIGKILL what is left after `grace`."""
    targets = [pid, *descendants(pid)]
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    for p in targets:
        try:
            os.kill(p, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in targets):
        time.sleep(0.2)
    for p in targets:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:  # reap it if it is our child
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
