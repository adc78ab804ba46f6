"""Every flow as a deployment: the set `rollflow worker` serves, their names and default parameters.

Each deployable flow's form is its own signature: a section model of the RunConfig it reads
(flows/params.py) plus its own arguments, so a run started from the UI, a schedule, `--submit` or a local
call is one flow under one name.

Two routes register the same five flows under distinct deployment names, so neither overwrites the other:
- `rollflow worker` serves `<flow>/worker` (and the nightly `alignment_check/nightly-alignment`) from one
  process (`prefect.serve`; keep it alive with infra/rollflow-worker.service);
- `prefect deploy --prefect-file infra/prefect.yaml --all` registers `<flow>/pool` (and
  `alignment_check/nightly-alignment-pool`) on a process work pool, run by `prefect worker start`.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow
from prefect.deployments.runner import EntrypointType

from rollflow.flows import alignment, bisect, debug, train
from rollflow.flows.config import RunConfig
from rollflow.flows.params import params_of

SERVED = "worker"  # deployment name of every flow served by `rollflow worker`
POOL = "pool"  # deployment name of every flow in infra/prefect.yaml (a process work pool)
NIGHTLY = alignment.NIGHTLY
NIGHTLY_POOL = "nightly-alignment-pool"


def entry_flows() -> dict[str, Flow]:
    """The deployable flows by name (entrypoints `rollflow.flows.<module>:<name>` in infra/prefect.yaml)."""
    return {
        "rl_train": train.rl_train,
        "rollout_only": debug.rollout_only,
        "replay_train": debug.replay_train,
        "alignment_check": alignment.alignment_check,
        "ima_bisect": bisect.ima_bisect,
    }


def default_parameters(flow_name: str, run: str | None = None) -> dict[str, Any]:
    """Defaults that run on the embedded default (CPU, built-in model, local artifacts)."""
    base = RunConfig(run=run or flow_name.replace("_", "-"))
    return {"params": params_of(flow_name, base)}


def deployment_name(flow_name: str, route: str = SERVED) -> str:
    return f"{flow_name}/{route}"


def served_deployments(
    nightly_cron: str | None = "0 2 * * *", nightly_cfg: RunConfig | None = None, memory_budget_mb: float | None = None
) -> list:
    """RunnerDeployments of all five flows (`<flow>/worker`), plus the scheduled nightly alignment check."""
    out = []
    for name, entry in entry_flows().items():
        out.append(
            entry.to_deployment(
                name=SERVED,
                entrypoint_type=EntrypointType.MODULE_PATH,
                parameters=default_parameters(name),
                tags=["rollflow", name],
                description=f"{entry.description or name} (served by `rollflow worker`)",
            )
        )
    if nightly_cron:
        out.append(alignment.nightly_deployment(nightly_cron, nightly_cfg, memory_budget_mb=memory_budget_mb))
    return out
