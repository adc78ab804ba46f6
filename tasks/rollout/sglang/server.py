"""Launch, watch and stop one SGLang server (`python -m sglang.launch_server ...`) on loopback.

`launch_command` is a pure function of the settings (unit-tested against SGLang's flag list);
`SGLangServer` runs it as a subprocess in its own process group with its output in a log file, waits
for `/health`, notices when it died (`poll`) and reports the last log lines, and stops it with
SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollflow.tasks import net
from rollflow.tasks.rollout.sglang.flags import args_to_argv

LOOPBACK = "127.0.0.1"
INSTALL_HINT = (
    "rollout.engine='sglang' needs SGLang on a GPU machine: pip install 'rollflow[sglang]' "
    "(or set rollout.sglang.urls to servers that are already running)"
)


class SGLangNotInstalled(NotImplementedError):
    """SGLang is not importable here (a NotImplementedError, as for any engine this build cannot run)."""


class EngineDiedError(RuntimeError):
    """The SGLang server process is gone; the message carries its exit code and last log lines."""

    def __init__(self, message: str, *, returncode: int | None = None, log_tail: Sequence[str] = ()):
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = list(log_tail)


class EngineStartError(RuntimeError):
    pass


def free_port(host: str = LOOPBACK) -> int:
    return net.free_port(host)


def require_sglang(python: str | None = None) -> None:
    """Raise the install hint unless `python` (default: this interpreter) can import sglang."""
    if python in (None, sys.executable):
        if importlib.util.find_spec("sglang") is None:
            raise SGLangNotInstalled(INSTALL_HINT)
        return
    probe = subprocess.run(
        [python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('sglang') is None)"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        raise SGLangNotInstalled(f"{INSTALL_HINT} ({python} has no sglang)")


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What one engine's server is launched with (everything `launch_command` needs)."""

    model_path: str
    port: int
    tp_size: int = 1
    host: str = LOOPBACK
    mem_fraction_static: float | None = None
    dtype: str | None = None
    skip_tokenizer_init: bool = True
    enable_memory_saver: bool = False
    base_gpu_id: int | None = None
    weight_version: int | None = None
    lora_max_rank: int | None = None  # set: --enable-lora with this rank and lora_target_modules
    lora_target_modules: Sequence[str] = ()
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # validated passthrough flags
    launcher: Sequence[str] = ()  # replaces [python, -m, sglang.launch_server]
    python: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def uses_sglang(self) -> bool:
        return not self.launcher


DTYPE_TO_SGLANG = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "auto": "auto"}


def launch_command(spec: LaunchSpec) -> list[str]:
    """The server's argv: program, rollflow-managed flags, then the validated passthrough flags."""
    python = spec.python or sys.executable
    if spec.launcher:
        cmd = [part.replace("{python}", python) for part in spec.launcher]
    else:
        cmd = [python, "-m", "sglang.launch_server"]
    cmd += [
        "--model-path",
        str(spec.model_path),
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tp_size),
    ]
    if spec.dtype is not None:
        if spec.dtype not in DTYPE_TO_SGLANG:
            raise ValueError(f"dtype {spec.dtype!r} is not an SGLang --dtype; use one of {sorted(DTYPE_TO_SGLANG)}")
        cmd += ["--dtype", DTYPE_TO_SGLANG[spec.dtype]]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", f"{spec.mem_fraction_static:g}"]
    if spec.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(spec.base_gpu_id)]
    if spec.weight_version is not None:
        cmd += ["--weight-version", str(spec.weight_version)]
    if spec.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if spec.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.lora_max_rank is not None:
        if not spec.lora_target_modules:
            # SGLang asserts both when no --lora-paths preloads an adapter (lora_hook.check_lora_server_args)
            raise ValueError("--enable-lora without --lora-paths needs --lora-target-modules")
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.lora_max_rank), "--lora-target-modules"]
        cmd += list(spec.lora_target_modules)
    cmd += args_to_argv(spec.args)
    return cmd


def _load_prctl():
    try:  # resolved here, in the parent: the child must not import anything between fork and exec
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()  # own process group: stop() signals the server and every process it spawned
    if _PRCTL is not None:  # the server gets SIGTERM when the process that launched it dies
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


_LIVE: "weakref.WeakSet[SGLangServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter exit
    for server in list(_LIVE):
        server.stop(timeout=5)


class SGLangServer:
    """One server process: start, wait for health, detect death, stop."""

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        tail_lines: int = 40,
        drop_env: Sequence[str] = (),
    ):
        self.spec = spec
        self.command = launch_command(spec)
        self.env = dict(env or {})
        self.drop_env = tuple(drop_env)  # variables of this process the server must not inherit
        self.tail_lines = tail_lines
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="sglang-")) / "server.log"
        self.proc: subprocess.Popen | None = None
        # Memory tags the engine released on this process. SGLang 0.5.23 reports them nowhere, and a resume
        # of a tag it holds kills it, so the record lives as long as the process, not as the engine actor.
        self.released: set[str] = set()

    @property
    def url(self) -> str:
        return self.spec.url

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "SGLangServer":
        if self.spec.uses_sglang:
            require_sglang(self.spec.python)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - the child keeps writing to it
        log.write(f"$ {' '.join(self.command)}\n".encode())
        env = {k: v for k, v in os.environ.items() if k not in self.drop_env}
        env.update({"PYTHONUNBUFFERED": "1", **{k: v for k, v in self.env.items() if k not in self.drop_env}})
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_child_setup,
                close_fds=True,
            )
        finally:
            log.close()
        _LIVE.add(self)
        self.released = set()  # a fresh process holds all its memory
        return self

    def memory_released(self) -> list[str]:
        return sorted(self.released)

    def note_memory(self, released: Sequence[str] = (), resumed: Sequence[str] = ()) -> None:
        self.released.update(released)
        self.released.difference_update(resumed)

    def wait_healthy(self, timeout: float = 900.0, interval: float = 0.2) -> None:
        """Poll GET /health until 200; fail fast (with the log tail) if the process exits meanwhile."""
        import httpx

        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while True:
                self.check_alive(during="startup")
                try:
                    r = client.get(f"{self.url}/health")
                    if r.status_code == 200:
                        return
                    last_error = f"/health answered {r.status_code}"
                except httpx.HTTPError as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    raise EngineStartError(
                        f"SGLang server at {self.url} not healthy after {timeout:.0f}s ({last_error}); "
                        f"last {len(tail)} log lines of {self.log_path}:\n" + "\n".join(tail)
                    )
                time.sleep(interval)

    def poll(self) -> int | None:
        """None while running, else the exit code (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self, during: str = "rollout") -> None:
        code = self.poll()
        if self.proc is None:
            raise EngineDiedError(f"SGLang server for {self.url} was never started")
        if code is not None:
            tail = self.log_tail()
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise EngineDiedError(
                f"SGLang server at {self.url} (pid {self.proc.pid}) died during {during} ({how}); "
                f"last {len(tail)} log lines of {self.log_path}:\n" + "\n".join(tail),
                returncode=code,
                log_tail=tail,
            )

    def log_tail(self, n: int | None = None) -> list[str]:
        n = n or self.tail_lines
        try:
            with open(self.log_path, "rb") as f:
                return [line.decode("utf-8", "replace").rstrip("\n") for line in collections.deque(f, maxlen=n)]
        except FileNotFoundError:
            return []

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after `timeout`; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        _LIVE.discard(self)
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=30)
        else:
            self._signal_group(proc, signal.SIGKILL)  # leftovers of a crashed server (its group)
        return proc.returncode

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid: the child called setsid()
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
