"""Flow-run names and tags the UI shows: runs are named after the rollflow run (`exp1`, `exp1/iter-0007`)."""

from __future__ import annotations

from typing import Any, Callable


def run_of(parameters: dict[str, Any]) -> str:
    """The rollflow run name in a flow's parameters (`cfg` for plain flows, `params` for deployments)."""
    for key in ("cfg", "params"):
        value = parameters.get(key)
        if value is not None:
            return str(value["run"] if isinstance(value, dict) else getattr(value, "run"))
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
