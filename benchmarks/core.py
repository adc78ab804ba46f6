"""What every suite shares: figures with min/median/max over repeats, goals, machine info, the JSON.

Importable with the standard library alone (the GPU box has no Prefect or Ray); torch and rich are
imported where they are used.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

T = TypeVar("T")

SCHEMA = "rollflow.bench/1"
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Goal:
    """`value op target`, e.g. overhead <= 0.02 or ratio >= 0.9."""

    op: str  # ">=" or "<="
    target: float
    text: str = ""

    def met(self, value: float) -> bool:
        return value >= self.target if self.op == ">=" else value <= self.target

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "target": self.target, "text": self.text or f"{self.op} {self.target:g}"}


@dataclasses.dataclass
class Figure:
    """One measured quantity: every repeat's value, summarised as min / median / max."""

    name: str
    unit: str
    values: list[float]
    goal: Optional[Goal] = None
    kind: str = "value"  # "value" | "ratio"
    note: str = ""
    limit: str = ""  # what limits it, when it misses its goal

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def met(self) -> Optional[bool]:
        return None if self.goal is None or not self.values else self.goal.met(self.median)

    def to_dict(self) -> dict[str, Any]:
        vals = [float(v) for v in self.values]
        out: dict[str, Any] = {
            "name": self.name,
            "unit": self.unit,
            "kind": self.kind,
            "n": len(vals),
            "min": min(vals) if vals else None,
            "median": self.median if vals else None,
            "max": max(vals) if vals else None,
            "values": vals,
        }
        if self.goal is not None:
            out["goal"] = self.goal.to_dict()
            out["meets_goal"] = self.met
            if self.goal.op == ">=":
                out["gap"] = self.median / self.goal.target if vals else None  # fraction of the goal reached
            else:
                out["gap"] = self.median - self.goal.target if vals else None  # excess over the goal
        if self.note:
            out["note"] = self.note
        if self.limit:
            out["limit"] = self.limit
        return out


class SuiteResult:
    """Figures, parameters and notes of one suite."""

    def __init__(self, name: str, title: str):
        self.name = name
        self.title = title
        self.params: dict[str, Any] = {}
        self.figures: list[Figure] = []
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}  # engine/backend/path -> why it did not run
        self.data: dict[str, Any] = {}  # raw measurements behind the figures (e.g. every iteration's stages)
        self.error: Optional[str] = None
        self.elapsed_s: float = 0.0

    def add(
        self,
        name: str,
        unit: str,
        values: Iterable[float],
        *,
        goal: Optional[Goal] = None,
        kind: str = "value",
        note: str = "",
        limit: str = "",
    ) -> Figure:
        fig = Figure(name, unit, [float(v) for v in values], goal, kind, note, limit)
        self.figures.append(fig)
        return fig

    def ratio(
        self,
        name: str,
        values: Iterable[float],
        *,
        goal: Optional[Goal] = None,
        note: str = "",
        limit: str = "",
        unit: str = "x",
    ) -> Figure:
        return self.add(name, unit, values, goal=goal, kind="ratio", note=note, limit=limit)

    def figure(self, name: str) -> Optional[Figure]:
        return next((f for f in self.figures if f.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "title": self.title,
            "params": self.params,
            "figures": [f.to_dict() for f in self.figures],
            "notes": self.notes,
            "elapsed_s": round(self.elapsed_s, 2),
        }
        if self.unavailable:
            out["unavailable"] = self.unavailable
        if self.data:
            out["data"] = self.data
        if self.error:
            out["error"] = self.error
        return out


@dataclasses.dataclass
class BenchContext:
    """Options and shared services of one `python -m benchmarks` run."""

    quick: bool = False
    repeats: Optional[int] = None  # None: each suite's default (fewer with --quick)
    workdir: Path = Path("/tmp")
    device: str = "cpu"
    services: Any = None  # benchmarks.services.Services, only for suites that need Prefect/Ray/S3
    results: dict[str, SuiteResult] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def n(self, full: int, quick: int) -> int:
        if self.repeats is not None:
            return max(1, self.repeats)
        return quick if self.quick else full


# ----------------------------------------------------------------------------- timing


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [x / y for x, y in zip(num, den) if y > 0]


# ----------------------------------------------------------------------------- provenance


def git_sha(repo: Path = REPO) -> Optional[str]:
    """HEAD's commit read from .git files (no git process); None outside a checkout."""
    env = os.environ.get("ROLLFLOW_GIT_SHA")
    if env:
        return env
    git = repo / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git
        if (git / "commondir").exists():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in (git, common):
            if (base / ref).exists():
                return (base / ref).read_text().strip()
        for base in (git, common):
            packed = base / "packed-refs"
            if packed.exists():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        return None
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_gib": _mem_gib(),
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
            info["cuda"] = torch.version.cuda
    except Exception as exc:  # noqa: BLE001 - provenance is best effort
        info["torch_error"] = repr(exc)
    return info


VERSIONED = (
    "torch",
    "transformers",
    "prefect",
    "ray",
    "fsspec",
    "s3fs",
    "moto",
    "pyarrow",
    "pydantic",
    "megatron-core",
    "sglang",
    "rich",
)


def versions() -> dict[str, Optional[str]]:
    import importlib.metadata as md

    out: dict[str, Optional[str]] = {}
    for name in VERSIONED:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["rollflow"] = md.version("rollflow")
    except md.PackageNotFoundError:
        out["rollflow"] = None
    return out


# ----------------------------------------------------------------------------- output


def fmt(value: Optional[float], unit: str = "") -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    if unit in ("%", "fraction"):
        return f"{100 * value:.2f}%"
    a = abs(value)
    if a == 0:
        return "0"
    if a >= 1e5:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.0f}"
    if a >= 1:
        return f"{value:.3g}" if a < 10 else f"{value:.1f}"
    return f"{value:.3g}"


def unit_label(unit: str) -> str:
    return "" if unit == "fraction" else unit


def print_report(report: dict[str, Any], console=None) -> None:
    """One rich table per run: every figure with min / median / max and its goal."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and CI: wide enough that names are not wrapped
            console = Console(width=200)
    table = Table(
        title=f"rollflow benchmarks ({report['machine'].get('gpu') or report['machine']['cpu']})", show_lines=False
    )
    for col, just in (
        ("suite", "left"),
        ("figure", "left"),
        ("median", "right"),
        ("min", "right"),
        ("max", "right"),
        ("unit", "left"),
        ("goal", "left"),
        ("", "left"),
    ):
        # Figure names are what people grep for: never wrapped; the status column folds instead.
        table.add_column(col, justify=just, no_wrap=col != "", overflow="fold" if col == "" else "ellipsis")
    for suite_name, suite in report["suites"].items():
        first = True
        for fig in suite["figures"]:
            goal = fig.get("goal")
            status = ""
            if goal is not None:
                status = "[green]ok[/]" if fig.get("meets_goal") else "[red]miss[/]"
            name = fig["name"] if fig["kind"] != "ratio" else f"[bold]{fig['name']}[/]"
            table.add_row(
                suite_name if first else "",
                name,
                fmt(fig["median"], fig["unit"]),
                fmt(fig["min"], fig["unit"]),
                fmt(fig["max"], fig["unit"]),
                unit_label(fig["unit"]),
                goal["text"] if goal else "",
                status,
            )
            first = False
        for what, why in suite.get("unavailable", {}).items():
            table.add_row(
                suite_name if first else "", f"[dim]{what}[/]", "-", "", "", "", "", f"[dim]n/a: {why[:60]}[/]"
            )
            first = False
        if suite.get("error"):
            table.add_row(suite_name if first else "", "[red]error[/]", "", "", "", "", "", suite["error"][:80])
        table.add_section()
    console.print(table)
    for suite_name, suite in report["suites"].items():
        for fig in suite["figures"]:
            if fig.get("meets_goal") is False and fig.get("limit"):
                console.print(f"[yellow]{suite_name}/{fig['name']}[/] misses {fig['goal']['text']}: {fig['limit']}")
        for note in suite.get("notes", []):
            console.print(f"[dim]{suite_name}: {note}[/]")


def default_out(device: str) -> Path:
    stamp = _dt.date.today().isoformat()
    prefix = "cpu"
    if device.startswith("cuda"):
        try:
            import torch

            name = torch.cuda.get_device_name(0)
            prefix = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"
        except Exception:  # noqa: BLE001
            prefix = "gpu"
    return REPO / "benchmarks" / "results" / f"{prefix}-{stamp}.json"


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")


def report_header(command: str, device: str, **fields: Any) -> dict[str, Any]:
    """What every report starts with: the command, the device, the code and the machine it ran on. `fields` come
    after the device; `suites` is filled by the caller."""
    return {
        "schema": SCHEMA,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": device,
        **fields,
        "git_sha": git_sha(),
        "machine": machine_info(),
        "versions": versions(),
        "suites": {},
    }


def run_standalone(
    name: str, title: str, workdir: Optional[Path], prefix: str, fn: Callable[[Path, SuiteResult], T]
) -> tuple[SuiteResult, Optional[T]]:
    """One suite run by its own script (a GPU benchmark without the suite runner): `fn(workdir, suite)` in
    `workdir` (kept) or a temporary folder (removed). A failure is recorded in `suite.error` with its traceback
    printed: what was measured before it stays in the suite."""
    suite = SuiteResult(name, title)
    started = time.perf_counter()
    result: Optional[T] = None
    try:
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True)
            result = fn(workdir, suite)
        else:
            with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
                result = fn(Path(tmp), suite)
    except Exception as exc:  # noqa: BLE001 - the JSON keeps what was measured before the failure
        traceback.print_exc()
        suite.error = f"{type(exc).__name__}: {exc}"
    suite.elapsed_s = time.perf_counter() - started
    return suite, result


def finish_report(report: dict[str, Any], suite: SuiteResult, out: Path, *, table: bool = True) -> None:
    """Add the suite and its time to the report, write the JSON, print the table (rich is not on every GPU box:
    without it the JSON has it all)."""
    report["suites"][suite.name] = suite.to_dict()
    report["elapsed_s"] = round(suite.elapsed_s, 1)
    write_json(report, out)
    if table:
        try:
            print_report(report)
        except ImportError:
            pass
    print(f"wrote {out}", file=sys.stderr)
