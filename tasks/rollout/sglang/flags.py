"""SGLang server flags: the committed list, validation of passthrough flags, and its generator.

`flags.txt` (next to this file) lists every command-line flag of `python -m
sglang.launch_server` for one SGLang release. It is generated *statically* from SGLang's source
(nothing is imported, so it works on a CPU box where SGLang cannot be installed: its wheel pins a
CUDA torch):

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    python -m rollflow.tasks.rollout.sglang.flags --wheel /tmp/sgl/sglang-0.5.23-*.whl     # rewrites the list
    python -m rollflow.tasks.rollout.sglang.flags --source /path/to/site-packages/sglang   # or an unpacked tree

How SGLang 0.5.x declares its flags (what the extractor reads):
- `sglang/srt/server_args.py` lists the field namespaces in `_INPUT_NAMESPACES` and imports each
  class from `sglang/srt/arg_groups/fields/<module>.py`;
- each namespace field `name: A[T, "help"]` or `A[T, Arg(...)]` becomes `--name-with-dashes` (or
  `Arg(cli_name=...)`, plus `Arg(aliases=[...])`) unless `Arg(no_cli=True)`; a `bool` field is a
  switch, `argparse.BooleanOptionalAction` adds `--no-<name>`, a `List[...]` field takes values;
- `ServerArgs.add_cli_args` registers a few more by hand (`parser.add_argument("--...")`), among
  them the deprecated spellings (`--disable-cuda-graph`).

`tests/test_sglang_contract.py` checks the extractor against the live argparse parser of an
installed SGLang when one is present (a GPU box), and skips otherwise.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import re
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping

FLAGS_FILE = Path(__file__).with_name("flags.txt")
CLI_PREFIX = "--sglang-"

SWITCH, VALUE, LIST = "switch", "value", "list"
KINDS = (SWITCH, VALUE, LIST)


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    flag: str  # "--tp-size"
    kind: str  # switch (no value) | value (one value) | list (one or more values)
    field: str  # ServerArgs field it sets
    deprecated: bool = False
    alias_of: str | None = None  # the canonical flag when this is an alias / --no- form

    @property
    def key(self) -> str:
        """The config key: the flag without dashes prefix ("tp-size")."""
        return self.flag[2:]


class UnknownSGLangFlag(ValueError):
    """A passthrough flag that SGLang's server does not have."""


# ----------------------------------------------------------------------------------------------
# The committed list
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlagList:
    version: str
    flags: dict[str, FlagSpec]  # by flag ("--tp-size")

    def get(self, key: str) -> FlagSpec | None:
        return self.flags.get(normalize_key(key))

    def closest(self, key: str, n: int = 3) -> list[str]:
        flag = normalize_key(key)
        return difflib.get_close_matches(flag, list(self.flags), n=n, cutoff=0.5)


def normalize_key(key: str) -> str:
    """'disable_cuda_graph', 'disable-cuda-graph' or '--disable-cuda-graph' -> '--disable-cuda-graph'."""
    key = key.strip()
    if key.startswith(CLI_PREFIX):
        key = key[len(CLI_PREFIX) :]
    return "--" + key.lstrip("-").replace("_", "-")


def parse_flag_file(text: str) -> FlagList:
    version = "unknown"
    flags: dict[str, FlagSpec] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = re.match(r"#\s*sglang_version:\s*(\S+)", line)
            if m:
                version = m.group(1)
            continue
        parts = line.split("\t")
        if len(parts) < 3 or parts[1] not in KINDS:
            raise ValueError(f"{FLAGS_FILE.name}: malformed line {raw!r}")
        notes = parts[3].split(",") if len(parts) > 3 and parts[3] else []
        alias_of = next((n.split("=", 1)[1] for n in notes if n.startswith("alias_of=")), None)
        flags[parts[0]] = FlagSpec(parts[0], parts[1], parts[2], "deprecated" in notes, alias_of)
    return FlagList(version, flags)


@functools.cache  # the shipped file does not change while a process runs
def load_flags(path: Path = FLAGS_FILE) -> FlagList:
    return parse_flag_file(path.read_text())


def format_flag_file(flags: Iterable[FlagSpec], version: str, source: str) -> str:
    lines = [
        "# SGLang server flags (python -m sglang.launch_server), generated statically from SGLang's source.",
        "# Regenerate: python -m rollflow.tasks.rollout.sglang.flags --wheel sglang-<version>-*.whl",
        f"# sglang_version: {version}",
        f"# source: {source}",
        "# columns: flag<TAB>kind (switch | value | list)<TAB>ServerArgs field<TAB>notes",
    ]
    for spec in sorted(flags, key=lambda s: s.flag):
        notes = []
        if spec.deprecated:
            notes.append("deprecated")
        if spec.alias_of:
            notes.append(f"alias_of={spec.alias_of}")
        lines.append("\t".join([spec.flag, spec.kind, spec.field] + ([",".join(notes)] if notes else [])))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Validation of passthrough args -> command-line arguments
# ----------------------------------------------------------------------------------------------


def check_flag(key: str, flags: FlagList | None = None) -> FlagSpec:
    flags = flags or load_flags()
    spec = flags.get(key)
    if spec is None:
        flag = normalize_key(key)
        close = flags.closest(key)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UnknownSGLangFlag(
            f"unknown SGLang server flag {flag} (from {key!r}){hint} "
            f"({len(flags.flags)} flags known for sglang {flags.version}: tasks/rollout/sglang/flags.txt)"
        )
    return spec


def validate_args(args: Mapping[str, Any], flags: FlagList | None = None) -> dict[str, Any]:
    """Normalized {flag-key: value} of passthrough args; an unknown flag or a bad value is an error."""
    flags = flags or load_flags()
    out: dict[str, Any] = {}
    for key, value in args.items():
        spec = check_flag(key, flags)
        if spec.kind == SWITCH and not isinstance(value, bool):
            raise ValueError(f"SGLang flag {spec.flag} is a switch: give true or false, not {value!r}")
        if spec.kind == VALUE and isinstance(value, (list, tuple)):
            raise ValueError(f"SGLang flag {spec.flag} takes one value, got a list {value!r}")
        out[spec.key] = value
    return out


def args_to_argv(args: Mapping[str, Any], flags: FlagList | None = None) -> list[str]:
    """Validated passthrough args as argv: switches appear when true, values follow their flag."""
    import json

    flags = flags or load_flags()
    argv: list[str] = []
    for key, value in validate_args(args, flags).items():
        spec = flags.get(key)
        if spec.kind == SWITCH:
            if value:
                argv.append(spec.flag)
        elif value is None:
            continue
        elif spec.kind == LIST:
            values = value if isinstance(value, (list, tuple)) else [value]
            argv.append(spec.flag)
            argv.extend(_scalar(v) for v in values)
        else:
            argv.extend([spec.flag, json.dumps(value) if isinstance(value, dict) else _scalar(value)])
    return argv


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def rewrite_cli_args(
    argv: list[str], *, target: str = "rollout.sglang.args", flags: FlagList | None = None
) -> list[str]:
    """`--sglang-<flag>[=value]` / `--sglang-<flag> value` -> `--set rollout.sglang.args.<flag>=value`.

    Switches need no value (`--sglang-disable-cuda-graph`); an unknown flag is an error naming the
    closest known ones.
    """
    flags = flags or load_flags()
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(CLI_PREFIX):
            out.append(arg)
            i += 1
            continue
        name, eq, value = arg.partition("=")
        spec = check_flag(name, flags)
        if spec.kind == SWITCH:
            value = value if eq else "true"
        elif not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value (SGLang flag {spec.flag})")
            i += 1
            value = argv[i]
        out.extend(["--set", f"{target}.{spec.key}={value}"])
        i += 1
    return out


# ----------------------------------------------------------------------------------------------
# Static extraction from SGLang's source (no import)
# ----------------------------------------------------------------------------------------------


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _literal(node: ast.AST | None, default: Any = None) -> Any:
    if node is None:
        return default
    try:
        return ast.literal_eval(node)
    except ValueError:
        return default


def _dict_keys(node: ast.AST | None) -> dict[str, Any]:
    """Literal values of a dict display whose other values may be names (`{"type": str, "nargs": "*"}`)."""
    if not isinstance(node, ast.Dict):
        return {}
    out = {}
    for k, v in zip(node.keys, node.values):
        if isinstance(k, ast.Constant) and isinstance(k.value, str):
            out[k.value] = _literal(v, None)
    return out


def _unwrap_optional(node: ast.AST) -> ast.AST:
    if isinstance(node, ast.Subscript) and _call_name(node.value) == "Optional":
        return node.slice
    if isinstance(node, ast.Subscript) and _call_name(node.value) == "Union":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        rest = [e for e in elts if not (isinstance(e, ast.Constant) and e.value is None)]
        if len(rest) == 1:
            return rest[0]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [node.left, node.right]
        rest = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
        if len(rest) == 1:
            return rest[0]
    return node


def _field_flags(name: str, annotation: ast.AST) -> list[FlagSpec]:
    """Flags of one namespace field `name: A[T, help-or-Arg]` (empty when it has no CLI)."""
    if not (isinstance(annotation, ast.Subscript) and _call_name(annotation.value) in ("A", "Annotated")):
        return []
    elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    type_node, meta = elts[0], elts[1:]
    arg_call = next((m for m in meta if isinstance(m, ast.Call) and _call_name(m.func) == "Arg"), None)
    has_help = any(isinstance(m, ast.Constant) and isinstance(m.value, str) for m in meta)
    has_help = has_help or any(isinstance(m, (ast.JoinedStr, ast.BinOp)) for m in meta)
    if arg_call is None and not has_help:
        return []
    cli_name = "--" + name.replace("_", "-")
    aliases: list[str] = []
    kind = VALUE
    negatable = deprecated = False
    if arg_call is not None:
        if _literal(_kw(arg_call, "no_cli"), False):
            return []
        cli_name = _literal(_kw(arg_call, "cli_name"), None) or cli_name
        aliases = list(_literal(_kw(arg_call, "aliases"), None) or [])
        action = _kw(arg_call, "action")
        nargs = _literal(_kw(arg_call, "nargs"), None)
        type_parser = _kw(arg_call, "type_parser")
        help_text = _literal(_kw(arg_call, "help"), "") or ""
        deprecated = str(help_text).lower().lstrip("(").startswith("deprecated")
        inner = _unwrap_optional(type_node)
        if action is not None:
            action_name = _call_name(action)
            action_kwargs = _dict_keys(_kw(arg_call, "action_kwargs"))
            if action_name == "BooleanOptionalAction":
                kind, negatable = SWITCH, True
            elif action_name in ("store_true", "store_false", "store_const") or "StoreTrue" in action_name:
                kind = SWITCH
            elif action_kwargs.get("nargs") in ("+", "*"):
                kind = LIST
            deprecated = deprecated or action_name.startswith("Deprecated")
        elif isinstance(inner, ast.Subscript) and _call_name(inner.value) == "Literal":
            kind = VALUE
        elif isinstance(inner, ast.Subscript) and _call_name(inner.value) in ("List", "list") and type_parser is None:
            kind = LIST
        elif _call_name(inner) == "bool":
            kind = SWITCH
        elif nargs in ("+", "*"):
            kind = LIST
    else:
        inner = _unwrap_optional(type_node)
        if _call_name(inner) == "bool":
            kind = SWITCH
        elif isinstance(inner, ast.Subscript) and _call_name(inner.value) in ("List", "list"):
            kind = LIST
    specs = [FlagSpec(cli_name, kind, name, deprecated)]
    specs += [FlagSpec(a, kind, name, deprecated, cli_name) for a in aliases]
    if negatable:
        specs += [FlagSpec("--no-" + f[2:], SWITCH, name, deprecated, cli_name) for f in [cli_name, *aliases]]
    return specs


def _class_fields(tree: ast.Module, class_name: str) -> list[tuple[str, ast.AST]]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [
                (stmt.target.id, stmt.annotation)
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            ]
    raise ValueError(f"class {class_name} not found")


def _manual_flags(tree: ast.Module) -> list[FlagSpec]:
    """`parser.add_argument("--x", ...)` calls inside `ServerArgs.add_cli_args`."""
    specs: list[FlagSpec] = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"):
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                if _call_name(call.func) != "add_argument":
                    continue
                names = [
                    a.value
                    for a in call.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")
                ]
                if not names:
                    continue
                action = _call_name(_kw(call, "action")) if _kw(call, "action") is not None else ""
                nargs_node = _kw(call, "nargs")
                nargs = _literal(nargs_node, None)
                if action in ("store_true", "store_false", "store_const", "BooleanOptionalAction"):
                    kind = SWITCH
                elif action.startswith("Deprecated") and (nargs_node is None or nargs == 0):
                    # the deprecated actions default to nargs=0 (a switch); nargs=None takes a value
                    kind = SWITCH
                elif nargs in ("+", "*"):
                    kind = LIST
                else:
                    kind = VALUE
                dest = _literal(_kw(call, "dest"), None) or names[0][2:].replace("-", "_")
                help_text = str(_literal(_kw(call, "help"), "") or "")
                deprecated = action.startswith("Deprecated") or "deprecated" in help_text.lower()[:40]
                specs.append(FlagSpec(names[0], kind, dest, deprecated))
                specs += [FlagSpec(n, kind, dest, deprecated, names[0]) for n in names[1:]]
    return specs


def extract_flags(sglang_dir: Path) -> list[FlagSpec]:
    """Every flag of SGLang's server parser, read from the source tree at `sglang_dir` (the package)."""
    sglang_dir = Path(sglang_dir)
    server_args = sglang_dir / "srt" / "server_args.py"
    tree = ast.parse(server_args.read_text(), filename=str(server_args))
    namespaces: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        ):
            namespaces = [_call_name(e) for e in node.value.elts]
    if not namespaces:
        raise ValueError(f"{server_args}: no _INPUT_NAMESPACES list (an SGLang layout this extractor does not know)")
    imported: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = node.module
    specs: list[FlagSpec] = []
    parsed: dict[str, ast.Module] = {}
    for cls in namespaces:
        module = imported.get(cls)
        if module is None or not module.startswith("sglang."):
            raise ValueError(f"{server_args}: namespace {cls} is not imported from an sglang module")
        path = sglang_dir.joinpath(*module.split(".")[1:]).with_suffix(".py")
        if module not in parsed:
            parsed[module] = ast.parse(path.read_text(), filename=str(path))
        for name, annotation in _class_fields(parsed[module], cls):
            specs.extend(_field_flags(name, annotation))
    specs.extend(_manual_flags(tree))
    seen: dict[str, FlagSpec] = {}
    for spec in specs:
        if spec.flag in seen and seen[spec.flag] != spec:
            raise ValueError(f"flag {spec.flag} declared twice ({seen[spec.flag].field}, {spec.field})")
        seen[spec.flag] = spec
    return list(seen.values())


def sglang_version(sglang_dir: Path) -> str:
    """The version in the `sglang-*.dist-info/METADATA` beside the package (wheels and installs have one)."""
    for info in sorted(Path(sglang_dir).parent.glob("sglang-*.dist-info")):
        meta = info / "METADATA"
        if meta.exists():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(), re.M)
            if m:
                return m.group(1)
    return "unknown"


def live_parser_flags() -> dict[str, tuple[str, str]] | None:
    """{flag: (kind, field)} of an installed SGLang's own server parser (None when SGLang is absent)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return None
    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415 - only on machines with SGLang

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    out = {}
    for flag, action in parser._option_string_actions.items():
        kind = SWITCH if action.nargs == 0 else LIST if action.nargs in ("+", "*") else VALUE
        out[flag] = (kind, action.dest)
    return out


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate tasks/rollout/sglang/flags.txt from SGLang's source")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", help="an sglang wheel (pip download sglang==X --no-deps)")
    src.add_argument("--source", help="an sglang package directory (the folder holding srt/)")
    src.add_argument("--installed", action="store_true", help="the installed sglang (located, not imported)")
    ap.add_argument("--out", default=str(FLAGS_FILE))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing; exit 1 on drift")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.wheel:
            with zipfile.ZipFile(args.wheel) as zf:
                members = [
                    m
                    for m in zf.namelist()
                    if (m.startswith("sglang/") and m.endswith(".py"))
                    or re.match(r"sglang-[^/]+\.dist-info/METADATA$", m)
                ]
                zf.extractall(tmp, members)
            root, source = Path(tmp) / "sglang", Path(args.wheel).name
        elif args.source:
            root, source = Path(args.source), args.source
        else:
            import importlib.util

            spec = importlib.util.find_spec("sglang")
            if spec is None or not spec.submodule_search_locations:
                print("sglang is not installed", file=sys.stderr)
                return 2
            root = Path(list(spec.submodule_search_locations)[0])
            source = str(root)
        flags = extract_flags(root)
        version = sglang_version(root)
        text = format_flag_file(flags, version, source)
    out = Path(args.out)
    if args.check:
        old = parse_flag_file(out.read_text()) if out.exists() else FlagList("none", {})
        new = parse_flag_file(text)
        added, removed = sorted(set(new.flags) - set(old.flags)), sorted(set(old.flags) - set(new.flags))
        print(f"sglang {new.version}: {len(new.flags)} flags; added {added}; removed {removed}")
        return 1 if added or removed else 0
    out.write_text(text)
    print(f"wrote {out}: {len(flags)} flags of sglang {version}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
