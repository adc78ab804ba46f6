"""At most one active flow run per rollflow run name: a Prefect global concurrency limit keyed on it.

Two runs of one name would share (and kill) each other's named Ray actors and interleave commits; the
second one fails at once with a message instead. The slot is a lease renewed while the run holds it, so a
killed process frees it when the lease expires (LEASE_S) without anyone cleaning up.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import typing
from typing import Any, Callable, Iterator

LEASE_S = 120.0


class RunBusy(RuntimeError):
    """Another flow run holds this rollflow run name."""


def limit_name(run: str) -> str:
    return f"rollflow-run:{run}"


def ensure_limit(run: str) -> str:
    """The run name's limit (1 slot), created if missing; idempotent."""
    from prefect.client.orchestration import get_client

    name = limit_name(run)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit=1)
    return name


@contextlib.contextmanager
def exclusive_run(run: str, wait_s: float = 5.0) -> Iterator[None]:
    """Hold the run name's slot for the block; RunBusy after `wait_s` if another run holds it."""
    from prefect.concurrency.sync import concurrency

    name = ensure_limit(run)
    held = contextlib.ExitStack()
    try:
        held.enter_context(concurrency(name, occupy=1, timeout_seconds=wait_s, lease_duration=LEASE_S, strict=True))
    except TimeoutError:
        raise RunBusy(
            f"run {run!r} is active in another flow run (Prefect concurrency limit {name!r}): wait for it to end, "
            "cancel it in the UI, or choose another run name (--set run=NAME); a killed run frees the name within "
            f"{LEASE_S:.0f} s") from None
    with held:
        yield


def one_run_at_a_time(run_of: Callable[[Any], str] = lambda cfg: cfg.run):
    """Decorator for a flow function whose first argument is its RunConfig: the body holds the run's slot."""

    def wrap(fn):
        @functools.wraps(fn)
        def locked(cfg, *args, **kwargs):
            with exclusive_run(run_of(cfg)):
                return fn(cfg, *args, **kwargs)

        # Prefect builds the parameter model from these: resolved types, since `fn`'s module globals (where its
        # postponed annotations live) are not this module's.
        locked.__annotations__ = typing.get_type_hints(fn)
        locked.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
        return locked

    return wrap
