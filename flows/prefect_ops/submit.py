"""The CLI as a Prefect client: create a flow run through its deployment (what the UI's "Run" does)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional
from uuid import UUID

from rollflow.flows.prefect_ops.deployments import SERVED, deployment_name


@dataclass(frozen=True)
class SubmittedRun:
    id: UUID
    name: str
    deployment: str
    url: str


def ui_url(api_url: str, flow_run_id: UUID) -> str:
    return f"{api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"


def submit(
    flow_name: str,
    parameters: dict[str, Any],
    api_url: str,
    *,
    route: str = SERVED,
    run_name: Optional[str] = None,
    tags: Optional[list[str]] = None,
) -> SubmittedRun:
    """Schedule a run of `flow_name`'s deployment now; a worker (`rollflow worker` or a work pool) runs it.

    Raises LookupError with the command that registers the deployment when it does not exist."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    name = deployment_name(flow_name, route)
    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise LookupError(
                f"deployment {name!r} is not registered with {api_url}: start `rollflow worker` "
                "(serves every flow) or `prefect deploy --prefect-file infra/prefect.yaml --all`"
            ) from None
        run = client.create_flow_run_from_deployment(dep.id, parameters=parameters, name=run_name, tags=tags)
    return SubmittedRun(id=run.id, name=run.name, deployment=name, url=ui_url(api_url, run.id))


def watch(
    flow_run_id: UUID, on_change: Callable[[str], None], poll_s: float = 2.0, timeout_s: Optional[float] = None
) -> str:
    """Follow a flow run until it is final; `on_change` gets each new state name. Returns the final one."""
    from prefect.client.orchestration import get_client

    seen = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.name != seen:
                seen = state.name
                on_change(seen)
            if state is not None and state.is_final():
                return state.name
            if deadline is not None and time.monotonic() > deadline:
                return seen or "Unknown"
            time.sleep(poll_s)
