"""Python stacks of live processes (py-spy, native frames where it can), for the report of a stalled run.

py-spy pauses its target while it reads the stacks, which a stopped (SIGSTOP) process refuses ("Failed to suspend
process"); `--nonblocking` reads them without pausing, so it is the fallback. The flow process falls back to its
own `sys._current_frames()` when py-spy is missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

DUMP_TIMEOUT_S = 15.0


@dataclasses.dataclass(frozen=True)
class ProcessStacks:
    """One process's stacks: `label` names it (an actor name, "flow process"), `how` says how they were read."""

    label: str
    pid: int
    how: str
    text: str

    def render(self) -> str:
        return f"=== {self.label} (pid {self.pid}; {self.how}) ===\n{self.text.rstrip()}\n"


def py_spy_path() -> str | None:
    """The py-spy beside this interpreter (a venv's bin/, also when PATH lacks it), else the one on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def _run(cmd: list[str], timeout: float) -> tuple[bool, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:g} s"
    except OSError as exc:
        return False, str(exc)
    if out.returncode == 0 and out.stdout.strip():
        return True, out.stdout
    return False, (out.stderr or out.stdout).strip() or f"exit {out.returncode}"


def dump_pid(pid: int, label: str, timeout: float = DUMP_TIMEOUT_S) -> ProcessStacks:
    """`py-spy dump --native`, then without native frames, then `--nonblocking` (the one a stopped process allows)."""
    exe = py_spy_path()
    if exe is None:
        return ProcessStacks(label, pid, "not captured", "py-spy is not installed (pip install py-spy)")
    errors = []
    for flags, how in ((["--native"], "py-spy --native"), ([], "py-spy"), (["--nonblocking"], "py-spy --nonblocking")):
        ok, text = _run([exe, "dump", *flags, "--pid", str(pid)], timeout)
        if ok:
            return ProcessStacks(label, pid, how, text)
        errors.append(f"{how}: {text.splitlines()[-1]}")
    return ProcessStacks(label, pid, "not captured", "\n".join(errors))


def own_stacks(label: str = "flow process") -> ProcessStacks:
    """This process's Python stacks: py-spy (native frames) when it works, else the interpreter's own frames."""
    captured = dump_pid(os.getpid(), label)
    if captured.how != "not captured":
        return captured
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [
        f"Thread {tid} ({names.get(tid, '?')}):\n" + "".join(traceback.format_stack(frame))
        for tid, frame in sys._current_frames().items()
    ]
    return ProcessStacks(label, os.getpid(), f"traceback ({captured.text.splitlines()[-1]})", "\n".join(parts))
