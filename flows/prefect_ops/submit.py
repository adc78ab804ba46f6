"""The CLI as a Prefect client: create a flow run through its deployment (what the UI's "Run" does)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional
from uuid import UUID

from rollflow.flows.config import RunConfig
from rollflow.flows.prefect_ops.deployments import SERVED, deployment_name


@dataclass(frozen=True)
class SubmittedRun:
    id: UUID
    name: str
    deployment: str
    url: str


def ui_url(api_url: str, flow_run_id: UUID) -> str:
    return f"{api_url.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"


# RunConfig fields a flow reads outside its form, as a flow run holds them: rl_train's flow-level retries are
# the run's retry policy in Prefect (what the local route sets with `with_options`), not a parameter.
RUN_POLICY_FIELDS: dict[str, tuple[str, ...]] = {"rl_train": ("retries",)}
# RunConfig fields a submitted run cannot carry, with the reason: `--submit` refuses a non-default value.
NOT_SUBMITTABLE: dict[str, dict[str, str]] = {
    "rl_train": {
        "timeout_s": "a flow run's timeout is its flow's, fixed where the deployment is served, and Prefect "
        "has no per-run setting for it",
    },
}
# The debug fields the debug flows take as their own arguments (their forms have no `debug` section); the
# others (the drills) stay at their defaults in a submitted run, so `--submit` refuses them.
DEBUG_ARGUMENTS: dict[str, frozenset[str]] = {
    "rollout_only": frozenset({"rollout_only", "save_debug_rollout_data"}),
    "replay_train": frozenset(
        {"train_only", "load_debug_rollout_data", "load_debug_rollout_data_subsample", "dump_details"}
    ),
}
RETRY_DELAY_S = 5


def refused_fields(flow_name: str, cfg: RunConfig) -> list[str]:
    """One line per field of `cfg` that a submitted run of `flow_name` would silently lose."""
    lost = {
        field: why
        for field, why in NOT_SUBMITTABLE.get(flow_name, {}).items()
        if getattr(cfg, field) != RunConfig.model_fields[field].get_default(call_default_factory=True)
    }
    if flow_name in DEBUG_ARGUMENTS:
        default = type(cfg.debug)()
        for name in type(cfg.debug).model_fields:
            if name not in DEBUG_ARGUMENTS[flow_name] and getattr(cfg.debug, name) != getattr(default, name):
                lost[f"debug.{name}"] = f"{flow_name}'s form has no debug section and takes no such argument"
    return [
        f"{field}={_value(cfg, field)!r} cannot go with --submit: {why}; drop --set {field}=..., or run it "
        "here without --submit"
        for field, why in lost.items()
    ]


def _value(cfg: RunConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def submit(
    flow_name: str,
    parameters: dict[str, Any],
    api_url: str,
    *,
    route: str = SERVED,
    run_name: Optional[str] = None,
    tags: Optional[list[str]] = None,
    retries: Optional[int] = None,
) -> SubmittedRun:
    """Schedule a run of `flow_name`'s deployment now; a worker (`rollflow worker` or a work pool) runs it.
    `retries`: the run's flow-level retries (None: its flow's), each `RETRY_DELAY_S` apart.

    Raises LookupError with the command that registers the deployment when it does not exist."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentFlowRunCreate
    from prefect.client.schemas.objects import FlowRun, FlowRunPolicy
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Scheduled, to_state_create

    name = deployment_name(flow_name, route)
    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise LookupError(
                f"deployment {name!r} is not registered with {api_url}: start `rollflow worker` "
                "(serves every flow) or `prefect deploy --prefect-file infra/prefect.yaml --all`"
            ) from None
        if retries is None:
            run = client.create_flow_run_from_deployment(dep.id, parameters=parameters, name=run_name, tags=tags)
        else:
            # The client's call has no policy argument; the API takes one. Set at creation, not by a later
            # update, so a worker that picks the run up at once already sees it (the flow engine fills in its
            # flow's retries only where the run has none).
            body = DeploymentFlowRunCreate(
                parameters=parameters,
                state=to_state_create(Scheduled()),
                name=run_name,
                tags=list(tags or []),
                empirical_policy=FlowRunPolicy(retries=retries, retry_delay=RETRY_DELAY_S),
            )
            response = client.request(
                "POST",
                "/deployments/{id}/create_flow_run",
                path_params={"id": dep.id},
                json=body.model_dump(mode="json", exclude_unset=True),
            )
            run = FlowRun.model_validate(response.json())
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
