"""What every `rollflow` command shares: consoles, `--config/--set`, the one-line error, the Prefect server.

The command modules (root.py, services.py, tools.py, align.py, bisect.py) import from here and
never from each other, so there is no import circle between them.

Errors: a user error (bad config, missing file, a store that cannot be written, a corrupt artifact,
...) prints one line `error: ...` and exits with code 2; anything else prints one line naming the
exception and exits with code 1. In both cases the full traceback goes to a log file (its path is
printed), and `--traceback` (anywhere on the command line, or ROLLFLOW_TRACEBACK=1) prints it too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Iterator, List, NoReturn, Optional

import typer
from rich.console import Console

from rollflow.artifacts.storage import redact
from rollflow.infra.automations import prepare_flow_runs
from rollflow.infra.local_stack import start_prefect

ConfigOpt = typer.Option(None, "--config", "-c", help="JSON file with RunConfig fields")
SetOpt = typer.Option(None, "--set", "-s", help="override a field: --set train.lr=1e-4 (repeatable)")
TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "ROLLFLOW_TRACEBACK"
LOG_DIR_ENV = "ROLLFLOW_LOG_DIR"

# Exceptions that are the user's to fix (matched by class name anywhere in the MRO, so that Ray's
# wrappers, which subclass the original type, and classes of lazily imported modules both count).
USER_ERROR_NAMES = frozenset(
    {
        "ConfigError",
        "PreflightError",
        "ArtifactError",
        "CheckpointError",
        "DataResumeMismatch",
        "DataExhausted",
        "RunExistsError",
        "RunBusy",
        "ModelDirError",
        "TrainerDoesNotFit",
        "ValueError",
        "FileNotFoundError",
        "PermissionError",
        "NotADirectoryError",
        "IsADirectoryError",
        "KeyError",
        "NotImplementedError",
        "typer.BadParameter",
    }
)


def plain_console(stderr: bool = False) -> Console:
    """A console for data: markup off ("[...]" in responses and URIs prints verbatim), real width in pipes."""
    # Pipes and test runners are not terminals: rich would assume 80 columns and squeeze tables.
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(stderr=stderr, width=width, highlight=False, markup=False)


console = Console()
err_console = Console(stderr=True)


def public(text: str) -> str:
    """`text` safe to print: credential values and the user:secret@ part of every URL replaced by ***."""
    return redact(str(text))


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` (one line, credentials redacted) on stderr and exit with `code`."""
    from rich.markup import escape

    line = " ".join(part.strip() for part in public(message).splitlines() if part.strip())
    plain_console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


def notice(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[yellow]notice:[/] {escape(public(message))}")


def build_config(config: Optional[str], sets: Optional[List[str]], base: dict | None = None):
    """The validated RunConfig of `--config FILE` + `--set key=value` overrides; a bad one is a one-line exit 2."""
    from rollflow.flows.config_loading import ConfigError, load_config  # lazy: keeps torch out of CLI start-up

    try:
        return load_config(config, sets or [], base=base)
    except ConfigError as exc:
        fail(str(exc))


def quiet_prefect_console() -> None:
    """Keep Prefect's per-task INFO lines out of the terminal (they still reach the UI)."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def ensure_prefect_api(port: int = 4200) -> str:
    """Use PREFECT_API_URL if set; else start (or reuse) a local server so runs show in the UI."""
    if os.environ.get("PREFECT_API_URL"):
        return prepare_flow_runs(os.environ["PREFECT_API_URL"])  # heartbeats + the crash-detection automation
    console.print(f"starting a local Prefect server on 127.0.0.1:{port} (stop it with `rollflow server stop`)")
    api = start_prefect(port)
    os.environ["PREFECT_API_URL"] = api
    return prepare_flow_runs(api)


# ----------------------------------------------------------------------------- errors


def traceback_requested() -> bool:
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def take_traceback_flag(argv: list[str]) -> list[str]:
    """`argv` without `--traceback` (accepted anywhere on the line); sets ROLLFLOW_TRACEBACK=1 if present."""
    if TRACEBACK_FLAG in argv:
        os.environ[TRACEBACK_ENV] = "1"
        return [a for a in argv if a != TRACEBACK_FLAG]
    return argv


def log_dir() -> Path:
    explicit = os.environ.get(LOG_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rollflow" / "logs"


def write_trace_log(command: str, exc: BaseException) -> Optional[Path]:
    """The full (redacted) traceback in `log_dir()/{command}-{time}-{pid}.log`; None if it cannot be written."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = log_dir() / f"{command}-{stamp}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        path.write_text(f"rollflow {' '.join(sys.argv[1:])}\n\n{public(text)}")
    except OSError:
        return None
    return path


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    item: Optional[BaseException] = exc
    while item is not None and id(item) not in seen:
        seen.add(id(item))
        yield item
        item = getattr(item, "cause", None) or item.__cause__


def _is_user_error(exc: BaseException) -> bool:
    return any(base.__name__ in USER_ERROR_NAMES for base in type(exc).__mro__)


def _actor_died(exc: BaseException) -> bool:
    return any(
        base.__name__ in ("RayActorError", "ActorDiedError", "WorkerDiedError", "ActorDied", "ActorUnavailable")
        for base in type(exc).__mro__
    )


# The last line of the traceback Ray folds into an actor's error when its __init__ raised: "pkg.module.Name: text".
_RAISED_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*): (.+)$")


def _init_failure(died: BaseException) -> Optional[tuple[str, str]]:
    """(class name, message) of what an actor's constructor raised, from Ray's error text (Ray keeps the text, not
    the exception); None when the actor died some other way."""
    if not getattr(died, "actor_init_failed", False):
        return None
    for line in reversed(str(died).splitlines()):
        found = _RAISED_LINE.match(line.strip())
        if found:
            return found.group(1), found.group(2).strip()
    return None


def error_line(exc: BaseException) -> tuple[str, int]:
    """(one-line message, exit code) for an exception that ended a command."""
    chain = list(_chain(exc))
    if any(type(e).__name__ in ("CancelledRun", "RunCancelled") for e in chain):
        return (
            "the run was cancelled (from the Prefect UI or API) and its workers were stopped; committed "
            "rollouts and checkpoints are kept: run the same command again to resume"
        ), 1
    died = next((e for e in chain if _actor_died(e)), None)
    if died is not None:
        raised = _init_failure(died)
        if raised is not None:  # a worker refused its inputs (or broke) while starting: rerunning changes nothing
            name, text = raised
            if name in USER_ERROR_NAMES:
                return text, 2
            return f"a worker actor could not start ({name}: {text[:300]})", 1
        first = next((line for line in str(died).splitlines() if line.strip()), type(died).__name__)
        return (
            f"a worker actor died during the run ({first.strip()[:300]}); committed rollouts and checkpoints "
            "are kept: run the same command again to resume"
        ), 1
    user = next((e for e in chain if _is_user_error(e)), None)
    if user is not None:
        text = user.args[0] if isinstance(user, KeyError) and user.args else str(user)
        text = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
        return (text or type(user).__name__), 2
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()[:500]}" if first else type(exc).__name__, 1


@contextlib.contextmanager
def user_errors(command: str) -> Iterator[None]:
    """Run a command body: any exception becomes one line (exit 2 for user errors, 1 otherwise)."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with its trace in the log file
        message, code = error_line(exc)
        path = write_trace_log(command, exc)
        if traceback_requested():
            err_console.print(
                public("".join(traceback.format_exception(type(exc), exc, exc.__traceback__))),
                markup=False,
                highlight=False,
            )
        where = f"full trace: {path}" if path else "rerun with --traceback for the full trace"
        if not traceback_requested():
            where += " (or rerun with --traceback)"
        fail(f"{message} [{where}]", code)
