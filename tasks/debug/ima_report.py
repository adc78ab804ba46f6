"""IMA triage: one cell's result, the verdict over the matrix (which toggles a crash depends on), and the report
(JSON and markdown)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import socket
import sys
from typing import Any, Iterable, Sequence

from rollflow.tasks.debug.ima_env import COREDUMP, COREDUMP_GENERATION_FLAGS, LAUNCH_BLOCKING, MATRIX
from rollflow.tasks.debug.ima_logs import CRASH, FAILING, NA, PASS, TIMEOUT
from rollflow.tasks.debug.ima_toggles import TOGGLES, Cell, CellPlan, format_toggles


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
        return {
            "pass": self.pass_name,
            **self.toggles,
            "outcome": self.outcome,
            "exit": self.signal or self.returncode,
            "first_error": self.first_error or self.note or "",
            "kernel": self.kernel or "",
            "seconds": round(self.seconds, 1),
        }


def na_result(plan: CellPlan, pass_name: str = MATRIX) -> CellResult:
    return CellResult(
        toggles=plan.cell.toggles(), pass_name=pass_name, outcome=NA, note=plan.reason, plan=plan.describe()
    )


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


def _minimal_condition(
    targets: list[dict[str, str]], others: list[dict[str, str]], ran: list[dict[str, str]]
) -> dict[str, str] | None:
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
        return Verdict(
            "isolated_pass",
            f"{verb} unless {_phrase(cond)} (passes only with {_phrase(cond)}; switching any of them crashes)" + suffix,
            condition=cond,
            **base,
        )
    listed = "; ".join(format_toggles(t) for t in failing)
    return Verdict(
        "mixed",
        f"{verb} in {len(failing)} of {len(ran)} cells with no single toggle pattern ({listed}): "
        "rerun to check for flakiness" + suffix,
        **base,
    )


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
        return {
            "backend": self.backend,
            "crash_when": self.crash_when,
            "fault": self.fault,
            "verdict": self.verdict.to_dict(),
            "kernel": self.kernel,
            "coredumps": self.coredumps,
            "cells": [r.to_dict() for r in self.cells],
            "reruns": [r.to_dict() for r in self.reruns],
            "coredump_inspections": self.coredump_inspections,
            "support": self.support,
            "context": self.context,
        }

    def to_markdown(self, *, title: str = "IMA bisect") -> str:
        out = [f"# {title} (engine `{self.backend}`)", "", f"**Verdict: {self.verdict.text}**", ""]
        if self.crash_when is not None:
            out.append(f"Injected fault: `{self.fault or 'auto'}` when `{self.crash_when}` (debug switch).")
            out.append("")
        lb = self.launch_blocking
        if lb is not None:
            out.append(
                f"- launch-blocking rerun (`CUDA_LAUNCH_BLOCKING=1`, {lb.cell.label}): **{lb.outcome}**; "
                f"first error: `{lb.first_error or '-'}`"
            )
            out.append(
                f"  - faulting kernel: **{lb.kernel or 'not named by the log'}**"
                + (f"; called from `{lb.user_frame}`" if lb.user_frame else "")
                + (f"; raised at `{lb.frame}`" if lb.frame and lb.frame != lb.user_frame else "")
            )
        cd = self.coredump_run
        if cd is not None:
            dumps = ", ".join(f"`{p}`" for p in cd.coredumps) or "none written"
            out.append(f"- core-dump rerun ({cd.cell.label}): **{cd.outcome}**; core dumps: {dumps}")
        for info in self.coredump_inspections:
            if info.get("available"):
                out.append(
                    f"  - cuda-gdb: {info.get('exception') or 'no exception line'}; kernel "
                    f"**{info.get('kernel') or '?'}**"
                )
        if self.kernel and (lb is None or self.kernel != lb.kernel):
            out.append(f"- faulting kernel (core dump): **{self.kernel}**")
        out += [
            "",
            "| pass | cuda_graph | speculative | deepep | outcome | exit | first error line | s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in [*self.cells, *self.reruns]:
            err = (r.first_error or r.note or "").replace("|", "\\|")
            if len(err) > 160:
                err = err[:157] + "..."
            exit_code = r.signal or ("" if r.returncode is None else r.returncode)
            out.append(
                f"| {r.pass_name} | {r.toggles['cuda_graph']} | {r.toggles['speculative']} | "
                f"{r.toggles['deepep']} | {r.outcome} | {exit_code} | {err} | {r.seconds:.1f} |"
            )
        if self.support:
            out += ["", "Toggles on this engine:", ""]
            out += [f"- `{s['toggle']}` ({s['applicable']}): {s['meaning']}" for s in self.support]
        out += [
            "",
            "## Reading a core dump",
            "",
            "```bash",
            'cuda-gdb -ex "target cudacore <file>"   # or: -batch -ex "info cuda kernels" -ex bt',
            "```",
            "",
            "cuda-gdb prints `CUDA Exception: Warp Illegal Address` (or the exception that fired), the kernel "
            "and PC (`The exception was triggered at PC ...`), and focuses the faulting thread: `info cuda "
            "kernels` lists the kernels on the device, `bt` the device stack, `disas $errorpc,+16` the faulting "
            "instruction, `info registers` the address it used. The dumps were taken with "
            f"`CUDA_COREDUMP_GENERATION_FLAGS={COREDUMP_GENERATION_FLAGS}` (device memory contents left "
            "out; drop a skip flag to keep that memory).",
        ]
        if self.coredumps:
            out += ["", "Core dumps:", ""] + [f"- `{p}`" for p in self.coredumps]
        return "\n".join(out) + "\n"


def host_context() -> dict:
    ctx: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "cuda_gdb": shutil.which("cuda-gdb"),
    }
    return ctx
