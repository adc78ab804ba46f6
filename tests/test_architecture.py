"""The layering of docs/architecture.md section 3 and the checkable nevers of section 12, enforced
(section 13 lists them): every module's imports (module-level and function-local) read with `ast`, and
the `rollflow.*` namespace checked from outside the checkout.

    flows -> infra -> tasks/* -> artifacts
    tasks/debug, tasks/recipes  above  tasks/rollout, tasks/train  above  tasks/sync, tasks/model, tasks/*.py

Also: the scan read enough modules per folder (a broken glob cannot pass vacuously); importing every
module of tasks/ and artifacts/ in a fresh process loads neither prefect nor ray; no import cycles among
module-level imports; no product file over MAX_LINES lines; no function-local import of a rollflow module.
Every rule has a self-test that plants a violation in a temporary tree and proves the rule trips.

A failure names the module, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("flows", "tasks", "artifacts", "infra")  # installed as rollflow.<folder>
THIRD_PARTY_FORBIDDEN = ("prefect", "ray")


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module, rollflow.tasks.rollout.worker
    target: str  # what it imports, absolute: rollflow.tasks.train.torch_backend.DTYPES
    path: str
    lineno: int
    local: bool  # inside a function or class body (a lazy import)
    type_only: bool = False  # under `if TYPE_CHECKING:` (never executed at run time)

    def where(self) -> str:
        return f"{self.path}:{self.lineno}, {'function-local' if self.local else 'module-level'}"


@dataclasses.dataclass(frozen=True)
class Violation:
    imp: Import
    rule: str

    def __str__(self) -> str:
        return f"{self.imp.module} imports {self.imp.target} ({self.imp.where()}): breaks rule: {self.rule}"


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "rollflow." + ".".join(parts)


def imports_of(source: str, module: str, path: str = "<source>", is_package: bool = False) -> Iterator[Import]:
    """Every import statement of `source`, anywhere in it; relative imports resolved against `module`."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, local: bool, type_only: bool = False) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, path, child.lineno, local, type_only)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (child.level - 1)]
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    yield Import(
                        module,
                        base if alias.name == "*" else f"{base}.{alias.name}",
                        path,
                        child.lineno,
                        local,
                        type_only,
                    )
            yield from visit(child, inner, type_only)

    yield from visit(tree, False)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _tasks_part(name: str) -> str | None:
    """'rollout', 'train', 'sync', 'model', 'debug', 'recipes', or 'shared' (tasks/*.py); None outside tasks/."""
    if not _under(name, "rollflow.tasks"):
        return None
    parts = name.split(".")
    if len(parts) < 3:
        return "shared"
    return parts[2] if parts[2] in ("rollout", "train", "sync", "model", "debug", "recipes") else "shared"


Rule = tuple[str, Callable[[str, str], bool]]  # (rule text, broken(importer, target))

RULES: list[Rule] = [
    (
        "artifacts/ (the data contract) imports nothing of rollflow outside artifacts/",
        lambda m, t: _under(m, "rollflow.artifacts") and _under(t, "rollflow") and not _under(t, "rollflow.artifacts"),
    ),
    (
        "tasks/ and artifacts/ import neither prefect nor ray (Prefect and Ray live in flows/ and infra/)",
        lambda m, t: (
            (_under(m, "rollflow.tasks") or _under(m, "rollflow.artifacts"))
            and any(_under(t, name) for name in THIRD_PARTY_FORBIDDEN)
        ),
    ),
    (
        "tasks/ does not import infra/ (flows -> infra -> tasks -> artifacts)",
        lambda m, t: _under(m, "rollflow.tasks") and _under(t, "rollflow.infra"),
    ),
    (
        "tasks/rollout and tasks/train do not import each other",
        lambda m, t: {_tasks_part(m), _tasks_part(t)} == {"rollout", "train"},
    ),
    (
        "tasks/model and the shared tasks/*.py modules sit below rollout, train and sync: they import only "
        "tasks/model, tasks/*.py and artifacts/",
        lambda m, t: _tasks_part(m) in ("model", "shared") and _tasks_part(t) not in (None, "model", "shared"),
    ),
    (
        "tasks/sync sits below tasks/rollout and tasks/train: it imports neither (what both sides need lives in "
        "tasks/sync, tasks/model or artifacts/)",
        lambda m, t: _tasks_part(m) == "sync" and _tasks_part(t) in ("rollout", "train"),
    ),
    (
        "tasks/rollout, tasks/train and tasks/sync do not import the debug toolkit (tasks/debug) or the "
        "whole-model recipes (tasks/recipes): those sit above them",
        lambda m, t: _tasks_part(m) in ("rollout", "train", "sync") and _tasks_part(t) in ("debug", "recipes"),
    ),
    (
        "nothing imports flows/ except flows/ itself (the CLI is in flows/)",
        lambda m, t: not _under(m, "rollflow.flows") and _under(t, "rollflow.flows"),
    ),
    (
        "flows/ does not import benchmarks/ (`rollflow bench` runs them as a subprocess)",
        lambda m, t: _under(m, "rollflow.flows") and _under(t, "benchmarks"),
    ),
    (
        "the package imports its folders only as rollflow.* (never the bare top-level flows, tasks, artifacts, infra)",
        lambda m, t: t.split(".")[0] in FOLDERS,
    ),
]


def check_imports(imports: Iterator[Import]) -> list[Violation]:
    return [Violation(imp, rule) for imp in imports for rule, broken in RULES if broken(imp.module, imp.target)]


def check_source(module: str, source: str, is_package: bool = False) -> list[Violation]:
    return check_imports(imports_of(textwrap.dedent(source), module, is_package=is_package))


def check_tree(root: Path) -> list[Violation]:
    """Every module under root/{flows,tasks,artifacts,infra}."""
    violations: list[Violation] = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(root, path)
            rel = path.relative_to(root).as_posix()
            violations += check_imports(imports_of(path.read_text(), module, rel, path.name == "__init__.py"))
    return violations


# ----------------------------------------------------------------------------- the rules hold


def test_layering_of_the_package() -> None:
    violations = check_tree(ROOT)
    assert not violations, "import rules broken:\n  " + "\n  ".join(map(str, violations))


def test_the_checker_reads_every_import() -> None:
    imports = {
        (i.target, i.local)
        for i in imports_of(
            textwrap.dedent("""
        import ray
        from . import sibling
        from ..train import losses
        def f():
            import prefect.artifacts
            from rollflow.flows import cli
        class C:
            def g(self):
                from .x import y
    """),
            "rollflow.tasks.rollout.worker",
        )
    }
    assert imports == {
        ("ray", False),
        ("rollflow.tasks.rollout.sibling", False),
        ("rollflow.tasks.train.losses", False),
        ("prefect.artifacts", True),
        ("rollflow.flows.cli", True),
        ("rollflow.tasks.rollout.x.y", True),
    }


# ----------------------------------------------------------------------------- the checker fails when it should


def test_checker_fails_on_a_forbidden_import(tmp_path: Path) -> None:
    """A synthetic tree with one forbidden import of each kind: every one is caught and named."""
    bad = {
        "tasks/rollout/bad.py": "def f():\n    from rollflow.tasks.train.torch_backend import DTYPES\n",
        "tasks/train/bad.py": "from ..rollout import sglang_engine\n",
        "tasks/model/bad.py": "from rollflow.tasks.rollout.prompts import PromptItem\n",
        "tasks/sync/bad.py": "from rollflow.tasks.debug import faults\n",
        "tasks/debug/bad.py": "def g():\n    import ray\n",
        "artifacts/bad.py": "from rollflow.tasks.train import batch\n",
        "artifacts/bad2.py": "import prefect\n",
        "infra/bad.py": "from rollflow.flows.config import RunConfig\n",
        "flows/bad.py": "from benchmarks.cli import main\n",
        "tasks/bad.py": "from rollflow.infra import workers\n",
        "tasks/sync/bad2.py": "from ..train.batch import TrainBatch\n",
        "flows/bare.py": "import tasks.rollout.worker\n",
    }
    for rel, source in bad.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    found = {(v.imp.module, v.imp.path): v for v in check_tree(tmp_path)}
    assert {path for _, path in found} == set(bad), found
    v = found[("rollflow.tasks.rollout.bad", "tasks/rollout/bad.py")]
    assert str(v) == (
        "rollflow.tasks.rollout.bad imports rollflow.tasks.train.torch_backend.DTYPES "
        "(tasks/rollout/bad.py:2, function-local): breaks rule: tasks/rollout and tasks/train do "
        "not import each other"
    )
    assert "prefect nor ray" in found[("rollflow.tasks.debug.bad", "tasks/debug/bad.py")].rule
    assert "subprocess" in found[("rollflow.flows.bad", "flows/bad.py")].rule
    assert "nothing imports flows/" in found[("rollflow.infra.bad", "infra/bad.py")].rule
    # and the real tree's rule check fails the same way when such a file is added
    assert check_source("rollflow.artifacts.store", "import ray\n")
    assert check_source("rollflow.tasks.sync.ipc", "from rollflow.tasks.train import batch\n")
    assert check_source("rollflow.tasks.sync.ipc", "def f():\n    from ..rollout.sglang import engine\n")
    assert not check_source("rollflow.tasks.sync.ipc", "from rollflow.tasks.model import dtypes\n")
    assert not check_source(
        "rollflow.tasks.debug.x", "from rollflow.tasks.rollout import worker\nfrom rollflow.tasks.train import worker\n"
    )


def test_the_layering_test_fails_when_a_forbidden_import_is_added(tmp_path: Path) -> None:
    """The package tree plus one offending module: `check_tree` (what test_layering_of_the_package runs) fails."""
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            dest = tmp_path / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text())
    assert check_tree(tmp_path) == []
    (tmp_path / "tasks" / "rollout" / "sneaky.py").write_text("def f():\n    import ray\n")
    [violation] = check_tree(tmp_path)
    assert "rollflow.tasks.rollout.sneaky imports ray" in str(violation)


# ----------------------------------------------------------------------------- one namespace


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_outside_the_checkout_only_rollflow_imports(tmp_path: Path) -> None:
    ok = _python("import rollflow.flows.train", tmp_path)
    assert ok.returncode == 0, ok.stderr
    for bare in FOLDERS:
        r = _python(f"import {bare}", tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (bare, r.stdout, r.stderr)


_WALK = """
import importlib, json, os, pkgutil, sys
skipped, failed = {}, {}
for top in ("flows", "tasks", "artifacts", "infra"):
    pkg = importlib.import_module("rollflow." + top)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=lambda name: None):
        if info.name.endswith(".__main__"):  # `python -m` entry points run their command when imported
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # optional GPU/extra dependencies (sglang, megatron, triton, ...)
            if (exc.name or "").split(".")[0] in ("rollflow", "flows", "tasks", "artifacts", "infra"):
                failed[info.name] = repr(exc)
            else:
                skipped[info.name] = exc.name
        except ImportError as exc:
            skipped[info.name] = repr(exc)
files = {}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    folders = [os.path.join(os.path.realpath(sys.argv[1]), top) + os.sep
               for top in ("flows", "tasks", "artifacts", "infra")]
    if f and any(os.path.realpath(f).startswith(d) for d in folders):
        files.setdefault(os.path.realpath(f), []).append(name)
print(json.dumps({"skipped": skipped, "failed": failed, "files": files,
                  "bare": sorted(n for n in sys.modules
                                 if n.split(".")[0] in ("flows", "tasks", "artifacts", "infra"))}))
"""


def test_every_module_loads_once_under_rollflow(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    r = subprocess.run(
        [sys.executable, "-c", _WALK, str(ROOT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["failed"], out["failed"]
    assert out["bare"] == [], f"modules loaded under a bare top-level name: {out['bare']}"
    twice = {f: names for f, names in out["files"].items() if len(names) > 1}
    assert not twice, f"modules loaded under two names: {twice}"
    names = [n for ns in out["files"].values() for n in ns]
    assert all(n.startswith("rollflow.") for n in names), [n for n in names if not n.startswith("rollflow.")]
    assert len(names) > 60, (len(names), out["skipped"])  # the walk really imported the package


# ----------------------------------------------------------------------------- the scan is not vacuous

# At least this many modules per folder (today: ~30 flows, ~110 tasks, 11 artifacts, 7 infra). A broken
# glob, a moved root or a renamed folder reads far fewer, and every other rule would pass on nothing.
MIN_MODULES = {"flows": 20, "tasks": 80, "artifacts": 9, "infra": 6}


def modules_per_folder(root: Path) -> dict[str, list[str]]:
    return {folder: [module_name(root, p) for p in sorted((root / folder).rglob("*.py"))] for folder in FOLDERS}


def check_counts(root: Path, minimums: dict[str, int] = MIN_MODULES) -> list[str]:
    found = modules_per_folder(root)
    return [
        f"{folder}/: the scan read {len(found.get(folder, []))} modules, expected at least {least} "
        "(a broken glob or a moved folder?)"
        for folder, least in minimums.items()
        if len(found.get(folder, [])) < least
    ]


def test_the_scan_reads_every_folder() -> None:
    problems = check_counts(ROOT)
    assert not problems, "\n".join(problems)


def test_count_guard_trips_on_a_thin_tree(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "one.py").write_text("x = 1\n")
    problems = check_counts(tmp_path)
    assert len(problems) == len(FOLDERS), problems
    assert any(p.startswith("tasks/: the scan read 1 modules") for p in problems), problems
    assert check_counts(tmp_path, {"tasks": 1}) == []


# ----------------------------------------------------------------------------- tasks/ + artifacts/ without prefect, ray

# Maps rollflow.<folder> onto <root>/<folder> (the checkout, or a planted tree), imports every module of the
# folders named, and reports each module whose import brought prefect or ray into sys.modules.
_FRESH = """
import importlib, importlib.util, json, pathlib, sys, types
root, folders, forbidden = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
pkg = types.ModuleType("rollflow"); pkg.__path__ = []; sys.modules["rollflow"] = pkg
for top in ("flows", "tasks", "artifacts", "infra"):
    init = root / top / "__init__.py"
    if init.exists():
        spec = importlib.util.spec_from_file_location("rollflow." + top, init,
                                                      submodule_search_locations=[str(root / top)])
        mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    else:
        mod = types.ModuleType("rollflow." + top); mod.__path__ = [str(root / top)]; sys.modules[mod.__name__] = mod
def loaded():
    return sorted(n for n in forbidden if n in sys.modules)
names = []
for top in folders:
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__main__":  # `python -m` entry points run their command when imported
            continue
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(["rollflow"] + parts))
offenders, skipped = {}, {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:  # an optional third-party dependency (megatron, sglang, triton, ...)
        skipped[name] = repr(exc)
    brought = loaded()
    if brought:
        offenders[name] = brought
        for key in list(sys.modules):  # forget them, so the next offender is found too
            if key.split(".")[0] in forbidden:
                del sys.modules[key]
print(json.dumps({"imported": len(names) - len(skipped), "offenders": offenders, "skipped": skipped}))
"""


def fresh_import_report(
    root: Path,
    folders: Sequence[str] = ("tasks", "artifacts"),
    forbidden: Sequence[str] = THIRD_PARTY_FORBIDDEN,
    extra_path: Sequence[str] = (),
    cwd: Path | None = None,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(extra_path)
    r = subprocess.run(
        [sys.executable, "-c", _FRESH, str(root), ",".join(folders), ",".join(forbidden)],
        cwd=cwd or root.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tasks_and_artifacts_import_without_prefect_and_ray(tmp_path: Path) -> None:
    out = fresh_import_report(ROOT, cwd=tmp_path)
    assert not out["offenders"], (
        "importing these loaded prefect or ray (tasks/ and artifacts/ must run on a "
        f"box with torch alone): {out['offenders']}"
    )
    assert out["imported"] >= MIN_MODULES["tasks"] + MIN_MODULES["artifacts"] - 10, out  # it really imported them


def test_fresh_import_check_trips(tmp_path: Path) -> None:
    """A planted tree whose modules import a (fake) prefect directly, and a (fake) ray through a sibling."""
    site = tmp_path / "site"
    for name in THIRD_PARTY_FORBIDDEN:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    tree = tmp_path / "tree"
    files = {
        "tasks/ok.py": "import json\n",
        "tasks/rollout/bad.py": "import prefect\n",
        "artifacts/helper.py": "import ray\n",
        "artifacts/uses_helper.py": "from . import helper\n",
        "artifacts/needs_extra.py": "import a_package_that_is_not_installed\n",
    }
    for rel, source in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(source)
    out = fresh_import_report(tree, extra_path=[str(site)], cwd=tmp_path)
    # helper sorts before uses_helper: the direct importer is the one named
    assert out["offenders"] == {"rollflow.tasks.rollout.bad": ["prefect"], "rollflow.artifacts.helper": ["ray"]}, out
    assert list(out["skipped"]) == ["rollflow.artifacts.needs_extra"], out


# ----------------------------------------------------------------------------- no import cycles


def import_graph(root: Path) -> dict[str, set[str]]:
    """rollflow module -> the rollflow modules it imports at module level (run-time imports only: function-
    local and `if TYPE_CHECKING:` imports left out). A target `pkg.mod.Name` resolves to its longest prefix
    that is a module; the parent packages an import runs implicitly are not edges."""
    modules: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            modules[module_name(root, path)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for imp in imports_of(path.read_text(), module, str(path), path.name == "__init__.py"):
            if imp.local or imp.type_only or not _under(imp.target, "rollflow"):
                continue
            parts = imp.target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != module:
                graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path (a -> b -> ... -> a) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan, iteratively (deep graphs would hit the recursion limit)
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == node:
                        break
                if len(component) > 1:
                    components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:
        start = min(component)
        # breadth-first inside the component: the shortest path from start back to start
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            nxt = []
            for node in frontier:
                for child in sorted(graph[node] & component):
                    if child not in previous:
                        previous[child] = node
                        nxt.append(child)
            frontier = nxt
        path = [start]
        node = previous[start]
        while node != start:
            path.append(node)
            node = previous[node]
        cycles.append([start] + path[1:][::-1] + [start])
    return cycles


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph(ROOT))
    assert not cycles, "import cycles (module-level imports):\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_cycle_check_trips_and_names_the_path(tmp_path: Path) -> None:
    files = {
        "tasks/a.py": "from rollflow.tasks.b import f\n",
        "tasks/b.py": "from . import c\n",
        "tasks/c.py": "import rollflow.tasks.a\n",
        "tasks/d.py": "from rollflow.tasks import a\ndef g():\n    from rollflow.tasks import d2\n",
        "tasks/d2.py": "from rollflow.tasks.d import g\n",  # d -> d2 is function-local: no cycle
        "tasks/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollflow.tasks.e2 import X\n",
        "tasks/e2.py": "from rollflow.tasks.e import TYPE_CHECKING\n",  # e -> e2 is type-only: no cycle
    }
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert find_cycles(import_graph(tmp_path)) == [
        ["rollflow.tasks.a", "rollflow.tasks.b", "rollflow.tasks.c", "rollflow.tasks.a"]
    ]


# ----------------------------------------------------------------------------- no file over MAX_LINES

MAX_LINES = 800


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root).as_posix()}: {n} lines (limit {limit}: split it into a wing)")
    return out


def test_no_product_file_over_the_limit() -> None:
    too_long = long_files(ROOT)
    assert not too_long, "\n".join(too_long)


def test_line_limit_trips(tmp_path: Path) -> None:
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "infra" / "fine.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"infra/big.py: {MAX_LINES + 1} lines (limit {MAX_LINES}: split it into a wing)"]


# ----------------------------------------------------------------------------- no function-local rollflow imports

# (importing module, imported module or name) pairs allowed to stay function-local, each only because the rollflow
# module imports an optional third-party dependency at its top; keep it short and give the reason. A function-local
# import of an optional third-party dependency itself (megatron, sglang, a tracking backend) is fine and not
# listed: this rule is about rollflow's own modules.
LOCAL_IMPORT_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        # ima_kernels imports triton at its top; only the reproducer's `triton_oob` fault needs it (CUDA boxes).
        ("rollflow.tasks.debug.ima_repro", "rollflow.tasks.debug.ima_kernels.oob_store"),
        # The CLI's command modules (flows/cli/) import the flows, and the tasks/ modules that bring torch, when a
        # command runs, so that `rollflow --help` and a mistyped option answer at once. Measured (2-core box, loaded):
        # these lazy, `rollflow --help` costs 0.8-0.9 s CPU; importing them at module level loads torch, prefect and ray
        # and costs 4.4-5.0 s CPU (11-21 s wall under load; idle box before: 0.25 s wall). Everything light that the CLI
        # uses is imported at module level. An entry names a target module: it covers the names imported from it.
        ("rollflow.flows.cli.common", "rollflow.flows.config_loading"),
        ("rollflow.flows.cli.align", "rollflow.flows.alignment"),
        ("rollflow.flows.cli.align", "rollflow.flows.preflight"),
        ("rollflow.flows.cli.align", "rollflow.tasks.debug.alignment"),
        ("rollflow.flows.cli.bisect", "rollflow.flows.bisect"),
        ("rollflow.flows.cli.bisect", "rollflow.flows.preflight"),
        ("rollflow.flows.cli.root", "rollflow.flows.debug"),
        ("rollflow.flows.cli.root", "rollflow.flows.params"),
        ("rollflow.flows.cli.root", "rollflow.flows.prefect_ops.submit"),
        ("rollflow.flows.cli.root", "rollflow.flows.preflight"),
        ("rollflow.flows.cli.root", "rollflow.flows.progress"),
        ("rollflow.flows.cli.root", "rollflow.flows.reporting"),
        ("rollflow.flows.cli.root", "rollflow.flows.cli.stage"),
        ("rollflow.flows.cli.drill", "rollflow.flows.preflight"),
        ("rollflow.flows.cli.drill", "rollflow.flows.resume_drill"),
        ("rollflow.flows.cli.root", "rollflow.flows.train"),
        ("rollflow.flows.cli.root", "rollflow.tasks.recipes.sft"),
        ("rollflow.flows.cli.services", "rollflow.flows.prefect_ops.deployments"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.debug.replay_reward"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.debug.send"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.rollout.engine"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.rollout.rewards"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.rollout.settings"),
        ("rollflow.flows.cli.tools", "rollflow.tasks.rollout.worker"),
    }
)


def local_rollflow_imports(root: Path, allowed: frozenset[tuple[str, str]] = LOCAL_IMPORT_ALLOWED) -> list[Import]:
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(root, path)
            rel = path.relative_to(root).as_posix()
            for imp in imports_of(path.read_text(), module, rel, path.name == "__init__.py"):
                if (
                    imp.local
                    and _under(imp.target, "rollflow")
                    and not any(imp.module == importer and _under(imp.target, target) for importer, target in allowed)
                ):
                    found.append(imp)
    return found


def test_no_function_local_rollflow_imports() -> None:
    found = local_rollflow_imports(ROOT)
    modules = sorted({i.module for i in found})
    assert not found, (
        f"{len(found)} function-local imports of rollflow modules in {len(modules)} modules (import "
        "at module level; only optional third-party dependencies stay function-local):\n  "
        + "\n  ".join(f"{i.where()}: {i.target}" for i in found)
    )


def test_local_import_check_trips(tmp_path: Path) -> None:
    (tmp_path / "tasks" / "train").mkdir(parents=True)
    (tmp_path / "tasks" / "train" / "lazy.py").write_text(
        textwrap.dedent("""
        import torch
        from rollflow.tasks.model import dtypes

        def build():
            import megatron.core                       # optional third-party: fine
            from rollflow.tasks.model.tiny import load_model
            return load_model

        class Backend:
            def f(self):
                from .batch import TrainBatch
    """)
    )
    found = local_rollflow_imports(tmp_path)
    assert [(i.target, i.lineno) for i in found] == [
        ("rollflow.tasks.model.tiny.load_model", 7),
        ("rollflow.tasks.train.batch.TrainBatch", 12),
    ]
    assert "tasks/train/lazy.py:7, function-local" in found[0].where()
    allowed = frozenset(
        {
            ("rollflow.tasks.train.lazy", "rollflow.tasks.model.tiny.load_model"),
            ("rollflow.tasks.train.lazy", "rollflow.tasks.train.batch.TrainBatch"),
        }
    )
    assert local_rollflow_imports(tmp_path, allowed) == []
