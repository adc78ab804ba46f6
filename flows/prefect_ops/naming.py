"""Flow-run names and tags the UI shows: runs are named after the rollflow run (`exp1`, `exp1/iter-0007`)."""

from __future__ import annotations

from typing import Any, Callable


def run_of(parameters: dict[str, Any]) -> str:
    """The rollflow run name in a flow's parameters (`cfg` for plain flows, `params` for deployments)."""
    for key in ("cfg", "params"):
        value = parameters.get(key)
        if value is not None:
            return str(value["run"] if isinstance(value, dict) else value.run)
    return "rollflow"


def flow_run_name(suffix: str = "") -> Callable[[], str]:
    """A `flow_run_name` callable: '<run><suffix>' with `{rollout_id:04d}`-style fields of the parameters."""

    def name() -> str:
        from prefect.runtime import flow_run

        params = dict(flow_run.parameters or {})
        return run_of(params) + suffix.format(**params)

    name.__name__ = f"flow_run_name{suffix or ''}"
    return name


def run_tags(run: str, mode: str) -> list[str]:
    return ["rollflow", f"run:{run}", f"mode:{mode}"]


def tag_current_run(run: str, mode: str) -> None:
    """Add `run:<name>` and `mode:<mode>` to the current flow run's tags: runs created in the UI or by a
    schedule carry only their deployment's tags. Best effort: tags never fail a run."""
    import logging

    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        with get_client(sync_client=True) as client:
            current = set(client.read_flow_run(flow_run.id).tags or [])
            wanted = current | set(run_tags(run, mode))
            if wanted != current:
                client.update_flow_run(flow_run.id, tags=sorted(wanted))
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("rollflow.naming").warning(f"could not tag flow run {flow_run.id}: {exc}")
