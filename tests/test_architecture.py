"""The layering of DESIGN.md section 1, enforced: every module's imports (module-level and
function-local) read with `ast`, and the `rollflow.*` namespace checked from outside the checkout.

    flows -> infra -> tasks/* -> artifacts
    tasks/debug, tasks/recipes  above  tasks/rollout, tasks/train  above  tasks/model, tasks/*.py
    (tasks/sync may import rollout and train)

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
from typing import Callable, Iterator

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

    def visit(node: ast.AST, local: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, path, child.lineno, local)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (child.level - 1)]
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    yield Import(module, base if alias.name == "*" else f"{base}.{alias.name}", path, child.lineno,
                                 local)
            yield from visit(child, inner)

    yield from visit(tree, False)


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
    ("artifacts/ (the data contract) imports nothing of rollflow outside artifacts/",
     lambda m, t: _under(m, "rollflow.artifacts") and _under(t, "rollflow") and not _under(t, "rollflow.artifacts")),
    ("tasks/ and artifacts/ import neither prefect nor ray (Prefect and Ray live in flows/ and infra/)",
     lambda m, t: (_under(m, "rollflow.tasks") or _under(m, "rollflow.artifacts"))
     and any(_under(t, name) for name in THIRD_PARTY_FORBIDDEN)),
    ("tasks/ does not import infra/ (flows -> infra -> tasks -> artifacts)",
     lambda m, t: _under(m, "rollflow.tasks") and _under(t, "rollflow.infra")),
    ("tasks/rollout and tasks/train do not import each other",
     lambda m, t: {_tasks_part(m), _tasks_part(t)} == {"rollout", "train"}),
    ("tasks/model and the shared tasks/*.py modules sit below rollout, train and sync: they import only "
     "tasks/model, tasks/*.py and artifacts/",
     lambda m, t: _tasks_part(m) in ("model", "shared") and _tasks_part(t) not in (None, "model", "shared")),
    ("tasks/rollout, tasks/train and tasks/sync do not import the debug toolkit (tasks/debug) or the "
     "whole-model recipes (tasks/recipes): those sit above them",
     lambda m, t: _tasks_part(m) in ("rollout", "train", "sync") and _tasks_part(t) in ("debug", "recipes")),
    ("nothing imports flows/ except flows/ itself (the CLI is in flows/)",
     lambda m, t: not _under(m, "rollflow.flows") and _under(t, "rollflow.flows")),
    ("flows/ does not import benchmarks/ (`rollflow bench` runs them as a subprocess)",
     lambda m, t: _under(m, "rollflow.flows") and _under(t, "benchmarks")),
    ("the package imports its folders only as rollflow.* (never the bare top-level flows, tasks, artifacts, infra)",
     lambda m, t: t.split(".")[0] in FOLDERS),
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
    imports = {(i.target, i.local) for i in imports_of(textwrap.dedent("""
        import ray
        from . import sibling
        from ..train import losses
        def f():
            import prefect.artifacts
            from rollflow.flows import cli
        class C:
            def g(self):
                from .x import y
    """), "rollflow.tasks.rollout.worker")}
    assert imports == {
        ("ray", False), ("rollflow.tasks.rollout.sibling", False), ("rollflow.tasks.train.losses", False),
        ("prefect.artifacts", True), ("rollflow.flows.cli", True), ("rollflow.tasks.rollout.x.y", True),
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
        "flows/bare.py": "import tasks.rollout.worker\n",
    }
    for rel, source in bad.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    found = {(v.imp.module, v.imp.path): v for v in check_tree(tmp_path)}
    assert {path for _, path in found} == set(bad), found
    v = found[("rollflow.tasks.rollout.bad", "tasks/rollout/bad.py")]
    assert str(v) == ("rollflow.tasks.rollout.bad imports rollflow.tasks.train.torch_backend.DTYPES "
                      "(tasks/rollout/bad.py:2, function-local): breaks rule: tasks/rollout and tasks/train do "
                      "not import each other")
    assert "prefect nor ray" in found[("rollflow.tasks.debug.bad", "tasks/debug/bad.py")].rule
    assert "subprocess" in found[("rollflow.flows.bad", "flows/bad.py")].rule
    assert "nothing imports flows/" in found[("rollflow.infra.bad", "infra/bad.py")].rule
    # and the real tree's rule check fails the same way when such a file is added
    assert check_source("rollflow.artifacts.store", "import ray\n")
    assert not check_source("rollflow.tasks.sync.ipc", "from rollflow.tasks.train import batch\n")  # allowed
    assert not check_source("rollflow.tasks.debug.x", "from rollflow.tasks.rollout import worker\n"
                                                      "from rollflow.tasks.train import worker\n")


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
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


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
    folders = [os.path.join(os.path.realpath(sys.argv[1]), top) + os.sep for top in ("flows", "tasks", "artifacts", "infra")]
    if f and any(os.path.realpath(f).startswith(d) for d in folders):
        files.setdefault(os.path.realpath(f), []).append(name)
print(json.dumps({"skipped": skipped, "failed": failed, "files": files,
                  "bare": sorted(n for n in sys.modules if n.split(".")[0] in ("flows", "tasks", "artifacts", "infra"))}))
"""


def test_every_module_loads_once_under_rollflow(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    r = subprocess.run([sys.executable, "-c", _WALK, str(ROOT)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["failed"], out["failed"]
    assert out["bare"] == [], f"modules loaded under a bare top-level name: {out['bare']}"
    twice = {f: names for f, names in out["files"].items() if len(names) > 1}
    assert not twice, f"modules loaded under two names: {twice}"
    names = [n for ns in out["files"].values() for n in ns]
    assert all(n.startswith("rollflow.") for n in names), [n for n in names if not n.startswith("rollflow.")]
    assert len(names) > 60, (len(names), out["skipped"])  # the walk really imported the package
