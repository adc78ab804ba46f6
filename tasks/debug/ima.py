"""Illegal-memory-access (IMA) triage, Prefect-free: toggle matrix, per-backend flags, cell runner, verdict.

The triage that slime's debug guide prescribes when an engine dies with a CUDA illegal memory access:

1. switch CUDA graphs, speculative decoding and DeepEP all-to-all on and off in every combination
   (an IMA often sits in graph-replay padding, in a draft/target mismatch or in the a2a kernels);
2. rerun a crashing cell with ``CUDA_LAUNCH_BLOCKING=1`` so the error is raised at the launch of the
   kernel that faulted, not at some later synchronisation;
3. rerun it once more with the CUDA core-dump variables set and open the dump with cuda-gdb
   (``cuda-gdb -ex "target cudacore <file>"``): it names the kernel, the PC and the faulting address.

The pieces: `ima_toggles` (the matrix and per-backend maps), `ima_env` (a pass's CUDA variables and
the reproducer command), `ima_logs` (log scan and outcome), `ima_report` (results, verdict, report); this module
runs cells and the whole matrix, and is the command line.

Every cell runs the reproducer (``python -m rollflow.tasks.debug.ima_repro``) in its own process (a new
session, killed as a group on timeout), so a crash or a hang never takes the caller down.
`flows/bisect.py` runs the same steps as Prefect tasks; ``python -m rollflow.tasks.debug.ima --matrix``
runs them here, with no Prefect (the GPU box has none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from rollflow.tasks.debug.ima_env import (
    COREDUMP,
    COREDUMP_GENERATION_FLAGS,
    CUDA_DEBUG_VARS,
    LAUNCH_BLOCKING,
    MATRIX,
    cell_env,
    repo_root,
    repro_command,
)
from rollflow.tasks.debug.ima_logs import (
    CRASH,
    ERROR,
    ERROR_PATTERNS,
    EXIT_UNSUPPORTED,
    FAILING,
    LIBRARY_FRAME,
    NA,
    PASS,
    TIMEOUT,
    classify,
    error_kind,
    faulting_kernel,
    first_error_line,
    innermost_frame,
    last_python_exception,
    signal_name,
)
from rollflow.tasks.debug.ima_report import (
    BisectReport,
    CellResult,
    Verdict,
    host_context,
    na_result,
    pick_rerun_cell,
    verdict,
)
from rollflow.tasks.debug.ima_toggles import (
    OFF,
    ON,
    TOGGLES,
    Cell,
    CellPlan,
    HFToggles,
    SGLangToggles,
    backend_toggles,
    format_toggles,
    parse_toggles,
    toggle_matrix,
    toggle_support_table,
    trainer_flags,
)

# The names of the pieces stay importable from here, where the flows, the CLI and the tests import them.
__all__ = [
    "COREDUMP",
    "COREDUMP_GENERATION_FLAGS",
    "CRASH",
    "CUDA_DEBUG_VARS",
    "ERROR",
    "ERROR_PATTERNS",
    "EXIT_UNSUPPORTED",
    "FAILING",
    "LAUNCH_BLOCKING",
    "MATRIX",
    "NA",
    "OFF",
    "ON",
    "PASS",
    "TIMEOUT",
    "TOGGLES",
    "BisectReport",
    "Cell",
    "CellPlan",
    "CellResult",
    "HFToggles",
    "SGLangToggles",
    "Verdict",
    "backend_toggles",
    "cell_env",
    "classify",
    "error_kind",
    "faulting_kernel",
    "find_coredumps",
    "first_error_line",
    "format_toggles",
    "host_context",
    "innermost_frame",
    "inspect_coredump",
    "last_python_exception",
    "load_config_arg",
    "main",
    "na_result",
    "one_pass",
    "parse_toggles",
    "pick_rerun_cell",
    "repo_root",
    "repro_command",
    "run_cell",
    "run_matrix",
    "signal_name",
    "toggle_matrix",
    "toggle_support_table",
    "trainer_flags",
    "verdict",
]


def find_coredumps(coredump_dir: str | Path | None, cell_key: str, since: float = 0.0) -> list[str]:
    if coredump_dir is None or not Path(coredump_dir).is_dir():
        return []
    return sorted(
        str(p) for p in Path(coredump_dir).glob(f"core_{cell_key}_*") if p.is_file() and p.stat().st_mtime >= since - 1
    )


def _read_lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def run_cell(
    config_json: str,
    cell: Cell,
    *,
    backend: str = "hf",
    pass_name: str = MATRIX,
    run_dir: str | Path,
    crash_when: str | None = None,
    fault: str | None = None,
    timeout_s: float = 300.0,
    tail_lines: int = 40,
    rollout_ids: Sequence[int] = (0,),
    generation_flags: str = COREDUMP_GENERATION_FLAGS,
    python: str | None = None,
    plan: CellPlan | None = None,
) -> CellResult:
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
    cmd = repro_command(
        config_json, cell, backend=backend, crash_when=crash_when, fault=fault, rollout_ids=rollout_ids, python=python
    )
    log_path = logs / f"{pass_name}-{cell.key}.log"
    started = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        log.write(f"# {pass_name} {cell.label}\n# env: {json.dumps(extra)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
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
        return CellResult(
            toggles=cell.toggles(),
            pass_name=pass_name,
            outcome=NA,
            returncode=returncode,
            note=line,
            plan=plan.describe(),
            log_path=str(log_path),
            seconds=seconds,
            env=extra,
        )
    result = CellResult(
        toggles=cell.toggles(),
        pass_name=pass_name,
        outcome=outcome,
        returncode=returncode,
        signal=signal_name(returncode),
        first_error=line,
        error_kind=kind or error_kind(lines),
        log_tail=lines[-tail_lines:],
        coredumps=find_coredumps(coredump_dir, cell.key, started),
        seconds=seconds,
        env=extra,
        plan=plan.describe(),
        log_path=str(log_path),
        note=f"no exit after {timeout_s:g}s: killed" if timed_out else "",
    )
    if outcome in FAILING:
        cut = next((i for i, ln in enumerate(lines) if line and ln.strip() == line), None)
        result.kernel = faulting_kernel(lines)
        result.frame = innermost_frame(lines, cut) or innermost_frame(lines)
        before = lines[:cut] if cut is not None else lines
        result.user_frame = innermost_frame([ln for ln in before if not LIBRARY_FRAME.search(ln)]) or innermost_frame(
            [ln for ln in lines if not LIBRARY_FRAME.search(ln)]
        )
    return result


def inspect_coredump(path: str | Path, timeout_s: float = 120.0) -> dict:
    """cuda-gdb's view of a GPU core dump: its output and the kernel it names (if cuda-gdb is here)."""
    gdb = shutil.which("cuda-gdb")
    cmd_text = f'cuda-gdb -batch -ex "target cudacore {path}" -ex "info cuda kernels" -ex "bt"'
    if gdb is None:
        return {
            "path": str(path),
            "command": cmd_text,
            "available": False,
            "note": "cuda-gdb is not on PATH here; open the dump where the CUDA toolkit is installed",
        }
    cmd = [gdb, "-batch", "-ex", f"target cudacore {path}", "-ex", "info cuda kernels", "-ex", "bt"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        lines = (proc.stdout + proc.stderr).splitlines()
        out = {"returncode": proc.returncode}
    except subprocess.TimeoutExpired as exc:
        lines = (
            (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ).splitlines()
        out = {"returncode": None, "note": f"cuda-gdb did not finish in {timeout_s:g}s"}
    exception = next((ln.strip() for ln in lines if "CUDA Exception" in ln), None)
    return {
        "path": str(path),
        "command": cmd_text,
        "available": True,
        "kernel": faulting_kernel(lines),
        "exception": exception,
        "output_tail": lines[-40:],
        **out,
    }


def run_matrix(
    config: dict | str,
    *,
    backend: str = "hf",
    run_dir: str | Path,
    crash_when: str | None = None,
    fault: str | None = None,
    timeout_s: float = 300.0,
    coredump: bool = True,
    parallel: int = 1,
    rollout_ids: Sequence[int] = (0,),
    log=print,
) -> BisectReport:
    """The whole triage in this process (no Prefect): matrix, launch-blocking rerun, core-dump rerun."""
    config_json = config if isinstance(config, str) else json.dumps(config)
    if crash_when is not None:
        crash_when = format_toggles(parse_toggles(crash_when))
    mapping = backend_toggles(backend)
    plans = [mapping.plan(c) for c in toggle_matrix()]
    common = dict(
        backend=backend,
        run_dir=run_dir,
        crash_when=crash_when,
        fault=fault,
        timeout_s=timeout_s,
        rollout_ids=rollout_ids,
    )

    def one(plan: CellPlan) -> CellResult:
        result = run_cell(config_json, plan.cell, plan=plan, **common)
        log(f"[{result.pass_name}] {plan.cell.label}: {result.outcome} {result.first_error or result.note or ''}")
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        cells = list(pool.map(one, plans))
    report = BisectReport(
        backend,
        crash_when,
        fault,
        cells,
        verdict([(r.toggles, r.outcome) for r in cells]),
        support=toggle_support_table(backend),
        context=host_context(),
    )
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
    log(
        f"[{pass_name}] {plan.cell.label}: {result.outcome} {result.first_error or result.note or ''}"
        + (f" kernel={result.kernel}" if result.kernel else "")
        + (f" coredumps={result.coredumps}" if result.coredumps else "")
    )
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


# The RunConfig sections the reproducer (ima_repro.py) reads; a flow sends it these, so what it reads is what
# the flow read (train: the teacher-forced scoring layout, with rollout.logprobs=teacher_forced).
REPRO_SECTIONS = ("model", "data", "rollout", "train")


def load_config_arg(text: str | None) -> dict:
    """Inline JSON, or a path to a JSON file; {} when None."""
    if not text:
        return {}
    if text.lstrip().startswith("{"):
        return json.loads(text)
    return json.loads(Path(text).read_text())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rollflow.tasks.debug.ima",
        description="IMA triage without Prefect: toggle matrix + reruns, report to --out",
    )
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
    report = run_matrix(
        config,
        backend=backend,
        run_dir=run_dir,
        crash_when=args.crash_when,
        fault=args.fault,
        timeout_s=args.timeout_s,
        coredump=not args.no_coredump,
        parallel=args.parallel,
        log=lambda m: print(m, flush=True),
    )
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
