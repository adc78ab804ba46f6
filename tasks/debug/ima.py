"""Illegal-memory-access (IMA) triage, Prefect-free: toggle matrix, per-backend flags, cell runner, verdict.

The triage that slime's debug guide prescribes when an engine dies with a CUDA illegal memory access:

1. switch CUDA graphs, speculative decoding and DeepEP all-to-all on and off in every combination
   (an IMA often sits in graph-replay padding, in a draft/target mismatch or in the a2a kernels);
2. rerun a crashing cell with ``CUDA_LAUNCH_BLOCKING=1`` so the error is raised at the launch of the
   kernel that faulted, not at some later synchronisation;
3. rerun it once more with the CUDA core-dump variables set and open the dump with cuda-gdb
   (``cuda-gdb -ex "target cudacore <file>"``): it names the kernel, the PC and the faulting address.

Every cell runs the reproducer (``python -m rollflow.tasks.debug.ima_repro``) in its own process (a new
session, killed as a group on timeout), so a crash or a hang never takes the caller down.
`flows/bisect.py` runs the same steps as Prefect tasks; ``python -m rollflow.tasks.debug.ima --matrix``
runs them here, with no Prefect (the GPU box has none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

TOGGLES: tuple[str, ...] = ("cuda_graph", "speculative", "deepep")
ON, OFF = "on", "off"

# Outcomes of one cell.
PASS, CRASH, TIMEOUT, ERROR, NA = "pass", "crash", "timeout", "error", "n/a"
FAILING = (CRASH, TIMEOUT)  # what the verdict isolates; ERROR (no CUDA error, no signal) is inconclusive

# Passes: the matrix itself, then reruns of one failing cell.
MATRIX, LAUNCH_BLOCKING, COREDUMP = "matrix", "launch_blocking", "coredump"

# The reproducer exits with this when the backend cannot run a cell (reported as n/a, never skipped).
EXIT_UNSUPPORTED = 78

# CUDA core dump environment (cuda-gdb manual, "GPU core dump support"; CUcoredumpGenerationFlags in the
# driver API). These flags leave out device memory contents and non-relocated ELF images; the dump still
# records the faulting kernel, PC, registers and the exception (a torch process's dump was 197 MB on the H200).
COREDUMP_GENERATION_FLAGS = "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory"
CUDA_DEBUG_VARS = ("CUDA_LAUNCH_BLOCKING", "CUDA_ENABLE_COREDUMP_ON_EXCEPTION", "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION",
                   "CUDA_ENABLE_LIGHTWEIGHT_COREDUMP", "CUDA_ENABLE_USER_TRIGGERED_COREDUMP", "CUDA_COREDUMP_FILE",
                   "CUDA_COREDUMP_PIPE", "CUDA_COREDUMP_GENERATION_FLAGS", "CUDA_COREDUMP_SHOW_PROGRESS")

# First error line: the first log line that matches one of these (case-insensitive).
ERROR_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("illegal memory access", re.compile(r"illegal memory access|illegal address|cudaErrorIllegalAddress", re.I)),
    ("device-side assert", re.compile(r"device-side assert", re.I)),
    ("misaligned address", re.compile(r"misaligned address", re.I)),
    ("CUDA error", re.compile(r"CUDA error|CUDA Exception|Triton Error \[CUDA\]|CUBLAS_STATUS_EXECUTION_FAILED|"
                              r"CUDNN_STATUS_EXECUTION_FAILED|NCCL error|unhandled cuda error", re.I)),
)
_PY_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)')  # traceback, or faulthandler (no comma)
# How the faulting kernel is named: cuda-gdb on a core dump, then the reproducer's Triton launch trace.
_GDB_KERNEL = (re.compile(r"\bin ([A-Za-z_][\w:~]*)(?:<[^(]*?>)?<<<"),
               re.compile(r"triggered at PC 0x[0-9a-fA-F]+\s+(?:<)?([A-Za-z_][\w:~]*)"))
_TRACE_KERNEL = re.compile(r"rollflow-ima: last Triton kernel launched(?: before the error)?: (\S+)")
_INJECTED = re.compile(r"rollflow-ima: injected fault")
_LIBRARY = re.compile(r'File "[^"]*(?:site-packages|dist-packages|<frozen )')


# --------------------------------------------------------------------------------------------- toggles


def _onoff(value: Any, name: str) -> str:
    text = str(value).strip().lower()
    if text in ("on", "1", "true", "yes", "y"):
        return ON
    if text in ("off", "0", "false", "no", "n", "none"):
        return OFF
    raise ValueError(f"toggle {name}={value!r}: expected on or off")


def parse_toggles(spec: str | dict | None) -> dict[str, str]:
    """'cuda_graph=on,speculative=off', a JSON object, or a dict -> {toggle: 'on'|'off'}.

    `None`, '' and 'always' give {} (a condition every cell matches). Unknown toggle names are errors.
    """
    if spec is None:
        return {}
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        text = spec.strip()
        if text in ("", "always", "any", "*"):
            return {}
        if text.startswith("{"):
            items = list(json.loads(text).items())
        else:
            items = []
            for part in text.replace(";", ",").split(","):
                if not part.strip():
                    continue
                key, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"toggle spec {spec!r}: {part!r} is not toggle=on|off "
                                     f"(toggles: {', '.join(TOGGLES)})")
                items.append((key.strip(), value.strip()))
    out: dict[str, str] = {}
    for key, value in items:
        if key not in TOGGLES:
            raise ValueError(f"unknown toggle {key!r}; known: {', '.join(TOGGLES)}")
        out[key] = _onoff(value, key)
    return out


def format_toggles(toggles: dict[str, str]) -> str:
    return ",".join(f"{k}={toggles[k]}" for k in TOGGLES if k in toggles) or "always"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination of the toggles."""

    cuda_graph: bool = False
    speculative: bool = False
    deepep: bool = False

    @classmethod
    def from_toggles(cls, toggles: dict[str, str] | str | None) -> "Cell":
        parsed = parse_toggles(toggles)
        return cls(**{k: parsed.get(k, OFF) == ON for k in TOGGLES})

    def toggles(self) -> dict[str, str]:
        return {k: ON if getattr(self, k) else OFF for k in TOGGLES}

    def matches(self, condition: dict[str, str]) -> bool:
        mine = self.toggles()
        return all(mine[k] == v for k, v in condition.items())

    @property
    def key(self) -> str:
        """File-name safe id: cg1-sp0-ep0."""
        return f"cg{int(self.cuda_graph)}-sp{int(self.speculative)}-ep{int(self.deepep)}"

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.toggles().items())


def toggle_matrix() -> list[Cell]:
    """All 8 cells; deepep varies slowest (n/a cells of a backend without DeepEP come last)."""
    return [Cell(cuda_graph=cg, speculative=sp, deepep=ep)
            for ep, cg, sp in itertools.product((False, True), repeat=3)]


# ------------------------------------------------------------------------------ per-backend toggle maps


@dataclasses.dataclass(frozen=True)
class CellPlan:
    """What a backend does for one cell: flags / generate kwargs, or why the cell is not applicable."""

    cell: Cell
    backend: str
    applicable: bool
    reason: str = ""
    engine_flags: tuple[str, ...] = ()
    trainer_flags: tuple[str, ...] = ()
    generate_kwargs: dict = dataclasses.field(default_factory=dict)
    rollout_overrides: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.applicable:
            return f"n/a: {self.reason}"
        parts = []
        if self.engine_flags:
            parts.append("engine: " + " ".join(self.engine_flags))
        if self.trainer_flags:
            parts.append("trainer: " + " ".join(self.trainer_flags))
        if self.generate_kwargs:
            parts.append("generate: " + ", ".join(f"{k}={v!r}" for k, v in self.generate_kwargs.items()))
        if self.rollout_overrides:
            parts.append("rollout: " + ", ".join(f"{k}={v!r}" for k, v in self.rollout_overrides.items()))
        return "; ".join(parts) or "defaults"


def trainer_flags(cell: Cell) -> tuple[str, ...]:
    """Megatron trainer side of the deepep toggle (slime passes it straight to Megatron)."""
    return ("--moe-enable-deepep",) if cell.deepep else ()


@dataclasses.dataclass(frozen=True)
class SGLangToggles:
    """SGLang server flags per toggle (passthrough; what slime's `--sglang-*` arguments become)."""

    speculative_algorithm: str = "EAGLE"
    speculative_args: tuple[str, ...] = ()  # e.g. ("--speculative-draft-model-path", "/models/draft")
    deepep_mode: str = "auto"
    name: str = "sglang"

    def supports(self, toggle: str) -> bool:
        return toggle in TOGGLES

    def meaning(self, toggle: str) -> str:
        return {"cuda_graph": "off: --disable-cuda-graph",
                "speculative": f"on: --speculative-algorithm {self.speculative_algorithm}; off: no speculative flags",
                "deepep": f"on: --moe-a2a-backend deepep --deepep-mode {self.deepep_mode} (trainer "
                          "--moe-enable-deepep); off: --moe-a2a-backend none"}[toggle]

    def plan(self, cell: Cell) -> CellPlan:
        flags: list[str] = []
        if not cell.cuda_graph:
            flags.append("--disable-cuda-graph")
        if cell.speculative:
            flags += ["--speculative-algorithm", self.speculative_algorithm, *self.speculative_args]
        if cell.deepep:
            flags += ["--moe-a2a-backend", "deepep", "--deepep-mode", self.deepep_mode]
        else:
            flags += ["--moe-a2a-backend", "none"]
        return CellPlan(cell, self.name, True, engine_flags=tuple(flags), trainer_flags=trainer_flags(cell))


@dataclasses.dataclass(frozen=True)
class HFToggles:
    """The `hf` engine's equivalents (transformers `generate`).

    cuda_graph: static KV cache (`cache_implementation="static"`); on CUDA transformers then compiles the
      decode step itself (torch.compile, mode reduce-overhead: CUDA-graph capture and replay); off: dynamic
      cache, eager decode (`disable_compile=True`).
    speculative: assisted generation by prompt lookup (`prompt_lookup_num_tokens`); transformers runs it at
      batch size 1 only, so the cell generates one sequence at a time.
    deepep: not applicable (no MoE all-to-all in this engine); deepep=off cells run, deepep=on cells are n/a.
    """

    prompt_lookup_num_tokens: int = 3
    name: str = "hf"

    def supports(self, toggle: str) -> bool:
        return toggle in ("cuda_graph", "speculative")

    def meaning(self, toggle: str) -> str:
        return {"cuda_graph": 'on: cache_implementation="static" (decode step compiled + CUDA-graph replayed on '
                              'CUDA); off: dynamic cache, eager decode',
                "speculative": f"on: prompt-lookup assisted generation (prompt_lookup_num_tokens="
                               f"{self.prompt_lookup_num_tokens}, batch size 1); off: plain sampling",
                "deepep": "n/a: the hf engine has no MoE all-to-all"}[toggle]

    def plan(self, cell: Cell) -> CellPlan:
        if cell.deepep:
            return CellPlan(cell, self.name, False,
                            reason="deepep=on: the hf engine has no DeepEP / MoE all-to-all (toggle n/a)")
        kwargs: dict[str, Any] = {}
        overrides: dict[str, Any] = {}
        notes: list[str] = []
        if cell.cuda_graph:
            kwargs["cache_implementation"] = "static"
            notes.append("transformers compiles the static-cache decode step on CUDA only (on CPU: static cache, "
                         "no graph)")
        else:
            kwargs["cache_implementation"] = "dynamic"
            kwargs["disable_compile"] = True
        if cell.speculative:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
            overrides["max_batch_size"] = 1
            if cell.cuda_graph:
                # Verification writes up to `prompt_lookup_num_tokens` draft positions past the current length:
                # the static cache needs that headroom (else index_copy_ runs past its end). The repro sets
                # max_cache_len from the prompt width.
                kwargs["max_cache_len"] = "auto"
        return CellPlan(cell, self.name, True, generate_kwargs=kwargs, rollout_overrides=overrides,
                        notes=tuple(notes))


def backend_toggles(backend: str, **options) -> SGLangToggles | HFToggles:
    if backend == "hf":
        return HFToggles(**options)
    if backend == "sglang":
        return SGLangToggles(**options)
    raise ValueError(f"backend {backend!r}: expected 'hf' or 'sglang'")


def toggle_support_table(backend: str) -> list[dict[str, str]]:
    mapping = backend_toggles(backend)
    return [{"toggle": t, "applicable": "yes" if mapping.supports(t) else "n/a", "meaning": mapping.meaning(t)}
            for t in TOGGLES]


# ----------------------------------------------------------------------------------------- environment


def cell_env(pass_name: str, *, coredump_dir: str | Path | None = None, cell_key: str = "cell",
             generation_flags: str = COREDUMP_GENERATION_FLAGS) -> dict[str, str]:
    """The CUDA debug variables of one pass (everything else inherits; inherited debug vars are dropped)."""
    env: dict[str, str] = {}
    if pass_name == LAUNCH_BLOCKING:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    elif pass_name == COREDUMP:
        if coredump_dir is None:
            raise ValueError("the core-dump pass needs a coredump_dir")
        env.update({
            "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
            "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION": "0",  # the GPU dump only; a host core of a torch process is GBs
            "CUDA_COREDUMP_SHOW_PROGRESS": "1",
            "CUDA_COREDUMP_GENERATION_FLAGS": generation_flags,
            # %h host, %p pid (the driver expands them)
            "CUDA_COREDUMP_FILE": str(Path(coredump_dir) / f"core_{cell_key}_%h_%p.nvcudmp"),
        })
    elif pass_name != MATRIX:
        raise ValueError(f"pass {pass_name!r}: expected {MATRIX}, {LAUNCH_BLOCKING} or {COREDUMP}")
    return env


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def repro_command(config_json: str, cell: Cell, *, backend: str = "hf", crash_when: str | None = None,
                  fault: str | None = None, rollout_ids: Sequence[int] = (0,),
                  python: str | None = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "rollflow.tasks.debug.ima_repro", "--config", config_json,
           "--toggles", json.dumps(cell.toggles()), "--backend", backend,
           "--rollout-ids", ",".join(str(i) for i in rollout_ids)]
    if crash_when is not None:
        cmd += ["--crash-when", crash_when]
    if fault:
        cmd += ["--fault", fault]
    return cmd


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


# ------------------------------------------------------------------------------------------ cell runner


@dataclasses.dataclass
class CellResult:
    toggles: dict[str, str]
    pass_name: str = MATRIX
    outcome: str = PASS
    returncode: int | None = None
    signal: str | None = None
    first_error: str | None = None
    error_kind: str | None = None
    kernel: str | None = None
    frame: str | None = None  # innermost frame of the error (often inside a library)
    user_frame: str | None = None  # innermost frame outside site-packages: the call site in the project
    log_tail: list[str] = dataclasses.field(default_factory=list)
    coredumps: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    plan: str = ""
    log_path: str | None = None
    note: str = ""

    @property
    def cell(self) -> Cell:
        return Cell.from_toggles(self.toggles)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CellResult":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def row(self) -> dict:
        """One row of the table artifact."""
        return {"pass": self.pass_name, **self.toggles, "outcome": self.outcome,
                "exit": self.signal or self.returncode, "first_error": self.first_error or self.note or "",
                "kernel": self.kernel or "", "seconds": round(self.seconds, 1)}


def na_result(plan: CellPlan, pass_name: str = MATRIX) -> CellResult:
    return CellResult(toggles=plan.cell.toggles(), pass_name=pass_name, outcome=NA, note=plan.reason,
                      plan=plan.describe())


def classify(returncode: int | None, timed_out: bool, lines: Sequence[str]) -> tuple[str, str | None, str | None]:
    """(outcome, first error line, error kind) of a finished reproducer."""
    line, kind = first_error_line(lines)
    if timed_out:
        return TIMEOUT, line, kind
    if returncode == 0:
        return PASS, None, None
    if returncode == EXIT_UNSUPPORTED:
        reason = next((ln.split("unsupported:", 1)[1].strip() for ln in reversed(lines) if "unsupported:" in ln),
                      "the reproducer cannot run this cell")
        return NA, reason, None
    if kind is not None or (returncode is not None and returncode < 0):
        if line is None:
            injected = next((ln.strip() for ln in lines if _INJECTED.search(ln)), None)
            line = injected or last_python_exception(lines) or f"killed by {signal_name(returncode)}"
        return CRASH, line, kind
    return ERROR, last_python_exception(lines) or (lines[-1].strip() if lines else f"exit {returncode}"), None


def find_coredumps(coredump_dir: str | Path | None, cell_key: str, since: float = 0.0) -> list[str]:
    if coredump_dir is None or not Path(coredump_dir).is_dir():
        return []
    return sorted(str(p) for p in Path(coredump_dir).glob(f"core_{cell_key}_*")
                  if p.is_file() and p.stat().st_mtime >= since - 1)


def _read_lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def run_cell(config_json: str, cell: Cell, *, backend: str = "hf", pass_name: str = MATRIX,
             run_dir: str | Path, crash_when: str | None = None, fault: str | None = None,
             timeout_s: float = 300.0, tail_lines: int = 40, rollout_ids: Sequence[int] = (0,),
             generation_flags: str = COREDUMP_GENERATION_FLAGS, python: str | None = None,
             plan: CellPlan | None = None) -> CellResult:
    """Run the reproducer for one cell in its own process session; never raises for a crash or a hang."""
    plan = plan or backend_toggles(backend).plan(cell)
    if not plan.applicable:
        return na_result(plan, pass_name)
    run_dir = Path(run_dir)
    logs = run_dir / "ima_logs"
    coredump_dir = run_dir / "coredumps"
    logs.mkdir(parents=True, exist_ok=True)
    extra = cell_env(pass_name, coredump_dir=coredump_dir, cell_key=cell.key, generation_flags=generation_flags)
    if pass_name == COREDUMP:
        coredump_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in CUDA_DEBUG_VARS}
    env.update(extra)
    root = str(repo_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash prints the Python stack
    cmd = repro_command(config_json, cell, backend=backend, crash_when=crash_when, fault=fault,
                        rollout_ids=rollout_ids, python=python)
    log_path = logs / f"{pass_name}-{cell.key}.log"
    started = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        log.write(f"# {pass_name} {cell.label}\n# env: {json.dumps(extra)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this call started, and nothing else
            except ProcessLookupError:
                pass
            returncode = proc.wait()
    seconds = time.time() - started
    lines = _read_lines(log_path)
    outcome, line, kind = classify(returncode, timed_out, lines)
    if outcome == NA:
        return CellResult(toggles=cell.toggles(), pass_name=pass_name, outcome=NA, returncode=returncode, note=line,
                          plan=plan.describe(), log_path=str(log_path), seconds=seconds, env=extra)
    result = CellResult(
        toggles=cell.toggles(), pass_name=pass_name, outcome=outcome, returncode=returncode,
        signal=signal_name(returncode), first_error=line, error_kind=kind or error_kind(lines),
        log_tail=lines[-tail_lines:], coredumps=find_coredumps(coredump_dir, cell.key, started),
        seconds=seconds, env=extra, plan=plan.describe(), log_path=str(log_path),
        note=f"no exit after {timeout_s:g}s: killed" if timed_out else "")
    if outcome in FAILING:
        cut = next((i for i, ln in enumerate(lines) if line and ln.strip() == line), None)
        result.kernel = faulting_kernel(lines)
        result.frame = innermost_frame(lines, cut) or innermost_frame(lines)
        before = lines[:cut] if cut is not None else lines
        result.user_frame = (innermost_frame([ln for ln in before if not _LIBRARY.search(ln)])
                             or innermost_frame([ln for ln in lines if not _LIBRARY.search(ln)]))
    return result


def inspect_coredump(path: str | Path, timeout_s: float = 120.0) -> dict:
    """cuda-gdb's view of a GPU core dump: its output and the kernel it names (if cuda-gdb is here)."""
    gdb = shutil.which("cuda-gdb")
    cmd_text = f'cuda-gdb -batch -ex "target cudacore {path}" -ex "info cuda kernels" -ex "bt"'
    if gdb is None:
        return {"path": str(path), "command": cmd_text, "available": False,
                "note": "cuda-gdb is not on PATH here; open the dump where the CUDA toolkit is installed"}
    cmd = [gdb, "-batch", "-ex", f"target cudacore {path}", "-ex", "info cuda kernels", "-ex", "bt"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        lines = (proc.stdout + proc.stderr).splitlines()
        out = {"returncode": proc.returncode}
    except subprocess.TimeoutExpired as exc:
        lines = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                 else (exc.stdout or "")).splitlines()
        out = {"returncode": None, "note": f"cuda-gdb did not finish in {timeout_s:g}s"}
    exception = next((ln.strip() for ln in lines if "CUDA Exception" in ln), None)
    return {"path": str(path), "command": cmd_text, "available": True, "kernel": faulting_kernel(lines),
            "exception": exception, "output_tail": lines[-40:], **out}


# --------------------------------------------------------------------------------------------- verdict


@dataclasses.dataclass
class Verdict:
    kind: str  # nothing_ran | no_crash | all_crash | isolated | isolated_pass | mixed
    text: str
    condition: dict[str, str] = dataclasses.field(default_factory=dict)
    failing: list[dict[str, str]] = dataclasses.field(default_factory=list)
    passing: list[dict[str, str]] = dataclasses.field(default_factory=list)
    not_applicable: list[dict[str, str]] = dataclasses.field(default_factory=list)
    inconclusive: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _phrase(condition: dict[str, str]) -> str:
    return " and ".join(f"{k} {condition[k]}" for k in TOGGLES if k in condition)


def _minimal_condition(targets: list[dict[str, str]], others: list[dict[str, str]],
                       ran: list[dict[str, str]]) -> dict[str, str] | None:
    """Smallest set of toggle settings shared by every target cell and by no other cell (None: no such set).

    Settings constant over all cells that ran (e.g. deepep=off on a backend without DeepEP) are left out:
    they separate nothing.
    """
    shared = {k: v for k, v in targets[0].items() if all(t.get(k) == v for t in targets)}
    shared = {k: v for k, v in shared.items() if not all(r.get(k) == v for r in ran)}
    keys = [k for k in TOGGLES if k in shared]
    for size in range(1, len(keys) + 1):
        for subset in itertools.combinations(keys, size):
            cond = {k: shared[k] for k in subset}
            if not any(all(o.get(k) == v for k, v in cond.items()) for o in others):
                return cond
    return None


def verdict(cells: Iterable[tuple[dict[str, str], str]]) -> Verdict:
    """Which toggles a crash depends on, from (toggles, outcome) of every matrix cell.

    Failing cells are crashes and timeouts; n/a cells did not run; errors (a non-zero exit with neither a
    CUDA error nor a signal) are inconclusive. If one conjunction of toggle settings holds in exactly the
    failing cells, that is the verdict ("crashes only with cuda_graph on"); else, if one holds in exactly
    the passing cells, the crash needs any deviation from it; else the pattern is mixed.
    """
    cells = [(dict(t), o) for t, o in cells]
    failing = [t for t, o in cells if o in FAILING]
    passing = [t for t, o in cells if o == PASS]
    na = [t for t, o in cells if o == NA]
    inconclusive = [t for t, o in cells if o not in FAILING and o not in (PASS, NA)]
    ran = failing + passing
    hangs = sum(1 for _, o in cells if o == TIMEOUT)
    verb = "crashes" if hangs == 0 else "fails (crash or hang)"
    base = dict(failing=failing, passing=passing, not_applicable=na, inconclusive=inconclusive)
    suffix = ""
    if inconclusive:
        suffix = f" ({len(inconclusive)} cell(s) errored without a CUDA error or signal: see the table)"
    if not ran:
        return Verdict("nothing_ran", "nothing ran: every cell was n/a or errored" + suffix, **base)
    if not failing:
        return Verdict("no_crash", f"no crash reproduced ({len(passing)} cells passed)" + suffix, **base)
    if not passing:
        return Verdict("all_crash", f"{verb} in every cell: not toggle-related" + suffix, **base)
    cond = _minimal_condition(failing, passing, ran)
    if cond:
        return Verdict("isolated", f"{verb} only with {_phrase(cond)}" + suffix, condition=cond, **base)
    cond = _minimal_condition(passing, failing, ran)
    if cond:
        return Verdict("isolated_pass", f"{verb} unless {_phrase(cond)} (passes only with {_phrase(cond)}; "
                                        "switching any of them crashes)" + suffix, condition=cond, **base)
    listed = "; ".join(format_toggles(t) for t in failing)
    return Verdict("mixed", f"{verb} in {len(failing)} of {len(ran)} cells with no single toggle pattern ({listed}): "
                            "rerun to check for flakiness" + suffix, **base)


def pick_rerun_cell(results: Sequence[CellResult]) -> CellResult | None:
    """The cell to rerun with launch blocking / core dumps: the first crash (else the first hang)."""
    for wanted in (CRASH, TIMEOUT):
        for r in results:
            if r.outcome == wanted:
                return r
    return None


# ---------------------------------------------------------------------------------------------- report


@dataclasses.dataclass
class BisectReport:
    backend: str
    crash_when: str | None
    fault: str | None
    cells: list[CellResult]
    verdict: Verdict
    reruns: list[CellResult] = dataclasses.field(default_factory=list)
    coredump_inspections: list[dict] = dataclasses.field(default_factory=list)
    support: list[dict] = dataclasses.field(default_factory=list)
    context: dict = dataclasses.field(default_factory=dict)

    @property
    def launch_blocking(self) -> CellResult | None:
        return next((r for r in self.reruns if r.pass_name == LAUNCH_BLOCKING), None)

    @property
    def coredump_run(self) -> CellResult | None:
        return next((r for r in self.reruns if r.pass_name == COREDUMP), None)

    @property
    def coredumps(self) -> list[str]:
        return [p for r in self.reruns for p in r.coredumps]

    @property
    def kernel(self) -> str | None:
        """The faulting kernel: cuda-gdb on the core dump first, then the launch-blocking rerun."""
        for info in self.coredump_inspections:
            if info.get("kernel"):
                return info["kernel"]
        lb = self.launch_blocking
        return lb.kernel if lb else None

    def rows(self) -> list[dict]:
        return [r.row() for r in [*self.cells, *self.reruns]]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "crash_when": self.crash_when, "fault": self.fault,
                "verdict": self.verdict.to_dict(), "kernel": self.kernel, "coredumps": self.coredumps,
                "cells": [r.to_dict() for r in self.cells], "reruns": [r.to_dict() for r in self.reruns],
                "coredump_inspections": self.coredump_inspections, "support": self.support, "context": self.context}

    def to_markdown(self, *, title: str = "IMA bisect") -> str:
        out = [f"# {title} (engine `{self.backend}`)", "", f"**Verdict: {self.verdict.text}**", ""]
        if self.crash_when is not None:
            out.append(f"Injected fault: `{self.fault or 'auto'}` when `{self.crash_when}` (debug switch).")
            out.append("")
        lb = self.launch_blocking
        if lb is not None:
            out.append(f"- launch-blocking rerun (`CUDA_LAUNCH_BLOCKING=1`, {lb.cell.label}): **{lb.outcome}**; "
                       f"first error: `{lb.first_error or '-'}`")
            out.append(f"  - faulting kernel: **{lb.kernel or 'not named by the log'}**"
                       + (f"; called from `{lb.user_frame}`" if lb.user_frame else "")
                       + (f"; raised at `{lb.frame}`" if lb.frame and lb.frame != lb.user_frame else ""))
        cd = self.coredump_run
        if cd is not None:
            dumps = ", ".join(f"`{p}`" for p in cd.coredumps) or "none written"
            out.append(f"- core-dump rerun ({cd.cell.label}): **{cd.outcome}**; core dumps: {dumps}")
        for info in self.coredump_inspections:
            if info.get("available"):
                out.append(f"  - cuda-gdb: {info.get('exception') or 'no exception line'}; kernel "
                           f"**{info.get('kernel') or '?'}**")
        if self.kernel and (lb is None or self.kernel != lb.kernel):
            out.append(f"- faulting kernel (core dump): **{self.kernel}**")
        out += ["", "| pass | cuda_graph | speculative | deepep | outcome | exit | first error line | s |",
                "|---|---|---|---|---|---|---|---|"]
        for r in [*self.cells, *self.reruns]:
            err = (r.first_error or r.note or "").replace("|", "\\|")
            if len(err) > 160:
                err = err[:157] + "..."
            exit_code = r.signal or ("" if r.returncode is None else r.returncode)
            out.append(f"| {r.pass_name} | {r.toggles['cuda_graph']} | {r.toggles['speculative']} | "
                       f"{r.toggles['deepep']} | {r.outcome} | {exit_code} | {err} | {r.seconds:.1f} |")
        if self.support:
            out += ["", "Toggles on this engine:", ""]
            out += [f"- `{s['toggle']}` ({s['applicable']}): {s['meaning']}" for s in self.support]
        out += ["", "## Reading a core dump", "",
                "```bash",
                'cuda-gdb -ex "target cudacore <file>"   # or: -batch -ex "info cuda kernels" -ex bt',
                "```", "",
                "cuda-gdb prints `CUDA Exception: Warp Illegal Address` (or the exception that fired), the kernel "
                "and PC (`The exception was triggered at PC ...`), and focuses the faulting thread: `info cuda "
                "kernels` lists the kernels on the device, `bt` the device stack, `disas $errorpc,+16` the faulting "
                "instruction, `info registers` the address it used. The dumps were taken with "
                f"`CUDA_COREDUMP_GENERATION_FLAGS={COREDUMP_GENERATION_FLAGS}` (device memory contents left "
                "out; drop a skip flag to keep that memory)."]
        if self.coredumps:
            out += ["", "Core dumps:", ""] + [f"- `{p}`" for p in self.coredumps]
        return "\n".join(out) + "\n"


def host_context() -> dict:
    ctx: dict[str, Any] = {"host": socket.gethostname(), "python": sys.version.split()[0],
                           "cuda_gdb": shutil.which("cuda-gdb")}
    return ctx


def run_matrix(config: dict | str, *, backend: str = "hf", run_dir: str | Path, crash_when: str | None = None,
               fault: str | None = None, timeout_s: float = 300.0, coredump: bool = True, parallel: int = 1,
               rollout_ids: Sequence[int] = (0,), log=print) -> BisectReport:
    """The whole triage in this process (no Prefect): matrix, launch-blocking rerun, core-dump rerun."""
    config_json = config if isinstance(config, str) else json.dumps(config)
    if crash_when is not None:
        crash_when = format_toggles(parse_toggles(crash_when))
    mapping = backend_toggles(backend)
    plans = [mapping.plan(c) for c in toggle_matrix()]
    common = dict(backend=backend, run_dir=run_dir, crash_when=crash_when, fault=fault, timeout_s=timeout_s,
                  rollout_ids=rollout_ids)

    def one(plan: CellPlan) -> CellResult:
        result = run_cell(config_json, plan.cell, plan=plan, **common)
        log(f"[{result.pass_name}] {plan.cell.label}: {result.outcome} {result.first_error or result.note or ''}")
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        cells = list(pool.map(one, plans))
    report = BisectReport(backend, crash_when, fault, cells, verdict([(r.toggles, r.outcome) for r in cells]),
                          support=toggle_support_table(backend), context=host_context())
    target = pick_rerun_cell(cells)
    if target is not None:
        plan = mapping.plan(target.cell)
        report.reruns.append(one_pass(config_json, plan, LAUNCH_BLOCKING, common, log))
        if coredump:
            cd = one_pass(config_json, plan, COREDUMP, common, log)
            report.reruns.append(cd)
            report.coredump_inspections = [inspect_coredump(p) for p in cd.coredumps]
    return report


def one_pass(config_json: str, plan: CellPlan, pass_name: str, common: dict, log=print) -> CellResult:
    result = run_cell(config_json, plan.cell, plan=plan, pass_name=pass_name, **common)
    log(f"[{pass_name}] {plan.cell.label}: {result.outcome} {result.first_error or result.note or ''}"
        + (f" kernel={result.kernel}" if result.kernel else "")
        + (f" coredumps={result.coredumps}" if result.coredumps else ""))
    return result


# ------------------------------------------------------------------------------------------------- CLI


def _set_dotted(data: dict, dotted: str, raw: str) -> None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def load_config_arg(text: str | None) -> dict:
    """Inline JSON, or a path to a JSON file; {} when None."""
    if not text:
        return {}
    if text.lstrip().startswith("{"):
        return json.loads(text)
    return json.loads(Path(text).read_text())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollflow.tasks.debug.ima",
                                 description="IMA triage without Prefect: toggle matrix + reruns, report to --out")
    ap.add_argument("--matrix", action="store_true", help="run the toggle matrix (the only mode)")
    ap.add_argument("--config", help="RunConfig JSON (inline or a file); model/rollout/data sections are used")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override: rollout.device=cuda")
    ap.add_argument("--backend", default=None, help="hf or sglang (default: rollout.engine or hf)")
    ap.add_argument("--crash-when", default=None, help="debug switch: inject a fault in cells matching this")
    ap.add_argument("--fault", default=None, help="auto | abort | raise | triton_oob | device_assert")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--parallel", type=int, default=1, help="matrix cells run at once")
    ap.add_argument("--no-coredump", action="store_true")
    ap.add_argument("--run-dir", default=None, help="where logs and core dumps go (default: --out or ./ima-run)")
    ap.add_argument("--out", default=None, help="write ima_report.json / ima_report.md here")
    args = ap.parse_args(argv)
    if not args.matrix:
        ap.error("nothing to do: pass --matrix")
    config = load_config_arg(args.config)
    for item in args.sets:
        key, sep, raw = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected key=value")
        _set_dotted(config, key, raw)
    backend = args.backend or config.get("rollout", {}).get("engine", "hf")
    run_dir = Path(args.run_dir or args.out or "ima-run").resolve()
    started = time.time()
    report = run_matrix(config, backend=backend, run_dir=run_dir, crash_when=args.crash_when, fault=args.fault,
                        timeout_s=args.timeout_s, coredump=not args.no_coredump, parallel=args.parallel,
                        log=lambda m: print(m, flush=True))
    report.context["wall_s"] = round(time.time() - started, 1)
    report.context["config"] = config
    print(report.to_markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ima_report.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
        (out / "ima_report.md").write_text(report.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
