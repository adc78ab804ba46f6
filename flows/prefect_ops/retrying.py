"""Prefect retry conditions for storage work (persist, artifact load, checkpoints).

Retrying helps when the object store was briefly unreachable; it cannot help when the data
contract is broken, the id is already committed, the credentials are wrong or the bucket is
missing - those fail at once with their own clear message instead of after every backoff.
"""

from __future__ import annotations

from typing import Any

from rollflow.artifacts.storage import is_permanent, is_transient

# Backoff of the storage tasks: ~7 s of waiting in all covers an endpoint restart or a network blip.
STORAGE_RETRIES = 3
STORAGE_RETRY_DELAYS = [1, 2, 4]


def _exception(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        result = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result: treat as unknown
        return None
    return result if isinstance(result, BaseException) else None


def retry_unless_permanent(task: Any, task_run: Any, state: Any) -> bool:
    """Retry anything except errors a retry cannot cure (artifact contract, conflicts, credentials)."""
    exc = _exception(state)
    return exc is None or not is_permanent(exc)


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only transient storage failures (endpoint down, timeouts, throttling)."""
    exc = _exception(state)
    return exc is not None and is_transient(exc)
