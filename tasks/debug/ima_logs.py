"""IMA triage: reading a reproducer's log: the first CUDA error, the faulting kernel and frame, and the cell's
outcome (pass, crash, timeout, error, n/a)."""

from __future__ import annotations

import re
import signal
from typing import Sequence

# Outcomes of one cell.
PASS, CRASH, TIMEOUT, ERROR, NA = "pass", "crash", "timeout", "error", "n/a"
FAILING = (CRASH, TIMEOUT)  # what the verdict isolates; ERROR (no CUDA error, no signal) is inconclusive

# The reproducer exits with this when the backend cannot run a cell (reported as n/a, never skipped).
EXIT_UNSUPPORTED = 78


# First error line: the first log line that matches one of these (case-insensitive).
ERROR_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("illegal memory access", re.compile(r"illegal memory access|illegal address|cudaErrorIllegalAddress", re.I)),
    ("device-side assert", re.compile(r"device-side assert", re.I)),
    ("misaligned address", re.compile(r"misaligned address", re.I)),
    (
        "CUDA error",
        re.compile(
            r"CUDA error|CUDA Exception|Triton Error \[CUDA\]|CUBLAS_STATUS_EXECUTION_FAILED|"
            r"CUDNN_STATUS_EXECUTION_FAILED|NCCL error|unhandled cuda error",
            re.I,
        ),
    ),
)
_PY_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)')  # traceback, or faulthandler (no comma)
# How the faulting kernel is named: cuda-gdb on a core dump, then the reproducer's Triton launch trace.
_GDB_KERNEL = (
    re.compile(r"\bin ([A-Za-z_][\w:~]*)(?:<[^(]*?>)?<<<"),
    re.compile(r"triggered at PC 0x[0-9a-fA-F]+\s+(?:<)?([A-Za-z_][\w:~]*)"),
)
_TRACE_KERNEL = re.compile(r"rollflow-ima: last Triton kernel launched(?: before the error)?: (\S+)")
_INJECTED = re.compile(r"rollflow-ima: injected fault")
LIBRARY_FRAME = re.compile(r'File "[^"]*(?:site-packages|dist-packages|<frozen )')


# ------------------------------------------------------------------------------------------ log scan


def first_error_line(lines: Sequence[str]) -> tuple[str | None, str | None]:
    """(first line that matches a CUDA error pattern, its kind), or (None, None)."""
    for line in lines:
        for kind, pattern in ERROR_PATTERNS:
            if pattern.search(line):
                return line.strip(), kind
    return None, None


def error_kind(lines: Sequence[str]) -> str | None:
    """The most specific CUDA error kind anywhere in the log."""
    text = "\n".join(lines)
    for kind, pattern in ERROR_PATTERNS:
        if pattern.search(text):
            return kind
    return None


def last_python_exception(lines: Sequence[str]) -> str | None:
    for line in reversed(lines):
        if _PY_EXCEPTION.match(line.strip()):
            return line.strip()
    return None


def innermost_frame(lines: Sequence[str], stop_at: int | None = None) -> str | None:
    """'file:line in fn' of the innermost frame before `stop_at`: the last frame of a Python traceback
    (most recent call last), else the first frame of a faulthandler dump (most recent call first)."""
    traceback_frame = faulthandler_frame = None
    recent_first = False
    for line in lines[:stop_at] if stop_at is not None else lines:
        if "most recent call first" in line:
            recent_first = True  # the first block is the current (crashing) thread
            continue
        m = _FRAME.match(line)
        if not m:
            if line.strip():
                recent_first = False
            continue
        frame = f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
        if recent_first:
            faulthandler_frame = faulthandler_frame or frame
        else:
            traceback_frame = frame
    return traceback_frame or faulthandler_frame


def faulting_kernel(lines: Sequence[str]) -> str | None:
    """Kernel named by cuda-gdb (core dump) or by the reproducer's launch trace under launch blocking."""
    for pattern in _GDB_KERNEL:
        for line in lines:
            m = pattern.search(line)
            if m:
                return m.group(1)
    for line in reversed(lines):
        m = _TRACE_KERNEL.search(line)
        if m:
            return m.group(1)
    return None


def signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify(returncode: int | None, timed_out: bool, lines: Sequence[str]) -> tuple[str, str | None, str | None]:
    """(outcome, first error line, error kind) of a finished reproducer."""
    line, kind = first_error_line(lines)
    if timed_out:
        return TIMEOUT, line, kind
    if returncode == 0:
        return PASS, None, None
    if returncode == EXIT_UNSUPPORTED:
        reason = next(
            (ln.split("unsupported:", 1)[1].strip() for ln in reversed(lines) if "unsupported:" in ln),
            "the reproducer cannot run this cell",
        )
        return NA, reason, None
    if kind is not None or (returncode is not None and returncode < 0):
        if line is None:
            injected = next((ln.strip() for ln in lines if _INJECTED.search(ln)), None)
            line = injected or last_python_exception(lines) or f"killed by {signal_name(returncode)}"
        return CRASH, line, kind
    return ERROR, last_python_exception(lines) or (lines[-1].strip() if lines else f"exit {returncode}"), None
