"""Python stacks of live processes (py-spy, native frames where it can), for the report of a stalled run.

py-spy pauses its target while it reads the stacks, which a stopped (SIGSTOP) process refuses ("Failed to suspend
process"); `--nonblocking` reads them without pausing, so it is the fallback. The flow process falls back to its
own `sys._current_frames()` when py-spy is missing. py-spy reads only processes of its own machine: an actor on
another node of a Ray cluster is dumped there, by a Ray task pinned to that node (`submit_dump`, `collect_dump`).
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
from typing import Any

DUMP_TIMEOUT_S = 15.0
# A dump on another node: the task's scheduling, a worker start there and py-spy (a few seconds on a live node).
# Not dump_pid's worst case (three attempts of DUMP_TIMEOUT_S): the stall's one-line error waits for this, and a
# node that does not answer within it (a cut link, drill c) is reported as not captured instead.
REMOTE_DUMP_TIMEOUT_S = 20.0


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


def submit_dump(pid: int, label: str, node_id: str) -> Any:
    """Start `dump_pid(pid, label)` on node `node_id` (a Ray task pinned there, no CPU reserved, so a node whose
    CPUs the run's actors hold still runs it); returns its ref for `collect_dump`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)  # soft: it would dump a pid of another node
    task = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=pinned)(dump_pid)
    return task.remote(pid, label)


def collect_dump(ref: Any, pid: int, label: str, node_id: str, timeout: float) -> ProcessStacks:
    """The stacks a `submit_dump` task read on its node, or why there are none (a dead node, a cut link, a timeout:
    the reasons an actor there stalled in the first place)."""
    import ray

    try:
        stacks = ray.get(ref, timeout=max(timeout, 0.1))
    except Exception as exc:  # noqa: BLE001 - any failure of the dump is reported in its place, never raised
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - already finished or its node is gone
            pass
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ProcessStacks(label, pid, "not captured", f"dump task on node {node_id}: {type(exc).__name__}: {reason}")
    return dataclasses.replace(stacks, how=f"{stacks.how} on node {node_id}")
